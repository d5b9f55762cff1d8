"""FlashAttention-4 (`fa4`) on the GPU: numerics against a float64 reference,
and the invariance cells with `torch.equal` — a row alone vs packed, paged vs
contiguous, a decode row vs the prefill row of the same position, chunked
prefill, a decode row in a mixed step vs a decode-only step (FA4's two tile
schedulers), more than 256 sequences (its block-to-batch lookup), a CUDA
graph replay — and the engine's invariance battery under the FA4 tuple.
What the mechanism prevents is shown failing: choosing FA4 for steps with
prefill and Triton for decode-only steps moves a decoded row's bits, and so
does stock selection.

Needs flash-attn-4 4.0.0b36 on an sm90 GPU (the fa4 extra); skipped otherwise.
"""
import os
import sys

import pytest
import torch

from detent.engine.step_stats import KindCounters
from detent.kernels import registry
from paged_cases import PagedCase

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


@pytest.fixture(autouse=True)
def fa4():
    if "fa4" not in registry.candidates("attention"):
        pytest.skip(f"fa4 is not registered: {registry.why_unavailable('attention', 'fa4')}")
    from detent.kernels import attention_fa4
    return attention_fa4


def _pinned(h, kvh, d, page):
    """The pinned FA4 selection the SelIR program makes for these shapes (knob impl = fa4)."""
    from detent.selection import programs, solve
    from detent.selection.facts import default_facts_for
    facts = default_facts_for({"hidden_size": h * d, "num_attention_heads": h, "num_key_value_heads": kvh,
                               "head_dim": d}, device="cuda", dtype="bfloat16", page_size=page, max_context=8192)
    s = solve(programs.load("attention"), {**facts, "num_heads": h, "num_kv_heads": kvh, "head_dim": d,
                                           "block_size": page, "dtype": "bfloat16"})
    sel = s.compile(dict(s.default_assignment(), impl="fa4"))(num_seqs=1, max_seqlen_q=1, max_seqlen_k=1)
    assert sel.pop("impl") == "fa4"
    return sel


def _cache(case, page):
    # NaN where nothing was written: a wrong read shows. With pages of tile_n (128) FA4 loads
    # whole pages by TMA, including rows past a sequence's end, and 0 * NaN is NaN: zeros there
    # (the engine's cache starts as zeros and later holds finite stale rows)
    if page == 128:
        return torch.zeros(2, case.num_blocks, case.bs, case.kvh, case.d, dtype=case.dtype, device="cuda")
    return case.fresh_cache()


def _run(fa4, case, chunks, order=None, page=16):
    cache = _cache(case, page)
    case.prefill_prefix(cache, [s for s, _ in chunks])
    q, k, v, meta = case.step(cache, chunks, order)
    scale = case.d ** -0.5
    return fa4.attention_fa4(q, k, v, cache, meta, scale, **_pinned(case.h, case.kvh, case.d, page)), (q, meta)


@pytest.mark.parametrize("h,kvh,d", [(32, 8, 128), (8, 2, 64), (16, 16, 128)])
@pytest.mark.parametrize("page", [16, 64, 128])
def test_matches_float64_reference(fa4, h, kvh, d, page):
    from detent.kernels.attention_triton import attention_reference
    case = PagedCase([700, 300, 1030], h=h, kvh=kvh, d=d, block_size=page, dtype=BF16, device="cuda", seed=h + d)
    chunks = [(0, 700), (250, 300), (1029, 1030)]
    y, (q, meta) = _run(fa4, case, chunks, page=page)
    assert not y.isnan().any()
    ref_cache = _cache(case, page)
    case.prefill_prefix(ref_cache, [s for s, _ in chunks])
    _, k, v, _ = case.step(ref_cache, chunks)
    ref = attention_reference(q, k, v, ref_cache, meta, d ** -0.5)
    assert ((y.double() - ref.double()).norm() / ref.double().norm()).item() < 2e-2


@pytest.mark.parametrize("page", [16, 128])
def test_rows_alone_packed_chunked_decode_mixed(fa4, page):
    case = PagedCase([1100, 333, 64], h=32, kvh=8, d=128, block_size=page, dtype=BF16, device="cuda", seed=7)
    full, _ = _run(fa4, case, [(0, 1100), (0, 333), (0, 64)], page=page)
    alone, _ = _run(fa4, case, [(0, 1100), (0, 0), (0, 0)], order=[0], page=page)
    assert torch.equal(alone, full[:1100])  # alone vs packed
    for start in (1099, 1097, 1050, 777, 513, 256, 1):  # decode (start 1099), chunked prefills
        for order in ([0, 1, 2], [2, 0]):
            y, _ = _run(fa4, case, [(start, 1100), (300, 333), (63, 64)], order=order, page=page)
            off = 0 if order[0] == 0 else 1
            assert torch.equal(y[off: off + 1100 - start], full[start:1100]), (start, order)
    # decode-only step (every sequence's rows fit one tile: FA4's static persistent scheduler)
    # vs the same rows inside the prefill and inside a mixed step (its varlen scheduler)
    dec, _ = _run(fa4, case, [(1099, 1100), (332, 333), (63, 64)], page=page)
    assert torch.equal(dec, torch.stack([full[1099], full[1100 + 332], full[1100 + 333 + 63]]))
    mixed, _ = _run(fa4, case, [(1099, 1100), (0, 333), (63, 64)], page=page)
    assert torch.equal(mixed[0], dec[0]) and torch.equal(mixed[-1], dec[-1])


def test_paged_equals_contiguous(fa4):
    case = PagedCase([900, 257, 40], h=32, kvh=8, d=128, dtype=BF16, device="cuda", seed=5)
    chunks = [(0, 900), (200, 257), (39, 40)]
    for page in (16, 128):
        c = PagedCase([900, 257, 40], h=32, kvh=8, d=128, block_size=page, dtype=BF16, device="cuda", seed=5)
        paged, (q, meta) = _run(fa4, c, chunks, page=page)
        sel = _pinned(32, 8, 128, page)
        k = torch.cat([case.k[b][:e] for b, (_, e) in enumerate(chunks)])  # [total_k, KVH, D], contiguous
        v = torch.cat([case.v[b][:e] for b, (_, e) in enumerate(chunks)])
        cu_k = torch.tensor([0, 900, 1157, 1197], dtype=torch.int32, device="cuda")
        contig = fa4._FWD(q, k, v, cu_seqlens_q=meta.query_start_loc, cu_seqlens_k=cu_k, max_seqlen_q=meta.max_seqlen_q,
                          max_seqlen_k=meta.max_seqlen_k, softmax_scale=128 ** -0.5, causal=True,
                          tile_mn=(sel["tile_m"], sel["tile_n"]), mma_pv_is_rs=sel["mma_pv_is_rs"],
                          intra_wg_overlap=sel["intra_wg_overlap"], num_threads=sel["num_threads"], num_splits=1,
                          pack_gqa=sel["pack_gqa"])[0]
        assert torch.equal(paged, contig), page


def test_more_than_256_sequences(fa4):
    # above 256 sequences FA4 adds a flat block-to-batch lookup to its scheduler
    n = 300
    case = PagedCase([40 + (7 * i) % 90 for i in range(n)], h=32, kvh=8, d=128, dtype=BF16, device="cuda", seed=3)
    many, _ = _run(fa4, case, [(L - 1, L) for L in case.seq_lens])
    for b in (0, 151, n - 1):
        chunks = [(0, 0)] * n
        chunks[b] = (case.seq_lens[b] - 1, case.seq_lens[b])
        one, _ = _run(fa4, case, chunks, order=[b])
        assert torch.equal(one[0], many[b]), b


def test_per_step_choice_would_break_decode_rows(fa4):
    """Why one implementation per deployment: FA4 for steps with prefill and Triton
    for decode-only steps gives a decoded row other bits than the same row prefilled."""
    from detent.kernels.attention_triton import attention_triton_paged
    case = PagedCase([1100], h=32, kvh=8, d=128, dtype=BF16, device="cuda", seed=7)
    full, _ = _run(fa4, case, [(0, 1100)])
    cache = case.fresh_cache()
    case.prefill_prefix(cache, [1099])
    q, k, v, meta = case.step(cache, [(1099, 1100)])
    tri = attention_triton_paged(q, k, v, cache, meta, 128 ** -0.5, split_tokens=256, block_m=16, block_n=64,
                                 num_warps=4, rowsum="mma")
    assert not torch.equal(tri[0], full[1099])


def test_cuda_graph_replay_equals_eager(fa4):
    """A decode batch captured in a CUDA graph (the engine's decode graphs) and replayed
    on new metadata: the same bits as an eager call. engine/cuda_graph.py lists fa4 as
    graph-safe only once this passes on the device."""
    case = PagedCase([300, 77, 512, 33], h=32, kvh=8, d=128, dtype=BF16, device="cuda", seed=9)
    sel = _pinned(32, 8, 128, 16)
    cache = torch.zeros(2, case.num_blocks, 16, 8, 128, dtype=BF16, device="cuda")
    case.prefill_prefix(cache, [L - 2 for L in case.seq_lens])
    q, k, v, meta = case.step(cache, [(L - 2, L - 1) for L in case.seq_lens])
    bufs = [t.clone() for t in (q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.slot_mapping)]
    import dataclasses
    # as the engine captures: the KV bound is max_model_len, not this step's longest sequence
    smeta = dataclasses.replace(meta, query_start_loc=bufs[3], seq_lens=bufs[4], block_tables=bufs[5],
                                slot_mapping=bufs[6], max_seqlen_k=1024)
    scache = cache.clone()
    for _ in range(2):  # compile and warm up outside the capture
        fa4.attention_fa4(*bufs[:3], scache.clone(), smeta, 128 ** -0.5, **sel)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fa4.attention_fa4(*bufs[:3], scache, smeta, 128 ** -0.5, **sel)
    # the next decode step: new queries, lengths one longer
    eager_cache = cache.clone()
    case.prefill_prefix(eager_cache, [L - 1 for L in case.seq_lens])
    q2, k2, v2, meta2 = case.step(eager_cache, [(L - 1, L) for L in case.seq_lens])
    want = fa4.attention_fa4(q2, k2, v2, eager_cache.clone(), meta2, 128 ** -0.5, **sel)
    scache.copy_(eager_cache)
    for b, t in zip(bufs, (q2, k2, v2, meta2.query_start_loc, meta2.seq_lens, meta2.block_tables,
                           meta2.slot_mapping)):
        b.copy_(t)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)



def test_whole_step_graph_replay_equals_eager():
    """Steps with prompt rows through a whole-step graph (engine/mixed_graph.py) under the FA4
    tuple: the same bits as the eager step. FA4's grid follows the host's longest query, so its
    graphs are captured at the longest query of (T, S) (`FULL_QUERY_CAPTURE`). It passed on the
    H200 in lease 21, which let FA4 deployments into these graphs (GRAPH_SAFE_ATTENTION)."""
    from detent.engine.mixed_graph import MixedGraphRunner
    sys.path.insert(0, os.path.dirname(__file__))
    from test_gpu_cuda_graph import BS, tiny_mixed_steps
    _, model, caches, disp, run = tiny_mixed_steps("llama", knobs={"attention": {"impl": "fa4"}})
    site = (("num_heads", 8), ("num_kv_heads", 2), ("head_dim", 64), ("block_size", BS), ("dtype", "bfloat16"))
    with torch.inference_mode():
        g = MixedGraphRunner(model, caches, BS, disp, torch.device("cuda"), max_model_len=512,
                             pairs=[(16, 4), (64, 4)], attention_site=site).capture()
        assert g.disabled is None, g.disabled
        assert {mq for _, _, mq in g.plan()} == {16, 64}
        for chunks in ([(0, 10), (0, 17), (0, 30)],  # 57 tokens -> (64, 4)
                       [(10, 40), (16, 17), (59, 60)],  # a chunk beside two decodes
                       [(0, 5), (0, 3), (0, 7)],  # 15 tokens -> (16, 4)
                       [(38, 40), (16, 17), (58, 60)]):  # 2-token chunks
            eager = run(chunks)
            replay = run(chunks, g)
            assert replay is not None and torch.equal(replay, eager), chunks


def test_an_fa4_deployment_replays_whole_step_graphs_with_the_eager_bits():
    """The engine, end to end: under the FA4 tuple with detent-serve's graphs (GRAPH_SAFE_ATTENTION
    admits fa4 since lease 21), steps with prompt rows replay whole-step graphs, and whole requests'
    tokens and logprobs are `==` to the same requests with every step eager. Written after lease 21,
    not yet run."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from gpu_engine import set_mode

    from detent.engine import SamplingParams
    llm = _engine()
    g = torch.Generator().manual_seed(0)
    prompts = [{"prompt_token_ids": torch.randint(3, 1000, (n,), generator=g).tolist()}
               for n in (300, 45, 700, 9, 130, 260)]
    params = SamplingParams(temperature=0, max_tokens=12, logprobs=3, ignore_eos=True)

    def run():
        assert llm.reset_prefix_cache()
        outs = llm.generate(prompts, params, use_tqdm=False)
        return [(o.outputs[0].token_ids, [{k: v.logprob for k, v in d.items()} for d in o.outputs[0].logprobs])
                for o in outs]

    def replayed():  # mixed steps that replayed one whole-step graph
        return KindCounters(*llm.llm_engine.stats()["steps_by_kind"]["mixed"]).whole_graph_steps

    set_mode(llm, "pinned+attention.impl=fa4", graphs=False)
    eager, before = run(), replayed()
    info = set_mode(llm, "pinned+attention.impl=fa4", graphs="serving")
    assert info["graphs"].get("mixed_graphs") == "captured", info
    assert run() == eager and replayed() > before


# ---- the engine: the invariance battery under the FA4 tuple
CFG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 512,
       "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2,
       "head_dim": 64, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024,
       "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}


# Wider, for the battery: on the H200 (lease 9) stock gave the alone bits in all 35 cells on
# CFG's 2-layer, 512-wide model (presumably bf16 rounding hides its reduction orders at K = 512-1,024), so
# the control could not fail there; stock's GEMMs reorder sums over K = 4,096-11,008 here.
WIDE = {**CFG, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 4, "num_attention_heads": 32,
        "num_key_value_heads": 8, "head_dim": 128}


def _engine(hf=CFG):
    from detent.engine.llm import LLM
    from detent.models.config import ModelConfig
    from detent.models.loader import load_model
    cfg = ModelConfig.from_hf(hf)
    model = load_model(cfg, device="cuda", dtype=BF16, load_format="dummy", progress=False, seed=0)
    return LLM.from_model(model, cfg, selection="pinned", max_model_len=1024, max_num_seqs=64,
                          max_num_batched_tokens=256, enforce_eager=True, num_gpu_blocks=1024)


class PerStepSplit:
    """The forbidden design: FA4 for steps with prefill, Triton for decode-only steps."""
    mode = "pinned"

    def __init__(self, with_prefill, decode_only):
        self.a, self.b = with_prefill.provider, decode_only.provider

    def selector(self, family, site):
        a, b = self.a.selector(family, site), self.b.selector(family, site)
        if family != "attention":
            return a
        return lambda **rt: a(**rt) if rt["max_seqlen_q"] > 1 else b(**rt)


def test_battery_passes_under_the_fa4_tuple_and_fails_under_stock():
    """The battery (26 + 9 cells) under the FA4 tuple, and under stock as the control, on the
    wider model (WIDE says why; passed on the H200 in lease 20).

    The per-step split (FA4 for steps with prefill, Triton for decode-only steps) is not
    a control here: the battery's target holds at most 72 tokens of context, inside one
    of Triton's 256-token KV splits, and on the H200 (lease 8) the split gave the alone
    bits in every cell. The split's controls are the two tests below, whose prompts of
    up to 200 and 300 tokens cross it (both fail under the split, as they must)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from gpu_engine import set_mode  # the benchmarks' mode switch: "pinned+attention.impl=fa4"

    from detent.battery import OfflineBackend, run_battery
    from detent.battery_cells import CELLS, STRONG
    llm = _engine(WIDE)
    info = set_mode(llm, "pinned+attention.impl=fa4", graphs=False)
    assert info["knobs"] == {"attention": {"impl": "fa4"}}
    results = run_battery(OfflineBackend(llm), CELLS + STRONG)
    assert [r.cell for r in results if not r.passed] == []
    set_mode(llm, "stock", graphs=False)
    assert any(not r.passed for r in run_battery(OfflineBackend(llm), CELLS + STRONG))


def test_trainer_logprobs_equal_the_rollouts_under_the_fa4_tuple():
    """RL's contract with FA4 for every step: the trainer's forward (all tokens at once,
    with gradients) reproduces each sampled token's logprob with `torch.equal`."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from gpu_engine import set_mode

    from detent.engine import SamplingParams
    from detent.engine.train_model import TrainerModel
    from detent.selection.dispatch import Dispatcher
    llm = _engine()
    eng = llm.llm_engine
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 1000, (int(n),), generator=g).tolist() for n in torch.randint(5, 200, (10,), generator=g)]

    def matches():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            [SamplingParams(temperature=1.0, seed=i, max_tokens=24, logprobs=0, ignore_eos=True)
                             for i in range(len(prompts))], use_tqdm=False)
        comp = [list(o.outputs[0].token_ids) for o in outs]
        want = [torch.tensor([pos[t].logprob for t, pos in zip(c, o.outputs[0].logprobs)])
                for c, o in zip(comp, outs)]
        got = TrainerModel(llm, checkpoint_layers=True, logprob_chunk=64)([p + c for p, c in zip(prompts, comp)],
                                                                          [len(p) for p in prompts])
        return [torch.equal(lp.detach().cpu(), w) for lp, w in zip(got, want)]

    set_mode(llm, "pinned+attention.impl=fa4", graphs=False)
    fa4_d = eng.dispatcher
    assert all(matches())
    set_mode(llm, "pinned", graphs=False)  # FA4 with prefill (and the trainer), Triton for decode-only steps
    eng.dispatcher = eng.runner.dispatcher = Dispatcher(PerStepSplit(fa4_d, eng.dispatcher))
    assert not all(matches())


def test_decoded_logprobs_equal_prompt_logprobs_under_the_fa4_tuple():
    """A decoded token's logprob (FA4 decode rows, one query each) equals the prompt
    logprob of its position when prompt + output is prefilled (FA4 prefill rows)."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
    from gpu_engine import set_mode

    from detent.engine import SamplingParams
    from detent.selection.dispatch import Dispatcher
    llm = _engine()
    eng = llm.llm_engine
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in (7, 130, 300)]

    def same():
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=20, logprobs=1, ignore_eos=True), use_tqdm=False)
        full = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
        again = llm.generate([{"prompt_token_ids": f} for f in full],
                             SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1, ignore_eos=True),
                             use_tqdm=False)
        ok = []
        for p, o, a in zip(prompts, outs, again):
            c = o.outputs[0]
            decoded = [pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs)]
            ok.append(decoded == [a.prompt_logprobs[len(p) + i][t].logprob for i, t in enumerate(c.token_ids)])
        return ok

    set_mode(llm, "pinned+attention.impl=fa4", graphs=False)
    fa4_d = eng.dispatcher
    assert all(same())
    set_mode(llm, "pinned", graphs=False)  # FA4 with prefill, Triton for decode-only steps: the bits move
    eng.dispatcher = eng.runner.dispatcher = Dispatcher(PerStepSplit(fa4_d, eng.dispatcher))
    assert not all(same())
