"""The sampler: one call per step over the rows that sample a token.

Contract:
- `logits` is [R, V] float32, one row per sampled token, already gathered
  by the runner; rows are independent: nothing here may mix rows.
- `rows[i]` describes row i's request (params, seed, absolute position of
  the token being sampled, sample index, the tokens so far).
- Every per-row result depends only on that row's logits and its
  SamplingRow — never on R or on the row's index.

How: the random bits come from the keyed Philox RNG (rng.py), exact integer
arithmetic. Everything else is an op whose per-row result does not depend on
the other rows: elementwise arithmetic, comparisons, where/gather/scatter,
stable sorts, argmax (first maximum), and the last-dim softmax/log_softmax
kernels; no cumsum (top-p uses a fixed-order scan) and no cross-row
reduction. tests/sampling/test_row_invariance.py checks each of these, and
the whole sampler, for a row alone against the same row at other positions
in batches of other sizes.

Sampling is Gumbel-max: token = argmax(z + g) over the allowed tokens, z the
processed logits, g = -log(-log(u)) from the keyed uniforms. Greedy rows
(temperature < 1e-5) take argmax(z), ties to the lowest id.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from detent.sampling import processors as P
from detent.sampling.params import SamplingParams
from detent.sampling.rng import ROLE_SAMPLE, gumbel_from_bits, random_bits, random_bits_at
from detent.selection import ops


@dataclass(frozen=True)
class SamplingRow:
    params: SamplingParams
    seed: int
    position: int  # absolute position of the token being sampled
    sample_index: int = 0
    prompt_token_ids: Sequence[int] = ()
    output_token_ids: Sequence[int] = ()
    golden_token: int | None = None  # teacher forcing: emit this token
    grammar: Any = None  # per-request GrammarState (sampling/grammar.py), or None
    eos_token_ids: Sequence[int] = ()  # masked while len(output) < params.min_tokens
    role: int = ROLE_SAMPLE


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # chosen token's logprob (raw or processed per row)
    ranks: list[int]  # 1-based rank of the chosen token under the reported distribution
    topk_ids: list[list[int]] = field(default_factory=list)  # per row, up to its params.logprobs
    topk_logprobs: list[list[float]] = field(default_factory=list)


def _needs_noise(r: SamplingRow) -> bool:
    return r.golden_token is None and not r.params.greedy


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    R, V = logits.shape
    if R != len(rows):
        raise ValueError(f"sample: {R} logits rows but {len(rows)} SamplingRows")
    out = SamplerOutput([0] * R, [0.0] * R, [0] * R, [[] for _ in rows], [[] for _ in rows])
    if R == 0:
        return out
    logits = logits.float()
    if len({r.role for r in rows}) != 1:
        raise ValueError(f"sample: one role per call, got {sorted({r.role for r in rows})}")
    _sample_block(logits, list(rows), out)
    return out


def _gumbel_max(z: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """argmax(z + g) per row, g the keyed Gumbel noise; z = -inf marks excluded tokens.

    When truncation leaves few candidates, the noise is drawn at the candidates'
    ids only (`random_bits_at`): each draw depends on (key, token id) alone, and
    the candidates keep ascending id order, so the token is the same as with
    noise over the whole vocabulary (first maximum, ties to the lower id)."""
    B, V = z.shape
    keys = ([r.seed for r in rows], [r.position for r in rows], [r.sample_index for r in rows])
    role = rows[0].role
    finite = torch.isfinite(z)
    counts = P.count(finite)[:, 0].tolist()
    C = max(max(counts), 1)
    if C > V // 8:
        g = gumbel_from_bits(random_bits(*keys, V, role=role, device=z.device))
        return torch.argmax(z.double() + g, dim=-1)
    r_idx, ids = finite.nonzero(as_tuple=True)  # row-major: ascending ids within each row
    starts = torch.tensor([0] + counts[:-1], device=z.device).cumsum(0)  # [B] (B small ints: exact)
    slot = torch.arange(r_idx.numel(), device=z.device) - starts[r_idx]
    cand = torch.zeros(B, C, dtype=torch.long, device=z.device)
    cand[r_idx, slot] = ids
    valid = torch.zeros(B, C, dtype=torch.bool, device=z.device)
    valid[r_idx, slot] = True
    g = gumbel_from_bits(random_bits_at(*keys, cand, role=role))
    score = torch.where(valid, z.gather(1, cand).double() + g, float("-inf"))
    return cand.gather(1, torch.argmax(score, dim=-1, keepdim=True))[:, 0]


def _sample_block(x_raw: torch.Tensor, rows: list[SamplingRow], out: SamplerOutput) -> None:
    B, V = x_raw.shape
    dev = x_raw.device
    raw_lp = ops.log_softmax(x_raw)  # [B, V] fp32
    x = P.apply_request_masks(x_raw.clone(), rows)
    x = P.apply_penalties(x, rows)
    greedy = [r.params.greedy for r in rows]
    temp = torch.tensor([1.0 if g else r.params.temperature for g, r in zip(greedy, rows)],
                        dtype=x.dtype, device=dev)[:, None]
    x = x / temp  # temperature-scaled; x / 1.0 == x exactly for greedy rows
    k_l = [-1 if g else r.params.top_k for g, r in zip(greedy, rows)]
    p_l = [1.0 if g else r.params.top_p for g, r in zip(greedy, rows)]
    m_l = [0.0 if g else r.params.min_p for g, r in zip(greedy, rows)]
    if any(0 < k < V for k in k_l) or any(p < 1.0 for p in p_l) or any(m > 0.0 for m in m_l):
        top_k = torch.tensor(k_l, device=dev)
        top_p = torch.tensor(p_l, dtype=torch.float64, device=dev)
        min_p = torch.tensor(m_l, dtype=torch.float64, device=dev)
        keep = P.truncation_mask(x, top_k, top_p, min_p)
        z = torch.where(keep, x, P.NEG_INF)  # processed logits [B, V]
    else:
        z = x  # no row truncates: truncation_mask would keep every token
    if any(r.grammar is not None for r in rows):
        allowed = _grammar_allowed(rows, V, dev)
        z = torch.where(allowed, z, P.NEG_INF)
        # fallbacks (never stall a constrained request): drop truncation, then request masks
        for alt in (x, x_raw / temp):
            empty = ~torch.isfinite(z).any(dim=-1, keepdim=True)
            z = torch.where(empty, torch.where(allowed, alt, P.NEG_INF), z)
    noisy = [j for j, r in enumerate(rows) if _needs_noise(r)]
    sampled = dict(zip(noisy, _gumbel_max(z[noisy], [rows[j] for j in noisy]).tolist())) if noisy else {}
    greedy_tok = torch.argmax(z, dim=-1).tolist()  # first maximum: ties to the lowest id
    toks = []
    for j, r in enumerate(rows):
        if r.golden_token is not None:
            if not 0 <= r.golden_token < V:
                raise ValueError(f"golden token {r.golden_token} outside the vocabulary [0, {V})")
            toks.append(int(r.golden_token))
        elif _needs_noise(r):
            toks.append(sampled[j])
        else:
            toks.append(greedy_tok[j])
    lp = raw_lp
    modes = [r.params.logprobs_mode for r in rows]
    for mode in set(modes) - {"raw"}:
        alt = {"processed": lambda: ops.log_softmax(z), "raw_logits": lambda: x_raw,
               "processed_logits": lambda: z}[mode]()
        lp = torch.where(torch.tensor([m == mode for m in modes], device=dev)[:, None], alt, lp)
    tok_t = torch.tensor(toks, dtype=torch.long, device=dev)[:, None]
    chosen = lp.gather(1, tok_t)  # [B, 1]
    ranks = (P.count(lp > chosen)[:, 0] + 1).tolist()
    chosen_l = chosen[:, 0].tolist()
    kmax = max((r.params.logprobs or 0) for r in rows)
    if kmax:
        vals, order = P.ordered_topk(lp, kmax)  # ties -> lower id
        vals_l, order_l = vals.tolist(), order.tolist()
    for j, r in enumerate(rows):
        out.token_ids[j], out.logprobs[j], out.ranks[j] = toks[j], chosen_l[j], ranks[j]
        k = r.params.logprobs or 0
        if k:
            out.topk_ids[j], out.topk_logprobs[j] = order_l[j][:k], vals_l[j][:k]


def _grammar_allowed(rows: list[SamplingRow], V: int, dev) -> torch.Tensor:
    """bool [B, V]: the grammar's allowed tokens per row (all True for rows without a grammar)."""
    allowed = torch.ones(len(rows), V, dtype=torch.bool, device=dev)
    for j, r in enumerate(rows):
        if r.grammar is not None:
            allowed[j] = P.bitmask_to_bool(r.grammar.bitmask()[None, :], V)[0].to(dev)
    return allowed


def logprobs_of(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> SamplerOutput:
    """Raw logprobs of given tokens (prompt logprobs, trainer checks): row i scores token_ids[i]."""
    p = SamplingParams(temperature=0.0, logprobs=k or None)
    rows = [SamplingRow(p, seed=0, position=0, golden_token=int(t)) for t in token_ids]
    return sample(logits, rows)
