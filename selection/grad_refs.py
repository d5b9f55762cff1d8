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


def attention(q, k, v, *prior, query_start_loc: tuple[int, ...], scale: float,
              prior_counts: tuple[int, ...] = ()):
    """Causal attention per sequence. q: [T, H, D]; k, v: [T, KVH, D]
    (grouped-query: H a multiple of KVH). A sequence scored in chunks also
    attends to the K/V its earlier chunks wrote: `prior` is those K chunks
    then the V chunks, `prior_counts[b]` of each for sequence b, in order."""
    out = []
    g = q.shape[1] // k.shape[1]
    half = len(prior) // 2
    pk, pv = iter(prior[:half]), iter(prior[half:])
    for b in range(len(query_start_loc) - 1):
        s, e = query_start_loc[b], query_start_loc[b + 1]
        c = prior_counts[b] if prior_counts else 0
        kb = torch.cat([next(pk) for _ in range(c)] + [k[s:e]])
        vb = torch.cat([next(pv) for _ in range(c)] + [v[s:e]])
        if e == s:
            continue
        # KV heads repeated rather than enable_gqa, so that float32 SDPA can take its
        # memory-efficient kernel on GPU instead of materializing [H, L, L] scores
        kb, vb = (t.repeat_interleave(g, 1).transpose(0, 1) for t in (kb, vb))  # [H, P + L, D]
        qb, n = q[s:e].transpose(0, 1), kb.shape[1] - (e - s)  # n: positions before the chunk
        if n == 0:
            o = F.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)  # [H, L, D]
        else:  # query i sits at absolute position n + i and sees keys 0 .. n + i
            mask = torch.arange(kb.shape[1], device=q.device)[None, :] <= n + torch.arange(e - s, device=q.device)[:, None]
            o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, scale=scale)
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
