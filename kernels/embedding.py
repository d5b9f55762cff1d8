"""Token embedding lookup (a gather: row-wise by construction)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from detent.kernels.registry import register


@register("embedding", "torch_rowwise")
def embedding_torch(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return F.embedding(ids, weight)
