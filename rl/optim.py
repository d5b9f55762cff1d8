"""AdamW with float32 master weights for a bf16/fp16 policy.

The trainer's parameters must stay in the engine's dtype (its forward is the
engine's, bit for bit), but AdamW steps of ~1e-5 on bf16 weights mostly
round away. So the optimizer steps float32 copies and writes their rounding
back into the parameters, the tensors the engine then receives. For float32
parameters it is plain AdamW on them.
"""
from __future__ import annotations

from typing import Iterable

import torch


class MasterWeightsAdamW:
    def __init__(self, params: Iterable[torch.nn.Parameter], **adamw_kwargs):
        self.params = [p for p in params if p.requires_grad]
        self.master = [p if p.dtype == torch.float32 else p.detach().float().clone().requires_grad_(True)
                       for p in self.params]
        self.opt = torch.optim.AdamW(self.master, **adamw_kwargs)

    def zero_grad(self) -> None:
        for p, m in zip(self.params, self.master):
            p.grad = None
            m.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, m in zip(self.params, self.master):
            if m is not p and p.grad is not None:
                m.grad = p.grad.float()
        self.opt.step()
        for p, m in zip(self.params, self.master):
            if m is not p:
                p.copy_(m)  # round to the policy's dtype
