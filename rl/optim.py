"""AdamW with float32 master weights for a bf16/fp16 policy.

The trainer's parameters must stay in the engine's dtype (its forward is the
engine's, bit for bit), but AdamW steps of ~1e-5 on bf16 weights mostly
round away. So the optimizer steps float32 copies and writes their rounding
back into the parameters, the tensors the engine then receives. For float32
parameters it is plain AdamW on them.

Every step works on all tensors at once: the gradient casts and the
write-back are `torch._foreach_copy_` calls, and AdamW runs its fused
(one-kernel) form unless `foreach` or `fused` is given. A 30-layer model
then steps in a handful of launches instead of several per parameter.
"""
from __future__ import annotations

from typing import Iterable

import torch


class MasterWeightsAdamW:
    def __init__(self, params: Iterable[torch.nn.Parameter], **adamw_kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
                       for p in self.params]
        if "foreach" not in adamw_kwargs and "fused" not in adamw_kwargs:
            adamw_kwargs["fused"] = True
        self.opt = torch.optim.AdamW(self.master, **adamw_kwargs)

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.master):
            p.grad = None
            m.grad = None

    @torch.no_grad()
    def step(self) -> None:
        cast = [(p, m) for p, m in zip(self.params, self.master) if m is not p]
        graded = [(p, m) for p, m in cast if p.grad is not None]
        for p, m in graded:
            m.grad = torch.empty_like(m)
        if graded:
            torch._foreach_copy_([m.grad for _, m in graded], [p.grad for p, _ in graded])  # to float32
        self.opt.step()
        if cast:
            torch._foreach_copy_([p for p, _ in cast], [m for _, m in cast])  # round to the policy's dtype
