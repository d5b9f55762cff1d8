"""Reference torch math for each kernel family, the functions the trainer's
backward differentiates (`selection/autograd.py`).

Each takes the family's tensor inputs already cast to the compute dtype
(float32, or float64 under gradcheck) plus the call's static arguments, and
computes what the family's candidates compute, in plain differentiable torch.
The candidates' forwards agree with these to rounding (tests/rl), so their
gradients are the gradients of the served forward to that precision.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x, w, bias):
    return F.linear(x, w, bias)  # [M, K] @ [N, K].T


def attention(q, k, v, *, query_start_loc: tuple[int, ...], scale: float):
    """Causal attention per sequence, each sequence's whole KV in this step.
    q: [T, H, D]; k, v: [T, KVH, D] (grouped-query: H a multiple of KVH)."""
    out = []
    g = q.shape[1] // k.shape[1]
    # KV heads repeated rather than enable_gqa, so that float32 SDPA can take its
    # memory-efficient kernel on GPU instead of materializing [H, L, L] scores
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # [T, H, D]
    for b in range(len(query_start_loc) - 1):
        s, e = query_start_loc[b], query_start_loc[b + 1]
        if e == s:
            continue
        qb, kb, vb = (t[s:e].transpose(0, 1) for t in (q, k, v))
        o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)  # [H, L, D]
        out.append(o.transpose(0, 1))  # [L, H, D]
    return torch.cat(out) if out else q.new_zeros(q.shape)


def rms_norm(x, w, residual, *, eps: float):
    s = x if residual is None else x + residual
    y = w * (s * torch.rsqrt(s.pow(2).mean(-1, keepdim=True) + eps))
    return y if residual is None else (y, s)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope(q, k, positions, cos_sin):
    half = q.shape[-1] // 2
    cs = cos_sin.index_select(0, positions.long())  # [T, D]
    cos, sin = cs[:, None, :half], cs[:, None, half:]
    return _rotate(q, cos, sin), _rotate(k, cos, sin)


def silu_and_mul(x):
    i = x.shape[-1] // 2
    return F.silu(x[..., :i]) * x[..., i:]


def embedding(ids, weight):
    return F.embedding(ids, weight)


def log_softmax(logits):
    return torch.log_softmax(logits, dim=-1)


def moe(x, router_logits, w13, w2, *, top_k: int, renormalize: bool):
    """Softmax top-k routing; each token sums its experts' SwiGLU outputs
    weighted by the routing probabilities (differentiable in both)."""
    probs = torch.softmax(router_logits, dim=-1)
    topw, topi = torch.topk(probs, top_k, dim=-1)  # [M, k]
    if renormalize:
        topw = topw / topw.sum(-1, keepdim=True)
    out = torch.zeros_like(x)
    for e in torch.unique(topi).tolist():
        rows, slots = torch.nonzero(topi == e, as_tuple=True)
        y = F.linear(silu_and_mul(F.linear(x.index_select(0, rows), w13[e])), w2[e])  # [r, H]
        out = out.index_add(0, rows, y * topw[rows, slots, None])
    return out
