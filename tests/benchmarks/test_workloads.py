"""The workloads (benchmarks/workloads/, `detent.workloads`): seeded, the
shapes docs/performance.md states, and loads as fractions of stock's
maximum throughput or closed loops."""
from __future__ import annotations

import statistics

import pytest

from detent.workloads import NAMES, Load, load_seed, make


def test_seeded_and_distinct_by_seed():
    assert make("W-A", num_requests=50) == make("W-A", num_requests=50)
    assert make("W-B", num_requests=5, seed=1) != make("W-B", num_requests=5, seed=2)


def test_w_a_is_multi_turn_chat_with_about_64_percent_prefix_reuse():
    w = make("W-A")
    assert len(w.requests) == 600
    convs = sum(r.after is None for r in w.requests)
    assert 130 <= convs <= 190  # about 160 conversations
    assert 0.60 <= w.prefix_reuse <= 0.68
    for r in w.requests:  # a later turn starts with the whole previous prompt
        if r.after is not None:
            prev = w.requests[r.after].prompt_token_ids
            assert r.after < w.requests.index(r) and r.prompt_token_ids[:len(prev)] == prev
    assert 100 <= statistics.median(r.max_tokens for r in w.requests) <= 260  # ShareGPT-like answers
    assert max(len(r.prompt_token_ids) + r.max_tokens for r in w.requests) <= 4096
    assert [(ld.name, ld.fraction) for ld in w.loads] == [("A1", 0.25), ("A2", 0.5), ("A3", 0.75), ("A4", 1.0)]


def test_each_load_sends_prompts_no_other_load_or_the_maximum_throughput_run_cached():
    """Prefix caching keeps a served prompt's blocks: a load that re-sent the prompts of the
    lambda_max run or of an earlier load would measure cache hits, not the workload. No first
    16-token block (a page) of one load's prompts appears in another's."""
    block = 16
    owners: dict[tuple[int, ...], str] = {}
    for name in NAMES:
        w = make(name, num_requests=12, max_len=1024)
        runs = {ld.name: make(name, num_requests=12, max_len=1024, seed=load_seed(0, ld.name)) for ld in w.loads}
        if any(ld.fraction for ld in w.loads):  # closed loops (W-C) need no lambda_max run
            runs[f"{name} lambda_max"] = w
        for run, lw in runs.items():
            assert len(lw.requests) == 12 and all(len(r.prompt_token_ids) >= block for r in lw.requests)
            for key in {r.prompt_token_ids[:block] for r in lw.requests}:
                assert owners.setdefault(key, run) == run, f"{run} re-sends a prompt of {owners[key]}"
    assert len({load_seed(0, ld) for ld in ("A1", "A4", "B1", "B3", "C1", "C2")}) == 6
    assert load_seed(7, "A1") == 7 + load_seed(0, "A1")


def test_rounds_put_each_turn_after_the_one_before():
    w = make("W-A", num_requests=40)
    where = {i: k for k, idx in enumerate(w.rounds()) for i in idx}
    assert sorted(where) == list(range(40))
    assert all(where[w.requests.index(r)] == where[r.after] + 1 for r in w.requests if r.after is not None)


def test_w_b_and_w_c_are_8k_documents_with_short_outputs():
    b, c = make("W-B"), make("W-C")
    assert len(b.requests) == 200 and len(c.requests) == 64
    assert all(0.9 * 8064 - 1 <= len(r.prompt_token_ids) <= 8064 and 32 <= r.max_tokens <= 128 for r in b.requests)
    assert c.requests == b.requests[:64]  # the first 64 documents
    assert [(ld.name, ld.fraction) for ld in b.loads] == [("B1", 0.33), ("B2", 0.67), ("B3", 1.0)]
    assert [(ld.name, ld.concurrency) for ld in c.loads] == [("C1", 1), ("C2", 8)]


def test_smaller_versions_and_bad_names():
    w = make("W-B", num_requests=3, max_len=64, vocab=160)
    assert len(w.requests) == 3 and all(len(r.prompt_token_ids) + r.max_tokens <= 64 for r in w.requests)
    assert all(10 <= t < 160 for r in w.requests for t in r.prompt_token_ids)
    with pytest.raises(ValueError, match="unknown workload 'W-D'"):
        make("W-D")
    with pytest.raises(ValueError, match="exactly one"):
        Load("x", fraction=0.5, concurrency=2)
