"""Distribution tests: seeded one-token samples vs an independent float64 oracle.

N = 4000 samples per setting, seeds 0..N-1, all as one [N, V] batch (rows are
independent). Counts are compared with reference_probs() (numpy float64,
tests/sampling/reference.py) by a chi-square test, p > 1e-4. The same test is
shown to reject deliberately biased samplers.
"""
from __future__ import annotations

import time

import numpy as np
import pytest
import torch
from scipy import stats

from detent.sampling.params import SamplingParams, StructuredOutputs
from detent.sampling.sampler import SamplingRow, sample

from .reference import reference_probs
from .tiny_vocab import VOCAB, V, tiny_cache

N = 4000
ALPHA = 1e-4
POSITION = 7


def fixed_logits(vocab: int = V, seed: int = 1234) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, generator=g) * 1.7).float()  # a peaked but not degenerate row


def chi2_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson chi-square; bins with expected < 5 are pooled. A sample of a zero-probability token fails."""
    n = counts.sum()
    if counts[probs == 0].sum() > 0:
        return 0.0
    exp = probs * n
    big = exp >= 5
    obs_b, exp_b = list(counts[big]), list(exp[big])
    small_exp = exp[~big & (probs > 0)].sum()
    if small_exp > 0:
        obs_b.append(counts[~big & (probs > 0)].sum())
        exp_b.append(small_exp)
        if small_exp < 5 and len(exp_b) > 2:  # fold a tiny pooled bin into the smallest big one
            j = int(np.argmin(exp_b[:-1]))
            exp_b[j] += exp_b.pop()
            obs_b[j] += obs_b.pop()
    if len(exp_b) < 2:
        return 1.0
    return float(stats.chisquare(np.array(obs_b, float), np.array(exp_b, float)).pvalue)


def draw(params: SamplingParams, logits_row: torch.Tensor, n: int = N, **row_kw) -> np.ndarray:
    rows = [SamplingRow(params, seed=s, position=POSITION, **row_kw) for s in range(n)]
    out = sample(logits_row[None].expand(n, -1).contiguous(), rows)
    return np.bincount(np.array(out.token_ids), minlength=logits_row.shape[0])


PROMPT = (3, 5, 5, 9, 20, 31)
OUTPUT = (9, 9, 12)
CASES = {
    "T=1": (dict(temperature=1.0), {}),
    "T=0.7,top_p=0.9": (dict(temperature=0.7, top_p=0.9), {}),
    "top_k=5": (dict(temperature=1.0, top_k=5), {}),
    "min_p=0.1": (dict(temperature=1.0, min_p=0.1), {}),
    "repetition_penalty=1.5": (dict(temperature=1.0, repetition_penalty=1.5), {}),
    "freq+presence": (dict(temperature=1.0, frequency_penalty=0.8, presence_penalty=0.5), {}),
    "all: penalty,T,top_k,top_p,min_p": (dict(temperature=0.8, top_k=12, top_p=0.8, min_p=0.05,
                                              repetition_penalty=1.3), {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_sampler_matches_float64_reference(name):
    kw, _ = CASES[name]
    logits = fixed_logits()
    counts = draw(SamplingParams(**kw), logits, prompt_token_ids=PROMPT, output_token_ids=OUTPUT)
    probs = reference_probs(logits.numpy(), prompt_ids=PROMPT, output_ids=OUTPUT, **kw)
    p = chi2_pvalue(counts, probs)
    assert p > ALPHA, f"{name}: chi-square p = {p:.3g}"


def _ready(state):
    t0 = time.monotonic()
    while not state.ready:
        assert state.error is None, state.error
        assert time.monotonic() - t0 < 30
        time.sleep(0.005)
    return state


@pytest.mark.parametrize("temperature,top_k", [(1.0, -1), (0.7, 8)])
def test_grammar_mask_distribution(temperature, top_k):
    """A real xgrammar mask (regex [a-f][0-9]+ on the tiny vocabulary, vocab padded to 64)."""
    cache = tiny_cache(64)
    state = _ready(cache.new_state(StructuredOutputs(regex="[a-f][0-9]+")))
    state.accept(VOCAB.index("c"))  # now digits, '12' are allowed; EOS not yet
    logits = fixed_logits(64, seed=99)
    allowed = np.zeros(64, bool)
    allowed[[VOCAB.index(c) for c in "0123456789"] + [VOCAB.index("12")]] = True
    params = SamplingParams(temperature=temperature, top_k=top_k)
    counts = draw(params, logits, grammar=state)
    # top_k is applied before the mask; if the intersection is empty the sampler falls back to the mask
    probs = reference_probs(logits.numpy(), temperature=temperature, top_k=top_k, allowed=allowed)
    assert counts[~allowed].sum() == 0
    p = chi2_pvalue(counts, probs)
    assert p > ALPHA, f"grammar mask: chi-square p = {p:.3g}"


# --- the test has power: deliberately biased samplers are rejected ---

def _biased_wrong_order(logits: torch.Tensor, n: int, temperature: float, top_p: float) -> np.ndarray:
    """Top-p applied BEFORE temperature (an order bug), then Gumbel-max with torch's RNG."""
    x = logits.double()
    probs = torch.softmax(x, -1)
    order = torch.argsort(-x, stable=True)
    before = torch.cumsum(probs[order], 0) - probs[order]
    keep = torch.zeros_like(x, dtype=torch.bool)
    keep[order[before < top_p]] = True
    z = torch.where(keep, x / temperature, float("-inf"))
    g = torch.Generator().manual_seed(0)
    toks = torch.multinomial(torch.softmax(z, -1), n, replacement=True, generator=g)
    return np.bincount(toks.numpy(), minlength=x.shape[0])


def _biased_coarse_uniforms(logits: torch.Tensor, n: int) -> np.ndarray:
    """Gumbel-max with 6-bit uniforms: a subtle RNG-quality bias."""
    g = torch.Generator().manual_seed(0)
    u = (torch.randint(0, 64, (n, logits.shape[0]), generator=g).double() + 0.5) / 64
    toks = torch.argmax(logits.double()[None] - torch.log(-torch.log(u)), -1)
    return np.bincount(toks.numpy(), minlength=logits.shape[0])


def test_chi_square_rejects_biased_samplers():
    logits = fixed_logits()
    ref = reference_probs(logits.numpy(), temperature=0.7, top_p=0.9)
    assert chi2_pvalue(_biased_wrong_order(logits, N, 0.7, 0.9), ref) < ALPHA
    assert chi2_pvalue(_biased_coarse_uniforms(logits, N), reference_probs(logits.numpy())) < ALPHA
    # a sampler that never emits one allowed token
    counts = draw(SamplingParams(temperature=1.0), logits)
    top = int(np.argmax(counts))
    counts[top + 1 if top + 1 < V else 0] += counts[top]
    counts[top] = 0
    assert chi2_pvalue(counts, reference_probs(logits.numpy())) < ALPHA
    # and a correct multinomial draw from the reference passes (the test is not just strict)
    rng = np.random.default_rng(0)
    assert chi2_pvalue(rng.multinomial(N, ref), ref) > ALPHA


def test_greedy_is_argmax_ties_to_lowest_id():
    logits = torch.tensor([[0.5, 2.0, 2.0, -1.0], [3.0, 3.0, 3.0, 3.0]])
    rows = [SamplingRow(SamplingParams(temperature=0.0), seed=s, position=0) for s in range(2)]
    assert sample(logits, rows).token_ids == [1, 0]


def test_zero_probability_tokens_never_sampled():
    """top_k=5: across N seeds, only the 5 largest logits appear."""
    logits = fixed_logits()
    counts = draw(SamplingParams(top_k=5), logits)
    top5 = set(torch.topk(logits, 5).indices.tolist())
    assert set(np.nonzero(counts)[0].tolist()) <= top5
