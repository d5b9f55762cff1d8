"""SiLU-and-mul: silu(gate) * up, element-wise."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from detent.kernels.registry import register


@register("act", "torch_rowwise")
def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]
