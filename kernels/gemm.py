"""GEMM candidates (torch): y = x @ w.T (+ b).

`torch` is the library call on the real M: the stock choice. Its row bits
depend on M (MKL fp32 picks different kernels for M = 1, 2-3, >= 4; cuBLAS
bf16 differs between M = 1 and M >= 64). `torch_chunked` runs the library
GEMM on fixed-size zero-padded row chunks: every chunk has one shape, so one
kernel. One shape is not enough on every MKL path: its AVX2 kernels give a
row of a narrow product (N <= NARROW_N) other bits at other positions of the
same chunk (measured with K >= 96, N <= 64; tests/kernels/test_cpu_isa.py),
so narrow products run one row per call. A row's bits then depend only on
its own values, whatever the ISA.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from detent.kernels.registry import register

NARROW_N = 64


@register("gemm", "torch")
def gemm_torch(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, bias)


@register("gemm", "torch_chunked", params=("chunk",))
def gemm_torch_chunked(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                       chunk: int) -> torch.Tensor:
    m, k = x.shape
    if w.shape[0] <= NARROW_N:
        chunk = 1
    pad = (-m) % chunk
    if pad:
        x = torch.cat([x, x.new_zeros(pad, k)])
    out = x.new_empty(m + pad, w.shape[0])
    wt = w.t()
    for i in range(0, m + pad, chunk):
        torch.mm(x[i:i + chunk], wt, out=out[i:i + chunk])  # [chunk, K] @ [K, N]
    out = out[:m]
    if bias is not None:
        out = out + bias
    return out
