"""vLLM's load generator without vLLM's server, for Detent-only serving runs.

`benchmarks/serve_load.py` drives every server with `vllm bench serve` (in one
process, `bench_worker.py`). Carrying the whole vLLM peer to the GPU machine
takes four calls (about 210 MB in chunks under the carry limit); the load
generator itself is pure Python. This script builds, from the peer's chunks
(`.peer/c1` ... `.peer/c4`, made by the vLLM peer's `build.sh`), one folder
that travels in the same call as the run:

- `OUT/vsite-bench.tgz`: the vLLM wheel's Python files (no compiled
  extensions, no DeepGEMM) and the few wheels `vllm.benchmarks.serve` imports
  that the GPU machine's image lacks (about 12 MB);
- `OUT/*.whl`: Detent's runtime dependencies that neither the image nor the
  device wheels (`.whl`) hold.

On the device (carry OUT and `.whl`): install `.whl/*.whl OUT/*.whl` into
/tmp/site, untar the bundle into /tmp/vbench, and run `serve_load.py run
--vllm-path /tmp/vbench:/tmp/site ...` (vLLM's config imports pydantic, which
is in /tmp/site). Only Detent's own arms can run this way: a side by side
still needs `vllm serve`, so the whole peer.

Usage: python benchmarks/loadgen_bundle.py [--peer .peer] [--out .bench]
"""
from __future__ import annotations

import argparse
import glob
import os
import shutil
import tarfile
import tempfile
import zipfile

# imported by vllm.benchmarks.serve (and its datasets) and not in the GPU image (vLLM 0.20.2)
LOADGEN_WHEELS = ("cachetools", "cbor2", "gguf", "httpcore2", "httpx2", "jiter", "msgspec", "openai", "openai_harmony",
                  "pybase64", "pyzmq", "sniffio", "truststore")
# Detent's runtime dependencies that the image and the device wheels lack
DETENT_WHEELS = ("partial_json_parser", "jsonschema", "jsonschema_specifications", "referencing", "rpds_py", "gguf")

NO_NVML = '''"""NVML for vLLM's load generator without its kernels (benchmarks/loadgen_bundle.py): none."""


class NVMLError(Exception):
    pass


def nvmlInit():
    raise NVMLError("no NVML in the load-generator bundle")


def nvmlShutdown():
    pass
'''


def _wheel(peer: str, name: str) -> str:
    hits = [p for p in glob.glob(os.path.join(peer, "c*", "*.whl")) if os.path.basename(p).split("-")[0] == name]
    if not hits:
        raise SystemExit(f"no {name} wheel under {peer}/c*: build the vLLM peer first")
    return hits[0]


def _vllm_wheel(peer: str, tmp: str) -> str:
    parts = sorted(glob.glob(os.path.join(peer, "c*", "vllm-*.whl.part*")), key=lambda p: p.rsplit("part", 1)[1])
    if not parts:
        raise SystemExit(f"no vLLM wheel parts under {peer}/c*")
    path = os.path.join(tmp, os.path.basename(parts[0]).rsplit(".part", 1)[0])
    with open(path, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                shutil.copyfileobj(f, out)
    return path


def build(peer: str, out: str) -> None:
    os.makedirs(out, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        site = os.path.join(tmp, "site")
        with zipfile.ZipFile(_vllm_wheel(peer, tmp)) as z:
            for n in z.namelist():
                base = os.path.basename(n)
                if n.startswith("vllm/") and ".so" not in base and "/deep_gemm/" not in n:
                    z.extract(n, site)
        # no NVML: on a GPU machine vLLM would resolve its CUDA platform, whose import loads the
        # compiled kernels this bundle leaves out; with NVML absent it resolves none, as on a CPU
        with open(os.path.join(site, "vllm", "third_party", "pynvml.py"), "w") as f:
            f.write(NO_NVML)
        for w in LOADGEN_WHEELS:  # a wheel is a zip of its site-packages files (for the device's Python 3.12)
            with zipfile.ZipFile(_wheel(peer, w)) as z:
                z.extractall(site)
        bundle = os.path.join(out, "vsite-bench.tgz")
        with tarfile.open(bundle, "w:gz") as t:
            t.add(site, arcname=".")
    for w in DETENT_WHEELS:
        shutil.copy(_wheel(peer, w), out)
    size = sum(os.path.getsize(p) for p in glob.glob(os.path.join(out, "*")))
    print(f"{out}: {size / 1e6:.1f} MB (carry it with .whl)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--peer", default=".peer")
    ap.add_argument("--out", default=".bench")
    a = ap.parse_args()
    build(a.peer, a.out)


if __name__ == "__main__":
    main()
