"""The sampler: one call per step over the rows that sample a token.

Contract:
- `logits` is [R, V] float32, one row per sampled token, already gathered
  by the runner; rows are independent: nothing here may mix rows.
- `rows[i]` describes row i's request (params, seed, absolute position of
  the token being sampled, sample index, the tokens so far).
- Every per-row result depends only on that row's logits and its
  SamplingRow — never on R or on the row's index.

How: the random bits come from the keyed Philox RNG (kernels/philox.py, exact
integer arithmetic), drawn through the `gumbel` kernel family
(`ops.gumbel_argmax`: the torch reference, or one fused Triton kernel on GPU). Everything else is an op whose per-row result does not depend on
the other rows: elementwise arithmetic, comparisons, where/gather/scatter,
stable sorts, argmax (first maximum), and the last-dim softmax/log_softmax
kernels, integer index-adds and cumsums (exact in any order: top-p,
kernels/nucleus.py); no float cumsum and no cross-row reduction.
tests/sampling/test_row_invariance.py checks each of these, and the whole
sampler, for a row alone against the same row at other positions in batches
of other sizes.

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
from detent.sampling.rng import ROLE_SAMPLE, list_to_device, to_device
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
    # tokens the request has sampled that output_token_ids does not hold yet (0 or 1: under
    # async scheduling, the step before's, still on the device); it is this row's last input
    # token, which the sampler is given as `last_tokens`
    pending: int = 0
    # the request's token ids for the request masks, built once (processors.RequestMaskIds), or
    # None: apply_request_masks builds them for the call
    mask_ids: P.RequestMaskIds | None = field(default=None, compare=False, repr=False)

    def request_masks(self) -> P.RequestMaskIds:
        """`mask_ids`, or the row's own built for this call."""
        return self.mask_ids or P.RequestMaskIds(self.params, self.eos_token_ids)


@dataclass
class SamplerOutput:
    token_ids: list[int]
    # chosen token's logprob (raw or processed per row) and its 1-based rank under the reported
    # distribution; NaN and 0 on every row of a step in which no row asked for logprobs
    logprobs: list[float]
    ranks: list[int]
    topk_ids: list[list[int]] = field(default_factory=list)  # per row, up to its params.logprobs
    topk_logprobs: list[list[float]] = field(default_factory=list)


def _needs_noise(r: SamplingRow) -> bool:
    return r.golden_token is None and not r.params.greedy


class PendingSample:
    """A step's sampled tokens and logprobs while they are still on the device.

    `tokens` [R] (long, on the device) can feed the next step's input ids
    before the host has seen them (engine overlap, docs/architecture.md); the
    rest travels to the host in two asynchronous copies into pinned memory,
    and `resolve()` waits for those copies only."""

    def __init__(self, tokens: torch.Tensor, ints: torch.Tensor, floats: torch.Tensor, ks: list[int]):
        self.tokens = tokens
        self._ks = ks
        if tokens.is_cuda:
            self._ints = torch.empty(ints.shape, dtype=ints.dtype, pin_memory=True).copy_(ints, non_blocking=True)
            self._floats = torch.empty(floats.shape, dtype=floats.dtype, pin_memory=True).copy_(
                floats, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._ints, self._floats, self._done = ints, floats, None

    def resolve(self) -> SamplerOutput:
        """Wait for the copies; the per-row results as host lists."""
        if self._done is not None:
            self._done.synchronize()
        ints, floats = self._ints.tolist(), self._floats.tolist()
        out = SamplerOutput([r[0] for r in ints], [r[0] for r in floats], [r[1] for r in ints],
                            [[] for _ in ints], [[] for _ in ints])
        for j, k in enumerate(self._ks):
            if k:
                out.topk_ids[j], out.topk_logprobs[j] = ints[j][2:2 + k], floats[j][1:1 + k]
        return out


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    return sample_async(logits, rows).resolve()


def sample_async(logits: torch.Tensor, rows: Sequence[SamplingRow],
                 last_tokens: torch.Tensor | None = None) -> PendingSample:
    """`sample` without waiting for the device: every choice of which work runs is
    made from host values (the rows' parameters and tokens), and what the device
    needs from the host goes through pinned memory (`to_device`). Top-p
    (kernels/nucleus.py, the `top_p` family) does the same work whatever the logits. The keyed draw
    reads the device only in the torch reference's sparse path (kernels/gumbel.py),
    which the GPU's fused kernel does not take.

    `last_tokens` [R] long, on the logits' device: each row's last input token. Needed
    when a row is `pending` (its output so far ends with that token, which the host
    does not have yet): penalties count it and bad words compare it there, and
    min_tokens counts it from `pending` alone."""
    R, V = logits.shape
    if R != len(rows):
        raise ValueError(f"sample: {R} logits rows but {len(rows)} SamplingRows")
    if R == 0:
        empty = torch.zeros(0, 2, dtype=torch.long)
        return PendingSample(empty[:, 0], empty, torch.zeros(0, 1), [])
    if len({r.role for r in rows}) != 1:
        raise ValueError(f"sample: one role per call, got {sorted({r.role for r in rows})}")
    for r in rows:
        if r.golden_token is not None and not 0 <= r.golden_token < V:
            raise ValueError(f"golden token {r.golden_token} outside the vocabulary [0, {V})")
    if last_tokens is None and any(r.pending for r in rows):
        raise ValueError("sample: a row's last token is still on the device, but no last_tokens were given")
    return _sample_block(logits.float(), list(rows), last_tokens)


def _gumbel_max(z: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """argmax(z + g) per row, g the keyed Gumbel noise; z = -inf marks excluded tokens.

    One call over the whole vocabulary (`ops.gumbel_argmax`, the `gumbel`
    family): the torch reference draws at the drawable tokens only when
    truncation leaves few (the same token; kernels/gumbel.py), the GPU's fused
    kernel draws densely and never waits for the device."""
    keys = ([r.seed for r in rows], [r.position for r in rows], [r.sample_index for r in rows], rows[0].role)
    return ops.gumbel_argmax(z, *keys)


def _truncates(p: SamplingParams, V: int) -> bool:
    return not p.greedy and (0 < p.top_k < V or p.top_p < 1.0 or p.min_p > 0.0)


def _sample_block(x_raw: torch.Tensor, rows: list[SamplingRow], last: torch.Tensor | None) -> PendingSample:
    B, V = x_raw.shape
    dev = x_raw.device
    # the reported distribution's [B, V] passes (log-softmax, the chosen token's rank) only
    # when some row reports logprobs: the tokens come from z alone
    want_lp = any(r.params.logprobs is not None for r in rows)
    raw_lp = ops.log_softmax(x_raw) if want_lp else None  # [B, V] fp32
    x = P.apply_request_masks(x_raw, rows, last)  # a copy only when some row is masked
    x = P.apply_penalties(x, rows, last)
    greedy = [r.params.greedy for r in rows]
    temps = [1.0 if g else r.params.temperature for g, r in zip(greedy, rows)]
    # temperature-scaled; x / 1.0 == x exactly, so rows at 1.0 need no division at all
    temp = list_to_device(temps, x.dtype, dev)[:, None] if any(t != 1.0 for t in temps) else None
    if temp is not None:
        x = x / temp
    if any(_truncates(r.params, V) for r in rows):
        # top_k >= V keeps every token: -1 (a huge top_k would not fit the long tensor)
        k_l = [-1 if g or r.params.top_k >= V else r.params.top_k for g, r in zip(greedy, rows)]
        p_l = [1.0 if g else r.params.top_p for g, r in zip(greedy, rows)]
        m_l = [0.0 if g else r.params.min_p for g, r in zip(greedy, rows)]
        keep = P.truncation_mask(x, list_to_device(k_l, torch.long, dev),
                                 list_to_device(p_l, torch.float64, dev), list_to_device(m_l, torch.float64, dev),
                                 host=(k_l, p_l, m_l))
        z = torch.where(keep, x, P.NEG_INF)  # processed logits [B, V]
    else:
        z = x  # no row truncates: truncation_mask would keep every token
    if any(r.grammar is not None for r in rows):
        allowed = _grammar_allowed(rows, V, dev)
        z = torch.where(allowed, z, P.NEG_INF)
        # fallbacks (never stall a constrained request): drop truncation, then request masks
        for alt in (x, x_raw if temp is None else x_raw / temp):
            empty = ~torch.isfinite(z).any(dim=-1, keepdim=True)
            z = torch.where(empty, torch.where(allowed, alt, P.NEG_INF), z)
    noisy = [j for j, r in enumerate(rows) if _needs_noise(r)]
    if len(noisy) == B:  # every row draws: no argmax pass
        toks = _gumbel_max(z, rows)
    else:
        toks = torch.argmax(z, dim=-1)  # greedy rows: first maximum, ties to the lowest id
        if noisy:
            idx = list_to_device(noisy, torch.long, dev)
            toks = toks.index_copy(0, idx, _gumbel_max(z.index_select(0, idx), [rows[j] for j in noisy]))
    golden = [j for j, r in enumerate(rows) if r.golden_token is not None]
    if golden:
        toks = toks.index_copy(0, list_to_device(golden, torch.long, dev),
                               list_to_device([rows[j].golden_token for j in golden], torch.long, dev))
    if not want_lp:  # nothing to report: NaN logprobs and rank 0, never read (OutputProcessor)
        return PendingSample(toks, torch.stack([toks, torch.zeros_like(toks)], dim=1),
                             torch.full((B, 1), float("nan"), device=dev), [0] * B)
    lp = raw_lp
    modes = [r.params.logprobs_mode for r in rows]
    for mode in set(modes) - {"raw"}:
        alt = {"processed": lambda: ops.log_softmax(z), "raw_logits": lambda: x_raw,
               "processed_logits": lambda: z}[mode]()
        lp = torch.where(list_to_device([m == mode for m in modes], torch.bool, dev)[:, None], alt, lp)
    chosen = lp.gather(1, toks[:, None])  # [B, 1]
    ranks = P.count(lp > chosen).to(torch.long) + 1  # [B, 1]
    ks = [r.params.logprobs or 0 for r in rows]
    ints, floats = [toks[:, None], ranks], [chosen]
    if max(ks):
        vals, order = P.ordered_topk(lp, max(ks))  # ties -> lower id
        ints.append(order)
        floats.append(vals)
    return PendingSample(toks, torch.cat(ints, dim=1), torch.cat(floats, dim=1), ks)


def _grammar_allowed(rows: list[SamplingRow], V: int, dev) -> torch.Tensor:
    """bool [B, V]: the grammar's allowed tokens per row (all True for rows without a grammar), and of
    those only its allowed_token_ids where the row lists some: both are hard constraints (as in
    vLLM), so the fallbacks for an empty row drop truncation and the soft request masks, never
    these. A row whose grammar allows none of its ids is all False (Scheduler.update fails it)."""
    allowed = torch.ones(len(rows), V, dtype=torch.bool, device=dev)
    js = [j for j, r in enumerate(rows) if r.grammar is not None]
    masks = to_device(torch.stack([rows[j].grammar.bitmask() for j in js]), dev)  # [G, W] int32
    allowed.index_copy_(0, list_to_device(js, torch.long, dev), P.bitmask_to_bool(masks, V))
    listed = [j for j in js if rows[j].params.allowed_token_ids]
    if listed:
        ids = [(i, rows[j].request_masks().under(V).allowed) for i, j in enumerate(listed)]
        only = P.id_mask(ids, len(listed), V, dev)
        idx = list_to_device(listed, torch.long, dev)
        allowed.index_copy_(0, idx, allowed.index_select(0, idx) & only)
    return allowed


def logprobs_of(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> SamplerOutput:
    """Raw logprobs of given tokens (prompt logprobs, trainer checks): row i scores token_ids[i]."""
    return logprobs_of_async(logits, token_ids, k).resolve()


def logprobs_of_async(logits: torch.Tensor, token_ids: Sequence[int], k: int) -> PendingSample:
    """`logprobs_of` without waiting for the device (the tokens are host ints)."""
    p = SamplingParams(temperature=0.0, logprobs=k)  # 0: the given token's own logprob and rank
    rows = [SamplingRow(p, seed=0, position=0, golden_token=int(t)) for t in token_ids]
    return sample_async(logits, rows)
