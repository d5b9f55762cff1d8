"""One request's outputs do not depend on its neighbours, for every sampling
feature, with async scheduling on (the default on CUDA).

Neighbours change more than the batch: a neighbour that needed its values on
the host before its next step (prompt logprobs here, until they stayed on the
device with their step) made the engine collect each step before it planned the
next, so the target's steps ran with and without the overlap depending on who
else was running. A feature that read host state the overlap has not updated
yet (a bad word's prefix did) gave different bits in the two cases. The cells
keep those neighbours: prompt rows planned ahead of their results, beside the
target's decodes.

Comparator: the target's whole output (`engine_helpers.summary`: token ids,
finish and stop reasons, text, every logprob as a Python float, with `==`)
alone on a fresh engine against the same request among neighbours. With
selection="stock" some cell differs, so the cells can fail.
"""
from __future__ import annotations

import pytest

from detent.engine import SamplingParams
from engine_helpers import prompt, summary, text_llm

VOCAB = 160
TARGET = prompt(7, 40, VOCAB)
BASE = dict(temperature=0.9, seed=5, max_tokens=16, logprobs=3, ignore_eos=True)
FEATURES = {
    "seeded": {},
    "top-p": dict(top_p=0.8),
    "top-k + min-p": dict(top_k=8, min_p=0.05),
    "penalties": dict(repetition_penalty=1.3, frequency_penalty=0.2, presence_penalty=0.1, logprobs_mode="processed"),
    "logit bias + allowed tokens": dict(logit_bias={40: 2.0, 41: -3.0}, allowed_token_ids=list(range(30, 120))),
    "min_tokens": dict(min_tokens=6, ignore_eos=False, logprobs_mode="processed"),
    "bad words": None,  # two tokens the seeded run produces in a row (they must bite)
    "n = 2": dict(n=2),
    "processed logprobs": dict(logprobs_mode="processed", top_p=0.9),
    "stop string": dict(stop=["zz", "~"], include_stop_str_in_output=True),
    "prompt logprobs": dict(prompt_logprobs=2),
    "golden tokens": dict(golden_token_ids=[5, 6, 7, 8, 9, 10, 11, 12]),  # forced, then sampled
}


def _others(kind: str) -> list[tuple[list[int], SamplingParams]]:
    """Seven neighbours of mixed lengths: greedy ones, or ones that want prompt logprobs
    (their rows come back with the step), or both, with a repetition penalty on some."""
    out = []
    for i in range(7):
        p = prompt(100 + i, [3, 25, 70][i % 3], VOCAB)
        feedback = kind == "feedback" or (kind == "both" and i % 2)
        out.append((p, SamplingParams(temperature=0, max_tokens=4 + (5 * i) % 13, ignore_eos=True,
                                      prompt_logprobs=1 if feedback else None,
                                      repetition_penalty=1.2 if kind == "both" and i % 3 == 0 else 1.0)))
    return out


CELLS = {  # name: (neighbours, engine arguments)
    "among greedy neighbours": ("greedy", {}),
    "among neighbours with prompt logprobs": ("feedback", {}),
    "among both, prompt in chunks of 24": ("both", dict(max_num_batched_tokens=24)),
}


def _params(feature: str) -> SamplingParams:
    extra = FEATURES[feature]
    if extra is None:
        free = _run(SamplingParams(**BASE), "alone", "pinned")[0][0][0]
        extra = dict(bad_words_token_ids=[list(free[3:5])])
    return SamplingParams(**{**BASE, **extra})


def _run(sp: SamplingParams, cell: str, selection: str):
    others, kw = ([], {}) if cell == "alone" else (_others(CELLS[cell][0]), CELLS[cell][1])
    items = others[:3] + [(TARGET, sp)] + others[3:]
    llm = text_llm(selection, async_scheduling=True, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in items], [s for _, s in items], use_tqdm=False)
    return summary(outs[min(3, len(others))])


@pytest.mark.parametrize("feature", list(FEATURES))
def test_a_request_is_the_same_alone_and_among_any_neighbours(feature):
    sp = _params(feature)
    alone = _run(sp, "alone", "pinned")
    assert alone[2] is None and all(len(row[0]) > 0 for row in alone[0])
    for cell in CELLS:
        assert _run(sp, cell, "pinned") == alone, f"{feature}: {cell}"


def test_the_bad_word_cell_bites():
    seeded = _run(SamplingParams(**BASE), "alone", "pinned")[0][0][0]
    banned = _run(_params("bad words"), "alone", "pinned")[0][0][0]
    assert banned[:4] == seeded[:4] and banned[4] != seeded[4]


def test_stock_selection_breaks_some_cell():
    sp = _params("seeded")
    alone = _run(sp, "alone", "stock")
    assert any(_run(sp, cell, "stock") != alone for cell in CELLS), \
        "stock selection passed every cell, so these cells cannot detect a break"
