"""Reference torch math for each kernel family, the functions the trainer's
backward differentiates (`selection/autograd.py`).

Each takes the family's tensor inputs already cast to the compute dtype
(float32, or float64 under gradcheck) plus the call's static arguments, and
computes what the family's candidates compute, in plain differentiable torch.
The candidates' forwards agree with these to rounding (tests/rl), so their
gradients are the gradients of the served forward to that precision.
"""
from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.nn.functional as F


def linear(x, w, bias):
    return F.linear(x, w, bias)  # [M, K] @ [N, K].T


def linear_vjp(x, w, bias, grad, *, needs: tuple[bool, ...]):
    """`linear`'s gradients in closed form: the products autograd of `linear`
    computes, without the forward GEMM that differentiating it would recompute.
    grad: [M, N]; returns (dx [M, K], dw [N, K], dbias [N]), None where not needed."""
    return (grad @ w if needs[0] else None, grad.t() @ x if needs[1] else None,
            grad.sum(0) if bias is not None and needs[2] else None)


def attention(q, k, v, *prior, query_start_loc: tuple[int, ...], scale: float,
              prior_counts: tuple[int, ...] = ()):
    """Causal attention per sequence. q: [T, H, D]; k, v: [T, KVH, D]
    (grouped-query: H a multiple of KVH). A sequence scored in chunks also
    attends to the K/V its earlier chunks wrote: `prior` is those K chunks
    then the V chunks, `prior_counts[b]` of each for sequence b, in order.

    The sequences run as a few padded batches (`_attention_plan`), not one
    SDPA per sequence: a step of 128 short sequences is then a handful of
    launches per layer, forward and backward, instead of hundreds."""
    half = len(prior) // 2
    sizes = tuple(t.shape[0] for t in prior[:half])
    plan = _attention_plan(tuple(query_start_loc), tuple(prior_counts), sizes, q.device)
    if plan is None:  # no query rows
        return q.new_zeros(q.shape)
    pool_k = torch.cat([*prior[:half], k]) if half else k  # [earlier chunks | this step, KVH, D]
    pool_v = torch.cat([*prior[half:], v]) if half else v
    g, (h, d) = q.shape[1] // k.shape[1], q.shape[1:]
    out = []
    for qidx, kidx, mask, keep in plan.groups:
        (b, lq), lk = qidx.shape, kidx.shape[1]
        qb = q.index_select(0, qidx.flatten()).view(b, lq, h, d).transpose(1, 2)  # [B, H, Lq, D]
        # KV heads repeated rather than enable_gqa, so that float32 SDPA can take its
        # memory-efficient kernel on GPU instead of materializing [H, L, L] scores
        kb, vb = (t.index_select(0, kidx.flatten()).view(b, lk, -1, d).repeat_interleave(g, 2).transpose(1, 2)
                  for t in (pool_k, pool_v))  # [B, H, Lk, D]
        o = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=mask, is_causal=mask is None, scale=scale)
        out.append(o.transpose(1, 2).reshape(b * lq, h, d).index_select(0, keep))
    return torch.cat(out).index_select(0, plan.order)  # back in packed row order


class _AttentionPlan(NamedTuple):
    groups: list  # (q rows [B, Lq], key pool rows [B, Lk], mask [B, 1, Lq, Lk] or None (causal), kept rows)
    order: torch.Tensor  # packed row t's position among the groups' kept rows


@functools.lru_cache(maxsize=16)
def _attention_plan(qsl: tuple[int, ...], counts: tuple[int, ...], sizes: tuple[int, ...],
                    device: torch.device) -> "_AttentionPlan | None":
    """How `attention` batches one step's sequences (computed once per step and
    shared by every layer). Sequence b has Lq = qsl[b + 1] - qsl[b] queries and
    Lk = n + Lq keys: the n positions of its earlier chunks (`counts[b]` chunks
    of the prior pool, whose chunk sizes are `sizes`) then its own. Sequences
    sorted by length are grouped while padding each group to its longest at
    most doubles the group's score entries; query i of sequence b sees keys
    0 .. n + i; a padding query sees key 0 only (no empty softmax row; its
    output is dropped, so no gradient flows from it)."""
    nseq, base = len(qsl) - 1, sum(sizes)
    counts = counts or (0,) * nseq
    seqs, chunk = [], 0  # (Lq, Lk, query rows, key pool rows)
    for b in range(nseq):
        keys, first = [], sum(sizes[:chunk])
        for c in range(chunk, chunk + counts[b]):
            keys.append(torch.arange(first, first + sizes[c]))
            first += sizes[c]
        chunk += counts[b]
        keys.append(torch.arange(base + qsl[b], base + qsl[b + 1]))
        lq = qsl[b + 1] - qsl[b]
        if lq:
            seqs.append((lq, sum(len(t) for t in keys), torch.arange(qsl[b], qsl[b + 1]), torch.cat(keys)))
    if not seqs:
        return None
    seqs.sort(key=lambda s: (-s[1], -s[0]))
    groups, cur = [], [seqs[0]]
    for s in seqs[1:]:
        padded = (len(cur) + 1) * cur[0][0] * cur[0][1] if s[0] <= cur[0][0] else float("inf")
        if padded <= 2 * (sum(c[0] * c[1] for c in cur) + s[0] * s[1]):
            cur.append(s)
        else:
            groups.append(cur)
            cur = [s]
    groups.append(cur)
    plan, rows = [], []
    for grp in groups:
        lq_max, lk_max = max(s[0] for s in grp), grp[0][1]
        lq = torch.tensor([s[0] for s in grp])[:, None, None]
        n = torch.tensor([s[1] - s[0] for s in grp])[:, None, None]
        i, j = torch.arange(lq_max)[None, :, None], torch.arange(lk_max)[None, None, :]
        causal = all(s[0] == lq_max and s[1] == lq_max for s in grp)  # square, unpadded: is_causal
        mask = None if causal else (((j <= n + i) & (i < lq)) | ((i >= lq) & (j == 0)))[:, None]
        qidx = torch.stack([torch.nn.functional.pad(s[2], (0, lq_max - s[0])) for s in grp])
        kidx = torch.stack([torch.nn.functional.pad(s[3], (0, lk_max - s[1])) for s in grp])
        keep = (torch.arange(lq_max)[None, :] < lq[:, :, 0]).flatten().nonzero()[:, 0]
        rows += [s[2] for s in grp]
        plan.append(tuple(None if t is None else t.to(device) for t in (qidx, kidx, mask, keep)))
    order = torch.empty(qsl[-1], dtype=torch.long)
    order[torch.cat(rows)] = torch.arange(qsl[-1])
    return _AttentionPlan(plan, order.to(device))


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
