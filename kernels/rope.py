"""Rotary position embedding, rotate-half (NeoX) layout, element-wise in float32."""
from __future__ import annotations

import torch

from detent.kernels.registry import register


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@register("rope", "torch_rowwise")
def rope_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    half = q.shape[-1] // 2
    cs = cos_sin.index_select(0, positions.long())  # [T, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
