"""Row-wise log-softmax in float32."""
from __future__ import annotations

import torch

from detent.kernels.registry import register


@register("logsoftmax", "torch_rowwise")
def log_softmax_torch(logits: torch.Tensor) -> torch.Tensor:
    return torch.log_softmax(logits.float(), dim=-1)
