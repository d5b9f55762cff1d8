"""RMSNorm (+ fused residual add), row-wise in float32 (torch)."""
from __future__ import annotations

import torch

from detent.kernels.registry import register


@register("norm", "torch_rowwise")
def rms_norm_torch(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None):
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    y = w * (xf * torch.rsqrt(var + eps)).to(x.dtype)  # as transformers: weight * normed.to(dtype)
    return y if residual is None else (y, residual)
