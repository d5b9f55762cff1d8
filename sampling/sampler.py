"""The sampler: one call per step over the rows that sample a token.

INITIAL VERSION (engine-core scaffold): greedy only, raw logprobs and top-k.
The sampling issue replaces the body (keyed RNG, processors, grammar masks,
golden tokens) keeping this interface.

Contract:
- `logits` is [R, V] float32, one row per sampled token, already gathered
  by the runner; rows are independent: nothing here may mix rows.
- `rows[i]` describes row i's request (params, seed, absolute position of
  the token being sampled, sample index, the tokens so far).
- Every per-row result depends only on that row's logits and its
  SamplingRow — never on R or on the row's index.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from detent.sampling.params import SamplingParams
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
    grammar: Any = None  # per-request grammar state (sampling/grammar.py), or None


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[float]  # chosen token's logprob (raw or processed per row)
    ranks: list[int]  # 1-based rank of the chosen token under the reported distribution
    topk_ids: list[list[int]] = field(default_factory=list)  # per row, up to its params.logprobs
    topk_logprobs: list[list[float]] = field(default_factory=list)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> SamplerOutput:
    for r in rows:
        if not r.params.greedy and r.golden_token is None:
            raise NotImplementedError("temperature > 0: sampling arrives with the sampling issue")
    logp = ops.log_softmax(logits)  # [R, V] fp32
    chosen = torch.argmax(logp, dim=-1)  # ties -> lowest id (torch.argmax returns the first)
    toks = [r.golden_token if r.golden_token is not None else int(c) for r, c in zip(rows, chosen.tolist())]
    tok_t = torch.tensor(toks, dtype=torch.long, device=logits.device)
    chosen_lp = logp.gather(1, tok_t[:, None])[:, 0]
    ranks = ((logp > chosen_lp[:, None]).sum(-1) + 1).tolist()
    kmax = max((r.params.logprobs or 0) for r in rows) if rows else 0
    topk_ids: list[list[int]] = [[] for _ in rows]
    topk_lps: list[list[float]] = [[] for _ in rows]
    if kmax:
        vals, idx = torch.topk(logp, kmax, dim=-1)
        vals_l, idx_l = vals.tolist(), idx.tolist()
        for i, r in enumerate(rows):
            k = r.params.logprobs or 0
            topk_ids[i], topk_lps[i] = idx_l[i][:k], vals_l[i][:k]
    return SamplerOutput(toks, chosen_lp.tolist(), ranks, topk_ids, topk_lps)
