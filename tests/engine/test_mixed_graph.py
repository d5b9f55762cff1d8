"""Whole-step graphs for small mixed steps (engine/mixed_graph.py): the parts that run
without a GPU. The graphs themselves: tests/gpu/test_gpu_mixed_graph.py.

Comparator: `torch.equal` on the real rows of a padded launch against the step's own."""
import random
from types import SimpleNamespace

import pytest
import torch

from detent.engine.mixed_graph import MixedGraphRunner, graph_pairs, layout, pair_for


def test_pairs_and_the_pair_a_step_takes():
    pairs = graph_pairs(512, 256, 8192)
    assert (16, 4) in pairs and (512, 256) in pairs and (16, 64) in pairs and (16, 256) not in pairs  # S <= 4 T
    assert max(t for t, _ in graph_pairs(64, 256, 8192)) == 64
    assert {s for _, s in graph_pairs(512, 8, 8192)} == {4, 8}  # capped at max_num_seqs
    assert {t for t, _ in pairs} == {16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512}  # the pieces' ladder
    assert pair_for(pairs, 17, 3) == (24, 4) and pair_for(pairs, 100, 40) == (128, 64)
    assert pair_for(pairs, 16, 4) == (16, 4) and pair_for(pairs, 15, 4) == (16, 16)  # padding takes a sequence
    assert pair_for(pairs, 32, 17) == (32, 64) and pair_for(pairs, 128, 65) == (128, 256)  # n + n tokens, n + 1 seqs
    assert pair_for(pairs, 513, 1) is None and pair_for(pairs, 16, 300) is None
    assert graph_pairs(8, 256, 8192) == []


def test_no_capture_or_padding_sequence_is_longer_than_max_model_len():
    # on the H200 a SmolLM2 engine with max_model_len 512 and 2,048-token whole-step graphs
    # died in the capture (illegal memory access): the capture's one sequence owning the rest
    # of 2,048 rows read past the 512-row rotary table and the 32-block table
    for t, s, mq, cap in [(2048, 16, 2, 512), (2048, 4, 512, 512), (96, 16, 3, 16), (512, 64, 33, 64)]:
        q = layout(t, s, mq, cap)
        assert len(q) == s and sum(q) == t and q[0] == mq and max(q) <= cap, q
    assert layout(2048, 16, 2, 512).count(1) > 0  # decodes kept where the sequences allow
    assert layout(64, 4, 5) == [5, 1, 1, 57]  # no cap: one sequence owns the rest
    for t, s, mq, cap in [(2048, 4, 2, 512), (64, 4, 17, 16), (40, 1, 40, 16)]:
        with pytest.raises(ValueError):  # 4 sequences of <= 512 cannot hold 2,048 rows with a 2-query one
            layout(t, s, mq, cap)
    pairs = graph_pairs(512, 256, 8192)
    assert pair_for(pairs, 100, 3) == (128, 4) and pair_for(pairs, 100, 3, cap=16) == (128, 16)  # 28 rows: 2 seqs
    assert pair_for(pairs, 300, 3) == (384, 4) and pair_for(pairs, 300, 3, cap=16) == (384, 16)  # 84 rows: 6
    assert pair_for(pairs, 500, 254, cap=4) is None
    r = MixedGraphRunner(None, [], 8, None, torch.device("cpu"), max_model_len=16, pairs=[(64, 16)],
                         attention_site=())
    meta, pos = _step((5, 1, 3), (9, 12, 3), 8)
    padded = r.fill(torch.arange(9), pos, meta, 64, 16)
    assert padded.query_start_loc.tolist()[:9] == [0, 5, 6, 9, 25, 41, 57, 64, 64]  # 55 rows: 16, 16, 16, 7
    assert padded.seq_lens.tolist()[3:7] == [16, 16, 16, 7] and r.positions[9:64].max() < 16
    assert r.slots[9:64].div(8, rounding_mode="floor").eq(0).all()  # the padding writes the null block only
    with pytest.raises(ValueError, match="sequence of their own"):
        r.fill(torch.arange(9), pos, meta, 64, 6)


def test_the_capture_plan_keeps_every_sequence_within_max_model_len():
    from detent.models.presets import preset
    from detent.selection import make_dispatcher
    from detent.selection.facts import default_facts_for
    c = preset("llama-3.1-8b")["config"]
    facts = default_facts_for(c, device="cuda", dtype="bfloat16", max_context=512, max_num_batched_tokens=4096,
                              max_num_seqs=256, num_sms=132, arch="sm90", triton=True)
    site = (("num_heads", 32), ("num_kv_heads", 8), ("head_dim", 128), ("block_size", 16), ("dtype", "bfloat16"))
    r = MixedGraphRunner(None, [], 16, make_dispatcher(facts, "pinned", None), torch.device("cpu"),
                         max_model_len=512, pairs=graph_pairs(2048, 256, 4096), attention_site=site)
    plan = r.plan()
    assert plan and max(t for t, _, _ in plan) == 2048
    assert all(max(layout(t, s, mq, 512)) <= 512 for t, s, mq in plan)
    # 4 sequences of <= 512 hold 2,048 rows only as 4 x 512: no shorter longest query is captured there
    assert {mq for t, s, mq in plan if (t, s) == (2048, 4)} <= {512}


def test_a_filled_step_gives_the_attention_its_own_bits(monkeypatch):
    # the runner's own padding (a sequence owning the extra rows in the null block, empty
    # sequences, the longest KV, no host query lengths) through the Triton attention under
    # the interpreter: every real row and every block but the null one equal the step alone
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("detent.kernels.attention_triton")
    from detent.kernels.attention_triton import attention_triton_paged

    bs, h, kvh, d = 8, 4, 2, 16
    meta, _ = _step((45, 1, 3), (45, 30, 12), bs)
    t = meta.num_tokens
    g = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(t, x, d, generator=g) for x in (h, kvh, kvh))
    start = torch.randn(2, 16, bs, kvh, d, generator=g)
    kw = dict(split_tokens=16, block_m=64, block_n=16, combine="auto")
    alone = start.clone()
    y = attention_triton_paged(q, k, v, alone, meta, 0.3, **kw)
    cache = start.clone()
    r = MixedGraphRunner(None, [cache], bs, None, torch.device("cpu"), max_model_len=96, pairs=[(64, 4)],
                         attention_site=())
    padded = r.fill(torch.arange(t), torch.arange(t), meta, 64, 4)
    assert padded.num_tokens == 64 and padded.num_seqs == 4 and padded.max_seqlen_k == 96
    assert padded.query_start_loc.tolist() == [0, 45, 46, 49, 64]  # the fourth sequence owns rows 49..63
    assert padded.seq_lens.tolist()[3] == 15 and r.slots[t:64].div(bs, rounding_mode="floor").eq(0).all()
    grow = lambda x: torch.cat([x, torch.randn((64 - t,) + x.shape[1:], generator=g)])  # noqa: E731
    yp = attention_triton_paged(grow(q), grow(k), grow(v), cache, padded, 0.3, **kw)
    assert torch.equal(yp[:t], y) and yp.isfinite().all()  # every row computed, the padding's too
    assert torch.equal(cache[:, 1:], alone[:, 1:])  # only the null block took the padding's KV
    with pytest.raises(ValueError, match="sequence of their own"):
        r.fill(torch.arange(t), torch.arange(t), meta, 64, 3)


def test_capture_needs_cuda():
    r = MixedGraphRunner(None, [], 16, None, torch.device("cpu"), max_model_len=64, pairs=[(16, 4)],
                         attention_site=())
    with pytest.raises(ValueError, match="CUDA"):
        r.capture()


@pytest.mark.parametrize("max_tokens,most", [(512, 80), (2048, 170)])
def test_the_capture_plan_on_the_h200_deployment(max_tokens, most):
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
                         max_model_len=4096, pairs=graph_pairs(max_tokens, 256, 8192), attention_site=site)
    plan = r.plan()
    assert len(plan) == len(set(plan)) and 20 <= len(plan) <= most, len(plan)
    tiles = {(t, s): {dict(r.key(t, s, mq))["block_m"] for tt, ss, mq in plan if (tt, ss) == (t, s)}
             for t, s in graph_pairs(512, 256, 8192)}
    # 4 sequences of <= 4 queries (the 16-row tile) never need 512 tokens; of <= 127 (64 rows) they can
    assert tiles[(512, 4)] == {64, 128} and 16 in tiles[(16, 4)]
    assert tiles[(512, 256)] >= {16, 64, 128}  # 256 sequences: any tile
    for t, s, mq in plan:  # every graph's capture layout fits it
        q = layout(t, s, mq)
        assert len(q) == s and sum(q) == t and q[0] == mq and min(q) >= 0
    # every step of <= max_tokens tokens with a prompt chunk has a graph: the longest query,
    # the sequences, the tokens drawn at random (a step of 17 sequences and 32 tokens takes
    # (64, 64), which needs a graph for a 16-query chunk beside 16 decodes)
    rng = random.Random(0)
    missing = []
    for _ in range(3000):
        n = rng.choice([1, 2, 3, 4, 5, 15, 16, 17, 18, 40, 63, 64, 65, 100, 200, 255, 256])
        mq = rng.randint(2, max_tokens)
        lo, hi = mq + n - 1, min(max_tokens, mq * n)  # one chunk of mq, the others 1 .. mq queries
        if lo > hi:
            continue
        t = rng.randint(lo, hi)
        if pair_for(r.pairs, t, n) is None:  # no pair holds it (e.g. 511 tokens of 256 sequences)
            continue
        meta = SimpleNamespace(num_tokens=t, num_seqs=n, max_seqlen_q=mq, block_tables=torch.zeros(n, 4))
        if r.plan_entry(meta) is None:
            missing.append((t, n, mq))
    assert not missing, missing[:10]


def _step(query_lens, kv_lens, bs, first_block=1):
    """Metadata of a step over distinct KV blocks from `first_block` on (block 0 is the null block)."""
    from detent.selection.context import AttentionMetadata
    tables, pos, slots, qsl, nxt = [], [], [], [0], first_block
    width = max(-(-k // bs) for k in kv_lens)
    for q, k in zip(query_lens, kv_lens):
        n = -(-k // bs)
        tables.append(list(range(nxt, nxt + n)) + [0] * (width - n))
        nxt += n
        p = torch.arange(k - q, k)
        pos.append(p)
        slots.append(torch.tensor(tables[-1])[p // bs] * bs + p % bs)
        qsl.append(qsl[-1] + q)
    i32 = dict(dtype=torch.int32)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, **i32), seq_lens=torch.tensor(kv_lens, **i32),
        block_tables=torch.tensor(tables, **i32), slot_mapping=torch.cat(slots), num_seqs=len(query_lens),
        num_tokens=qsl[-1], max_seqlen_q=max(query_lens), max_seqlen_k=max(kv_lens), block_size=bs,
        query_start_loc_cpu=tuple(qsl), seq_lens_cpu=tuple(kv_lens))
    return meta, torch.cat(pos)


STEPS = [((6, 1, 1), (20, 9, 33)),  # 8 tokens -> (16, 4)
         ((3, 2, 1, 1), (3, 40, 12, 7)),  # 2-3-token chunks: (16, 8)
         ((30, 1, 1), (60, 25, 90)),  # 32 tokens: (32, 4), no padding row
         ((20, 17, 1), (20, 50, 2)),  # 38 tokens -> (64, 4)
         ((6, 1, 1), (700, 9, 33))]  # a long KV: stock splits it by the batch (the control below)


def _replay_without_graph(query_lens, kv_lens, mode):
    """(the step alone, what its replay computes, the caches after each): the model at the padded
    shape with the capture's host values (the longest query the plan captured, the longest KV, S
    sequences) over the filled static buffers, against the step run alone. Tiny Llama, CUDA facts
    (the Triton candidates under the interpreter)."""
    from engine_helpers import TINY_LLAMA
    from detent.engine.kv_cache import KVCacheSpec, allocate_kv_caches
    from detent.models import ModelConfig, load_model
    from detent.selection import make_dispatcher
    from detent.selection.context import ForwardContext, forward_context
    from detent.selection.facts import default_facts_for

    hf = {**TINY_LLAMA, "max_position_embeddings": 1024}  # rope over the KV lengths below
    mc = ModelConfig.from_hf(hf)
    model = load_model(mc, device="cpu", dtype="float32", load_format="dummy", seed=0)
    facts = default_facts_for(hf, device="cuda", dtype="float32", max_context=1024,
                              max_num_batched_tokens=64, max_num_seqs=8, triton=True, num_sms=8, arch="sm90")
    d = make_dispatcher(facts, mode)
    bs = 16
    spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.float32, bs)
    g = torch.Generator().manual_seed(3)
    start = [torch.randn(c.shape, generator=g) for c in allocate_kv_caches(spec, 64, torch.device("cpu"))]
    site = (("num_heads", 4), ("num_kv_heads", 2), ("head_dim", 16), ("block_size", bs), ("dtype", "float32"))
    meta, pos = _step(query_lens, kv_lens, bs)
    ids = torch.randint(2, 160, (meta.num_tokens,), generator=g)

    alone = [c.clone() for c in start]
    with torch.inference_mode(), forward_context(ForwardContext(attn=meta, kv_caches=alone, dispatcher=d)):
        want = model(ids, pos)

    padded = [c.clone() for c in start]
    r = MixedGraphRunner(model, padded, bs, d, torch.device("cpu"), max_model_len=1024,
                         pairs=graph_pairs(64, 8, 64), attention_site=site)
    entry = r.plan_entry(meta)
    assert entry is not None
    t_pad, s_pad, mq = entry
    r.fill(ids, pos, meta, t_pad, s_pad)
    ctx = ForwardContext(attn=r._meta(t_pad, s_pad, mq), kv_caches=padded, dispatcher=d)  # the capture's host values
    with torch.inference_mode(), forward_context(ctx):
        got = model(r.input_ids[:t_pad], r.positions[:t_pad])
    return want, got, alone, padded


@pytest.mark.parametrize("query_lens,kv_lens", STEPS)
def test_a_whole_step_graph_computes_the_steps_rows(query_lens, kv_lens, monkeypatch):
    """What a replay runs, without the graph (`_replay_without_graph`): under pinned, every real
    row and the KV cache equal the step run alone (`torch.equal`). The GEMM tiles on CPU are not
    neutral, so each step stays within one row of the GEMM table (1-16, 17-64)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("detent.kernels.attention_triton")
    want, got, alone, padded = _replay_without_graph(query_lens, kv_lens, "pinned")
    assert torch.equal(got[:want.shape[0]], want)
    assert all(torch.equal(a[:, 1:], b[:, 1:]) for a, b in zip(padded, alone))  # the padding: null block only
    assert got.isfinite().all()  # every row the graph computes is finite, the padding's too


def test_under_stock_selection_the_padded_shape_moves_bits(monkeypatch):
    """The control: under stock, the attention's split follows the batch (FA3's heuristic over
    the sequences and the KV length), so at the padded shape (one more sequence, the longest
    KV) a long sequence's rows reduce over other splits, and the test above could fail."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytest.importorskip("detent.kernels.attention_triton")
    moved = 0
    for query_lens, kv_lens in STEPS:
        want, got, _, _ = _replay_without_graph(query_lens, kv_lens, "stock")
        moved += not torch.equal(got[:want.shape[0]], want)
    assert moved


def test_an_attention_not_tested_inside_prompt_graphs_keeps_them_off_before_any_capture():
    # the default is on: a deployment whose attention reads host metadata (the CPU paths) must
    # start without them, told why; FlashAttention-4's replays were tested on the H200 (lease 21)
    from detent.engine.mixed_graph import refusal
    seen = []

    def selector(impl):
        def sel(**runtime):
            seen.append(runtime)
            return {"impl": impl}
        return sel
    assert refusal(selector("triton_paged")) is None and refusal(selector("fa4")) is None
    assert "'paged_split'" in refusal(selector("paged_split"))
    assert set(seen[0]) == {"num_tokens", "num_seqs", "max_seqlen_q", "max_seqlen_k", "total_kv"}


def test_an_attention_sized_by_the_longest_query_is_captured_at_the_longest():
    # FlashAttention-4's grid reads the host's max_seqlen_q: its graphs are captured at the longest
    # query a step of (T, S) can hold, one per pair (its selection does not follow the batch); the
    # Triton deployment's at the shortest probe of each selection
    from detent.models.presets import preset
    from detent.selection import default_tuple, make_dispatcher
    from detent.selection.facts import default_facts_for
    c = preset("llama-3.1-8b")["config"]
    site = (("num_heads", 32), ("num_kv_heads", 8), ("head_dim", 128), ("block_size", 16), ("dtype", "bfloat16"))

    def plan(impl, tmp):
        facts = default_facts_for(c, device="cuda", dtype="bfloat16", max_context=1024, max_num_batched_tokens=8192,
                                  max_num_seqs=256, num_sms=132, arch="sm90", triton=True, fa4="4.0.0b36")
        path = f"{tmp}/{impl}.json"
        default_tuple(facts, knobs={"attention": {"impl": impl}}).save(path)
        r = MixedGraphRunner(None, [], 16, make_dispatcher(facts, "pinned", path), torch.device("cpu"),
                             max_model_len=1024, pairs=graph_pairs(2048, 256, 8192), attention_site=site)
        return r, r.plan()

    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        r, fa4 = plan("fa4", tmp)
        _, tri = plan("triton_paged", tmp)
    assert {dict(r.key(t, s, mq))["impl"] for t, s, mq in fa4} == {"fa4"}
    assert sorted((t, s) for t, s, _ in fa4) == sorted(set((t, s) for t, s, _ in fa4))  # one graph a pair
    assert all(mq == min(t, 1024) for t, s, mq in fa4), [p for p in fa4 if p[2] != min(p[0], 1024)]
    for t, s, mq in fa4:  # the capture's layout holds it
        assert sum(layout(t, s, mq, 1024)) == t
    assert min(mq for _, _, mq in tri) <= 3  # Triton: the shortest probe of a selection
