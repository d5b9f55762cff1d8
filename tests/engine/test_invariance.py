"""Batch invariance, end to end on CPU (docs/architecture.md; issue 4).

A target request's 16 greedy tokens, chosen-token logprobs and top-5
logprobs are compared — `==` on token lists, `torch.equal` on logprob
tensors — between the request run alone on a fresh engine and each cell:
a rerun; 1, 2, 7, 31 co-batched requests of short, long and mixed lengths;
the target at row 0, 1, middle, last; prefix-cache hits of one block,
several blocks and a shared prefix ending mid-block; token budgets that cut
its prefill at different points; a KV pool small enough to preempt it.
Every cell passes with selection="pinned". With selection="stock" at least
one cell differs: the cells can fail.
"""
from __future__ import annotations

import random

import pytest

from engine_helpers import bundle, generate_target, make_llm, prompt, same

TARGET_LEN = 40  # 2.5 blocks of 16


def _others(kind: str, n: int, vocab: int, seed: int = 1) -> list[list[int]]:
    r = random.Random(seed)
    lens = {"short": lambda: r.randrange(2, 10), "long": lambda: r.randrange(60, 130),
            "mixed": lambda: r.choice([r.randrange(2, 10), r.randrange(15, 50), r.randrange(60, 130)])}[kind]
    return [prompt(seed * 1000 + i, lens(), vocab) for i in range(n)]


# ---------------------------------------------------------------- cells
def cell_rerun(b, sel, t):
    llm = make_llm(b, sel)
    generate_target(llm, t)
    assert llm.reset_prefix_cache()
    return generate_target(llm, t)


def _cobatch(kind, n, row=None):
    def cell(b, sel, t):
        return generate_target(make_llm(b, sel), t, _others(kind, n, b.config.vocab_size, seed=n), row=row)
    return cell


def _prefix(shared: int, expect_cached: int):
    def cell(b, sel, t):
        llm = make_llm(b, sel)
        warm = t[:shared] + prompt(99, 7, b.config.vocab_size)
        generate_target(llm, warm)
        r = generate_target(llm, t)
        assert r.num_cached_tokens == expect_cached, "the cell did not exercise the prefix cache"
        return r
    return cell


def _budget(tokens: int):
    def cell(b, sel, t):
        llm = make_llm(b, sel, max_num_batched_tokens=tokens, max_model_len=max(tokens, 256))
        return generate_target(llm, t, _others("mixed", 3, b.config.vocab_size, seed=tokens), row=2)
    return cell


def cell_preempt(b, sel, t):
    # one max_model_len request (64 tokens = 4 blocks) fits; four growing requests do not
    llm = make_llm(b, sel, max_model_len=64, num_gpu_blocks=7)
    r = generate_target(llm, t, _others("short", 3, b.config.vocab_size, seed=5) , row=3,
                        other_max_tokens=[24, 24, 24])
    assert r.num_preemptions >= 1, "the target was not preempted"
    assert llm.llm_engine.stats()["num_preemptions"] >= 1
    return r


def cell_mixed_align(b, sel, t):
    # steps that carry decodes end on multiples of 8 tokens (mixed_token_align): prompt
    # chunks, the target's among them, are cut where the multiple falls
    llm = make_llm(b, sel, max_num_batched_tokens=48, max_mixed_batched_tokens=40, mixed_token_align=8)
    return generate_target(llm, t, _others("mixed", 5, b.config.vocab_size, seed=11), row=1)


CELLS = {
    "rerun": cell_rerun,
    "cobatch_1_short": _cobatch("short", 1),
    "cobatch_2_long": _cobatch("long", 2),
    "cobatch_7_mixed": _cobatch("mixed", 7),
    "cobatch_31_mixed": _cobatch("mixed", 31),
    "row_0": _cobatch("mixed", 7, row=0),
    "row_1": _cobatch("mixed", 7, row=1),
    "row_middle": _cobatch("mixed", 8, row=4),
    "row_last": _cobatch("mixed", 7, row=7),
    "prefix_hit_1_block": _prefix(16, 16),
    "prefix_hit_2_blocks": _prefix(32, 32),
    "prefix_shared_mid_block": _prefix(24, 16),
    "budget_8": _budget(8),
    "budget_13": _budget(13),
    "budget_33": _budget(33),
    "preempt": cell_preempt,
    "mixed_align_8": cell_mixed_align,
}
SMOLLM2_CELLS = ("cobatch_7_mixed", "prefix_shared_mid_block", "budget_13", "preempt")
STOCK_CELLS = ("cobatch_7_mixed", "prefix_shared_mid_block", "budget_13")

_REFS: dict = {}


def target(b):
    return prompt(7, TARGET_LEN, b.config.vocab_size)


def reference(name, sel):
    if (name, sel) not in _REFS:
        b = bundle(name)
        _REFS[name, sel] = generate_target(make_llm(b, sel), target(b))
    return _REFS[name, sel]


PARAMS = [(m, c) for m in ("llama", "qwen3_moe") for c in CELLS] + \
         [pytest.param("smollm2", c, marks=pytest.mark.slow) for c in SMOLLM2_CELLS]


@pytest.mark.parametrize("model,cell", PARAMS)
def test_pinned_cell_equals_alone(model, cell):
    b = bundle(model)
    got = CELLS[cell](b, "pinned", target(b))
    ref = reference(model, "pinned")
    assert len(ref.token_ids) == 16
    assert got.token_ids == ref.token_ids
    assert same(got, ref), f"{model}/{cell}: logprobs differ from the request alone"


@pytest.mark.parametrize("model", ["llama", "qwen3_moe", pytest.param("smollm2", marks=pytest.mark.slow)])
def test_stock_selection_breaks_some_cell(model):
    b = bundle(model)
    ref = reference(model, "stock")
    cells = STOCK_CELLS[:1] if model == "smollm2" else STOCK_CELLS
    differing = [c for c in cells if not same(CELLS[c](b, "stock", target(b)), ref)]
    assert differing, f"{model}: stock selection passed every cell, so these cells cannot detect a break"


@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_stock_selection_breaks_the_mixed_align_cell(model):
    """The aligned-steps cell can fail: under stock the cut chunks move the target's bits."""
    b = bundle(model)
    got = cell_mixed_align(b, "stock", target(b))
    ref = reference(model, "stock")
    assert not (got.token_ids == ref.token_ids and same(got, ref))
