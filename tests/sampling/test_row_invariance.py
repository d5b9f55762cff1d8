"""Sampler-level batch invariance: a row's token, logprob, rank and top-k are bit-identical
alone, at row 0 and at row 17 of a 64-row batch, whatever its neighbours' settings.
The same check rejects a shared-stream sampler (the stock way: one generator per batch)."""
from __future__ import annotations

import time

import pytest
import torch

from detent.sampling import processors as P
from detent.kernels.nucleus import top_p_keep
from detent.sampling.params import SamplingParams, StructuredOutputs
from detent.sampling.sampler import SamplingRow, sample

from .tiny_vocab import VOCAB, tiny_cache

TARGETS = [
    SamplingParams(temperature=1.0, top_p=0.95, seed=11, logprobs=5),
    SamplingParams(temperature=1.0, top_p=0.95, seed=11, logprobs=5, logprobs_mode="processed"),
    SamplingParams(temperature=0.0, logprobs=3),
    SamplingParams(temperature=0.6, top_k=7, min_p=0.05, repetition_penalty=1.2, seed=3, logprobs=2),
]


def _grammar_state(kind="json"):
    cache = tiny_cache(64)
    spec = StructuredOutputs(regex="[a-f][0-9]+") if kind == "regex" else StructuredOutputs(json_object=True)
    st = cache.new_state(spec)
    t0 = time.monotonic()
    while not st.ready:
        assert st.error is None and time.monotonic() - t0 < 30
        time.sleep(0.005)
    return st


def neighbours(n: int, vocab: int, grammar: bool):
    """A zoo of other requests: greedy, top-k, differently seeded, penalties, grammar, golden."""
    rows = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            p = SamplingParams(temperature=0.0, logprobs=2)
        elif kind == 1:
            p = SamplingParams(temperature=0.9, top_k=3, seed=1000 + i)
        elif kind == 2:
            p = SamplingParams(temperature=1.3, top_p=0.5, seed=i, logprobs=20, logprobs_mode="processed")
        elif kind == 3:
            p = SamplingParams(temperature=1.0, presence_penalty=1.0, frequency_penalty=-0.5, min_p=0.2, seed=i)
        else:
            p = SamplingParams(temperature=0.8, seed=77 + i, logprobs=1)
        g = _grammar_state("regex" if i % 2 else "json") if (grammar and kind == 4) else None
        golden = (i * 7) % vocab if kind == 5 else None
        rows.append(SamplingRow(p, seed=p.seed if p.seed is not None else 0, position=40 + i,
                                prompt_token_ids=list(range(i % 9)), output_token_ids=[i % vocab] * (i % 3),
                                grammar=g, golden_token=golden))
    return rows


def _result(out, i):
    return (out.token_ids[i], out.logprobs[i], out.ranks[i], out.topk_ids[i], out.topk_logprobs[i])


def _check(sampler, vocab: int, grammar: bool, trial_seed: int, device: str = "cpu") -> bool:
    g = torch.Generator().manual_seed(trial_seed)
    batch_logits = (torch.randn(64, vocab, generator=g) * 2).to(device)
    target_logits = (torch.randn(vocab, generator=g) * 2).to(device)
    ok = True
    for params in TARGETS:
        row = SamplingRow(params, seed=params.seed or 0, position=123, prompt_token_ids=[1, 2, 3],
                          output_token_ids=[4, 4])
        alone = _result(sampler(target_logits[None].clone(), [row]), 0)
        for at in (0, 17, 63):
            rows = neighbours(64, vocab, grammar)
            rows[at] = row
            logits = batch_logits.clone()
            logits[at] = target_logits
            ok &= _result(sampler(logits, rows), at) == alone
    return ok


@pytest.mark.parametrize("vocab,grammar", [(64, True), (5003, False)])
def test_sampler_row_is_batch_invariant(vocab, grammar):
    assert _check(sample, vocab, grammar, trial_seed=vocab)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab,grammar", [(64, True), (128256, False)])
def test_sampler_row_is_batch_invariant_on_cuda(vocab, grammar):
    assert _check(sample, vocab, grammar, trial_seed=vocab, device="cuda")


def shared_stream_sampler(logits, rows):
    """The stock design: one generator per batch, seeded by the first row; rows draw in order."""
    from detent.sampling.sampler import SamplerOutput
    gen = torch.Generator().manual_seed(rows[0].seed)
    out = SamplerOutput([], [], [], [], [])
    lp = torch.log_softmax(logits.float(), -1)
    for i, r in enumerate(rows):
        if r.params.greedy:
            t = int(torch.argmax(logits[i]))
        else:
            t = int(torch.multinomial(torch.softmax(logits[i] / r.params.temperature, -1), 1, generator=gen))
        out.token_ids.append(t)
        out.logprobs.append(float(lp[i, t]))
        out.ranks.append(int((lp[i] > lp[i, t]).sum()) + 1)
        out.topk_ids.append([])
        out.topk_logprobs.append([])
    return out


def test_shared_stream_sampler_fails_the_same_check():
    assert not _check(shared_stream_sampler, 64, False, trial_seed=5)


@pytest.mark.parametrize("V", [61, 64, 5003, 49152])
def test_torch_ops_used_by_the_sampler_are_row_invariant(V):
    """The elementwise/transcendental, softmax, sort, top-k, argmax and top-p ops, row alone vs in a batch."""
    g = torch.Generator().manual_seed(V)
    x = torch.randn(64, V, generator=g) * 3
    u = torch.rand(64, V, generator=g, dtype=torch.float64) * 0.999 + 1e-4
    ops = {
        "gumbel": lambda t: -torch.log(-torch.log(u[: t.shape[0]] if t.shape[0] == 64 else u[17:18])),
        "softmax": lambda t: torch.softmax(t, -1),
        "log_softmax": lambda t: torch.log_softmax(t, -1),
        "sort": lambda t: torch.sort(t, dim=-1, descending=True, stable=True)[1],
        "ordered_topk": lambda t: P.ordered_topk(t, 40)[1],
        "topk_values": lambda t: torch.topk(t, 40, dim=-1).values,  # top-k's threshold (truncation_mask)
        "top_p": lambda t: top_p_keep(t, torch.full((t.shape[0],), 0.99, dtype=torch.float64)),
        "argmax": lambda t: torch.argmax(t, -1),
        "truncation": lambda t: P.truncation_mask(t, torch.full((t.shape[0],), 20), torch.full((t.shape[0],), 0.7,
                                                  dtype=torch.float64), torch.full((t.shape[0],), 0.01,
                                                                                   dtype=torch.float64)),
    }
    for name, fn in ops.items():
        assert torch.equal(fn(x)[17], fn(x[17:18].clone())[0]), name
