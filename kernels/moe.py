"""Mixture-of-experts candidates (torch).

Routing: softmax over experts in float32, top-k, optional renormalisation.
Each token's output is the sum of its k experts' outputs in slot order
(k = 0, 1, ...), so the combine never depends on the batch. The expert
GEMMs see a batch-dependent number of rows: `torch_loop` runs them on the
real row count (stock); `torch_chunked` runs them on fixed row chunks.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from detent.kernels.gemm import gemm_torch_chunked
from detent.kernels.registry import register


def _moe(x, router_logits, w13, w2, top_k, renormalize, gemm):
    m, hdim = x.shape
    probs = torch.softmax(router_logits.float(), dim=-1)
    topw, topi = torch.topk(probs, top_k, dim=-1)  # [M, k]
    if renormalize:
        topw = topw / topw.sum(-1, keepdim=True)
    topw = topw.to(x.dtype)
    per_slot = x.new_zeros(m, top_k, hdim)
    for e in torch.unique(topi).tolist():
        rows, slots = torch.nonzero(topi == e, as_tuple=True)
        h = gemm(x.index_select(0, rows), w13[e])  # [r, 2I]
        i = h.shape[-1] // 2
        a = F.silu(h[:, :i]) * h[:, i:]
        per_slot[rows, slots] = gemm(a, w2[e]) * topw[rows, slots, None]
    out = per_slot[:, 0]
    for s in range(1, top_k):
        out = out + per_slot[:, s]
    return out


@register("moe", "torch_loop", params=("row_key",))
def moe_torch_loop(x, router_logits, w13, w2, top_k, renormalize, row_key: int = 0):
    return _moe(x, router_logits, w13, w2, top_k, renormalize, lambda a, w: F.linear(a, w))


@register("moe", "torch_chunked", params=("chunk", "row_key"))
def moe_torch_chunked(x, router_logits, w13, w2, top_k, renormalize, chunk: int, row_key: int = 0):
    return _moe(x, router_logits, w13, w2, top_k, renormalize,
                lambda a, w: gemm_torch_chunked(a, w, None, chunk))
