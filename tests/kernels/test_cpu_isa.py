"""Every CPU candidate is row-invariant on every code path the CPU libraries
can take, not only on the one this host picks: tests/kernels/cpu_rowcheck.py
runs in a fresh process under each ISA that ATen, MKL and oneDNN can be
forced to (they read these variables once, when loaded). A path the host
cannot run (AVX-512 on an AVX2 host, AMX without AMX) is left out."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "cpu_rowcheck.py")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


FLAGS = _cpu_flags()
AVX512, AMX = "avx512f" in FLAGS, "amx_tile" in FLAGS
ISAS = [
    {},
    {"OMP_NUM_THREADS": "1"},
    {"ATEN_CPU_CAPABILITY": "default"},
    {"ATEN_CPU_CAPABILITY": "avx2"},
    {"MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    {"MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    {"MKL_CBWR": "COMPATIBLE"},
    {"MKL_CBWR": "AVX2"},
    {"ONEDNN_MAX_CPU_ISA": "AVX2"},
]
if AVX512:
    ISAS += [{"ATEN_CPU_CAPABILITY": "avx512"}, {"MKL_ENABLE_INSTRUCTIONS": "AVX512"}, {"MKL_CBWR": "AVX512"},
             {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE"}]
if AMX:
    ISAS += [{"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_AMX"}]


def run_rowcheck(env: dict[str, str]) -> dict:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("ATEN_CPU", "MKL_", "ONEDNN_"))}
    full.update(env)
    p = subprocess.run([sys.executable, SCRIPT], env=full, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)


@pytest.mark.parametrize("env", ISAS, ids=lambda e: ",".join(f"{k}={v}" for k, v in e.items()) or "native")
def test_cpu_candidates_are_row_invariant_under_forced_isa(env):
    out = run_rowcheck(env)
    if "ATEN_CPU_CAPABILITY" in env:  # the variable took effect
        assert out["aten_capability"].lower() == env["ATEN_CPU_CAPABILITY"].lower()
    assert out["failures"] == [], f"under {env or 'the native ISA'}: " + "; ".join(out["failures"])
    assert out["controls"], "the stock GEMM on the real M was not caught: the checks cannot fail"
