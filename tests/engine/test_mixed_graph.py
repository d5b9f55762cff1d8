"""Whole-step graphs for small mixed steps (engine/mixed_graph.py): the parts that run
without a GPU. The graphs themselves: tests/gpu/test_gpu_mixed_graph.py.

Comparator: `torch.equal` on the real rows of a padded launch against the step's own."""
import pytest
import torch

from detent.engine.mixed_graph import MixedGraphRunner, graph_pairs, pair_for


def test_pairs_and_the_pair_a_step_takes():
    pairs = graph_pairs(512, 256, 8192)
    assert (16, 4) in pairs and (512, 256) in pairs and (16, 64) not in pairs  # S <= T
    assert max(t for t, _ in graph_pairs(64, 256, 8192)) == 64
    assert {s for _, s in graph_pairs(512, 8, 8192)} == {4, 8}  # capped at max_num_seqs
    assert pair_for(pairs, 17, 3) == (32, 4) and pair_for(pairs, 100, 40) == (128, 64)
    assert pair_for(pairs, 513, 1) is None and pair_for(pairs, 16, 300) is None
    assert graph_pairs(8, 256, 8192) == []


def test_a_filled_step_gives_the_attention_its_own_bits(monkeypatch):
    # the runner's own padding (more token rows, empty sequences, the longest KV, no host
    # query lengths) run through the Triton attention under the interpreter: every real
    # row and the cache equal the step run alone
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("detent.kernels.attention_triton")
    from detent.kernels.attention_triton import attention_triton_paged
    from tests.kernels.paged_cases import PagedCase

    case = PagedCase([45, 30, 12], h=4, kvh=2, d=16, block_size=8, seed=9)
    chunks = [(0, 45), (29, 30), (9, 12)]
    kw = dict(split_tokens=16, block_m=64, block_n=16, combine="auto")
    cache = case.fresh_cache()
    case.prefill_prefix(cache, [s for s, _ in chunks])
    q, k, v, meta = case.step(cache, chunks)
    ref_cache = cache.clone()
    y = attention_triton_paged(q, k, v, ref_cache, meta, 0.3, **kw)
    r = MixedGraphRunner(None, [cache], case.bs, None, torch.device("cpu"), max_model_len=96,
                         pairs=[(64, 4)], attention_site=())
    ids = torch.arange(meta.num_tokens)
    padded = r.fill(ids, ids, meta, 64, 4)
    assert padded.num_tokens == 64 and padded.num_seqs == 4 and padded.max_seqlen_k == 96
    assert padded.query_start_loc.tolist()[-1] == meta.num_tokens  # the empty sequence owns nothing
    assert r.slots[meta.num_tokens:64].eq(-1).all()
    g = torch.Generator().manual_seed(1)
    grow = lambda x: torch.cat([x, torch.randn((64 - x.shape[0],) + x.shape[1:], generator=g)])  # noqa: E731
    yp = attention_triton_paged(grow(q), grow(k), grow(v), cache, padded, 0.3, **kw)
    assert torch.equal(yp[:meta.num_tokens], y)
    assert torch.equal(cache.nan_to_num(7.0), ref_cache.nan_to_num(7.0))


def test_capture_needs_cuda():
    r = MixedGraphRunner(None, [], 16, None, torch.device("cpu"), max_model_len=64, pairs=[(16, 4)],
                         attention_site=())
    with pytest.raises(ValueError, match="CUDA"):
        r.capture()


def test_the_capture_plan_on_the_h200_deployment():
    # Llama-3.1-8B shapes, pinned, selectors only (no GPU): one graph per attention selection
    # a step can need at (T, S)
    from detent.models.presets import preset
    from detent.selection import make_dispatcher
    from detent.selection.facts import default_facts_for
    c = preset("llama-3.1-8b")["config"]
    facts = default_facts_for(c, device="cuda", dtype="bfloat16", max_context=4096, max_num_batched_tokens=8192,
                              max_num_seqs=256, num_sms=132, arch="sm90", triton=True)
    site = (("num_heads", 32), ("num_kv_heads", 8), ("head_dim", 128), ("block_size", 16), ("dtype", "bfloat16"))
    r = MixedGraphRunner(None, [], 16, make_dispatcher(facts, "pinned", None), torch.device("cpu"),
                         max_model_len=4096, pairs=graph_pairs(512, 256, 8192), attention_site=site)
    plan = r.plan()
    assert len(plan) == len(set(plan)) and 20 <= len(plan) <= 80, len(plan)
    tiles = {(t, s): {dict(r.key(t, s, mq))["block_m"] for tt, ss, mq in plan if (tt, ss) == (t, s)}
             for t, s in graph_pairs(512, 256, 8192)}
    # 4 sequences of <= 4 queries (the 16-row tile) never need 512 tokens; of <= 127 (64 rows) they can
    assert tiles[(512, 4)] == {64, 128} and 16 in tiles[(16, 4)]
    assert tiles[(512, 256)] >= {16, 64, 128}  # 256 sequences: any tile
    for t, s, mq in plan:  # every graph's step layout fits it
        assert mq + s - 1 <= t
