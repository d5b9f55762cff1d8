"""DeepGEMM's SM90 BF16 GEMM (`sgl-deep-gemm` 0.2.5) as the GEMM candidate `deepgemm`.

Not measured yet: no session has run it on the GPU machine, so nothing
selects it (no SelIR program, no default tuple names it). It is here so the
next GPU session can measure it through the dispatcher
(docs/performance.md, "DeepGEMM (issue 19 item 3)").

DeepGEMM compiles each kernel configuration at first use by running NVCC
(12.9 or newer, found through CUDA_HOME/CUDA_PATH, `which nvcc`, or
/usr/local/cuda) and caches the cubin on disk; NVRTC is not a compile path
in 0.2.5. Its `_C.so` is a CUDA 13 build linked against libtorch. The
candidate registers only when that exact version is installed, the GPU is
sm90 and `deep_gemm` imports; otherwise the registry records why
(`registry.unavailable`).

What reads the batch: `bf16_gemm_nt` takes no configuration. Its SM90
heuristic picks block M/N, the TMA-multicast cluster and the pipeline depth
from the call's M, N, K and the SM count it was given. Block K is fixed (64
for bf16) and the kernel walks K in ascending order with no split-K, so the
configuration may well not change a row's bits, but nobody has checked that
on the device. So this candidate pins what the heuristic reads instead:
every call sees M = `chunk` (rows zero-padded, as `torch_chunked` does), and
`num_sms` is set before the call. One (chunk, N, K, num_sms) means one
configuration and one compiled kernel. `chunk=0` calls it on the real M,
which is the unpinned control the GPU tests compare against.
"""
from __future__ import annotations

from types import ModuleType

import torch

from detent.kernels.optional import gpu_problem, version_problem
from detent.kernels.registry import register, unavailable

DG_VERSION = "0.2.5"
INSTALL = 'pip install "detent[deepgemm]"'
PARAMS = ("chunk", "num_sms")
_API = ("bf16_gemm_nt", "set_num_sms", "get_num_sms")

_DG: ModuleType | None = None  # the deep_gemm module once registered


def gemm_deepgemm(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                  chunk: int, num_sms: int) -> torch.Tensor:
    """y[M, N] = x[M, K] @ w[N, K].T (+ bias), bf16 in and out."""
    name = "gemm/deepgemm"
    if x.dim() != 2 or w.dim() != 2 or x.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: x must be [M, K] and w [N, K]; got {tuple(x.shape)}, {tuple(w.shape)}")
    if x.dtype != torch.bfloat16 or w.dtype != torch.bfloat16:
        raise TypeError(f"{name}: DeepGEMM's bf16_gemm_nt takes bf16 x and w; got {x.dtype}, {w.dtype}")
    if chunk < 0 or num_sms <= 0 or num_sms % 2:
        # DeepGEMM asserts an even SM count (its clusters pair SMs)
        raise ValueError(f"{name}: chunk must be >= 0 and num_sms even and positive; got {chunk}, {num_sms}")
    if _DG is None:
        raise RuntimeError(f"{name}: DeepGEMM is not loaded in this process: {INSTALL}")
    m, k = x.shape
    n = w.shape[0]
    if m == 0:
        return x.new_empty(0, n)
    x, w = x.contiguous(), w.contiguous()  # TMA reads rows by stride
    if _DG.get_num_sms() != num_sms:
        _DG.set_num_sms(num_sms)  # process-wide in DeepGEMM; set per call so no other caller's value leaks in
    step = chunk or m
    out = torch.empty(m + (-m) % step, n, dtype=torch.bfloat16, device=x.device)
    full = m - m % step
    for i in range(0, full, step):
        _DG.bf16_gemm_nt(x[i:i + step], w, out[i:i + step])
    if full < m:  # the last rows, zero-padded to one chunk so the heuristic sees the same M
        tail = x.new_zeros(step, k)
        tail[:m - full] = x[full:]
        _DG.bf16_gemm_nt(tail, w, out[full:])
    out = out[:m]
    if bias is not None:
        # after the GEMM's bf16 rounding (cuBLAS adds it before): another rounding, still row-local
        out = out + bias
    return out


def register_deepgemm(dg: ModuleType) -> None:
    """Register `deepgemm` calling module `dg` (tests pass a stand-in)."""
    global _DG
    _DG = dg
    register("gemm", "deepgemm", params=PARAMS, devices=("cuda",))(gemm_deepgemm)


def load_deepgemm() -> tuple[ModuleType | None, str | None]:
    """(the deep_gemm module, None), or (None, why it cannot run here)."""
    why = (version_problem("sgl-deep-gemm", DG_VERSION, "deepgemm", INSTALL)
           or gpu_problem("DeepGEMM's BF16 GEMM candidate needs an sm90 GPU",
                          lambda major, minor: (major, minor) == (9, 0)))
    if why is not None:
        return None, why
    try:
        import deep_gemm
    except Exception as e:  # noqa: BLE001  (OSError loading _C.so, AssertionError finding CUDA: say which)
        # torch.ops.load_library hides the loader's reason (an undefined symbol: the wheel's torch
        # ABI, lease 15) in __cause__: say it
        cause = f" <- {type(e.__cause__).__name__}: {e.__cause__}" if e.__cause__ is not None else ""
        return None, (f"deep_gemm does not import ({type(e).__name__}: {e}{cause}); it needs the CUDA 13 torch "
                      f"its _C.so was built against and NVCC >= 12.9 (CUDA_HOME or nvcc on PATH)")
    missing = [a for a in _API if not hasattr(deep_gemm, a)]
    if missing:
        return None, f"deep_gemm lacks {missing}; {INSTALL}"
    return deep_gemm, None


_dg, _why = load_deepgemm()
if _dg is not None:
    register_deepgemm(_dg)
else:
    unavailable("gemm", "deepgemm", _why)
