"""Warm start (engine/warmup.py): the synthetic steps reach every selection a
real workload reaches, and every selection SelIR finds reachable on the GPU
deployments.

Comparator: sets of (family, site, selection, num_tokens % 16 == 0) with
`<=` / `==`; runtime dicts with `==`."""
from __future__ import annotations

import pytest

from engine_helpers import bundle, make_llm, prompt
from detent.engine import SamplingParams
from detent.engine.warmup import Limits, StepShape, plan_warmup, probe_variants, shape_for, warm_up
from detent.selection import make_dispatcher, programs
from detent.selection.compiler.reach import reachable, selection_key
from detent.selection.compiler.solver import solve

LIM = Limits(max_num_batched_tokens=512, max_num_seqs=64, max_model_len=256)


def _reached(dispatcher) -> set:
    """(family, site, selection, num_tokens % 16 == 0) of every call recorded."""
    out = set()
    for family, site, rt in dispatcher.calls:
        rt = dict(rt)
        sel = dispatcher._selectors[(family, site)](**rt)
        out.add((family, site, selection_key(sel), rt["num_tokens"] % 16 == 0))
    return out


@pytest.mark.parametrize("name,selection", [("llama", "pinned"), ("llama", "stock"),
                                            ("qwen3_moe", "pinned"), ("qwen3_moe", "stock")])
def test_warm_steps_cover_a_workload(name, selection):
    llm = make_llm(bundle(name), selection)
    eng = llm.llm_engine
    d = eng.runner.dispatcher
    d.record_calls = True
    warm_up(eng.runner, eng.facts, LIM, progress=False)
    warmed = _reached(d)
    d.calls.clear()
    # a workload that varies everything a selector reads: prompt lengths, batch
    # sizes, chunked prefill (the budget splits long prompts), decode-only steps
    vocab = eng.model_config.vocab_size
    prompts = [{"prompt_token_ids": prompt(i, n, vocab)}
               for i, n in enumerate([3, 17, 40, 96, 150, 200, 7, 33, 64, 128, 5, 230])]
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=6, logprobs=2), use_tqdm=False)
    llm.generate(prompts[:5], SamplingParams(temperature=1.0, seed=7, max_tokens=4), use_tqdm=False)
    llm.generate([prompts[0], {"prompt_token_ids": prompt(99, 250, vocab)}],
                 SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=1), use_tqdm=False)
    seen = _reached(d)
    d.record_calls = False
    assert seen, "the workload dispatched nothing"
    missing = seen - warmed
    assert not missing, f"selections a request met that warm start did not run: {sorted(missing, key=repr)[:5]}"


def test_stock_workload_reaches_several_selections():
    """The comparison above is not vacuous: without the warm steps the stock
    workload meets selections nothing ran before (a set that is not empty)."""
    llm = make_llm(bundle("qwen3_moe"), "stock")
    d = llm.llm_engine.runner.dispatcher
    d.record_calls = True
    vocab = llm.llm_engine.model_config.vocab_size
    llm.generate([{"prompt_token_ids": prompt(i, n, vocab)} for i, n in enumerate([3, 40, 150, 230])],
                 SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    per_site: dict = {}
    for fam, site, sel, _ in _reached(d):
        per_site.setdefault((fam, site), set()).add(sel)
    assert max(len(v) for v in per_site.values()) > 1


@pytest.mark.parametrize("point", [
    {"num_tokens": 100},
    {"num_tokens": 512},
    {"num_seqs": 5, "max_seqlen_q": 9, "max_seqlen_k": 200},
    {"num_seqs": 7, "max_seqlen_q": 1, "max_seqlen_k": 31, "total_kv": 100},
    {"num_tokens": 40, "num_seqs": 4, "max_seqlen_q": 20, "max_seqlen_k": 20, "total_kv": 50},
])
def test_shape_for_reaches_the_point(point):
    s = shape_for(point, LIM)
    assert s is not None
    rt = s.runtime()
    assert {k: rt[k] for k in point} == point
    assert all(1 <= q <= k for q, k in zip(s.query_lens, s.kv_lens))


@pytest.mark.parametrize("point", [
    {"num_tokens": 0},
    {"num_tokens": 513},
    {"num_seqs": 65, "max_seqlen_q": 1, "max_seqlen_k": 1},
    {"num_seqs": 2, "max_seqlen_q": 3, "max_seqlen_k": 2},  # more queries than KV
    {"num_seqs": 3, "max_seqlen_q": 2, "max_seqlen_k": 2, "total_kv": 100},  # KV total out of reach
])
def test_shape_for_refuses_what_no_step_has(point):
    assert shape_for(point, LIM) is None


def _gpu_sites(preset_name):
    """The call sites of the preset's model on one GPU (as selection/ops.py makes them)."""
    from detent.models.presets import preset
    c = preset(preset_name)["config"]
    h, nh, kvh, hd = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
    bf = ("dtype", "bfloat16")
    qkv = (nh + 2 * kvh) * hd
    sites = [("gemm", (("n", n), ("k", k), bf)) for n, k in [(qkv, h), (h, nh * hd), (c["vocab_size"], h)]]
    if "num_experts" in c:
        sites.append(("moe", (("num_experts", c["num_experts"]), ("top_k", c["num_experts_per_tok"]),
                              ("hidden", h), ("intermediate", c["moe_intermediate_size"]), bf)))
        sites.append(("gemm", (("n", c["num_experts"]), ("k", h), bf)))
    else:
        sites += [("gemm", (("n", 2 * c["intermediate_size"]), ("k", h), bf)),
                  ("gemm", (("n", h), ("k", c["intermediate_size"]), bf))]
    sites.append(("attention", (("num_heads", nh), ("num_kv_heads", kvh), ("head_dim", hd), ("block_size", 16), bf)))
    sites.append(("norm", (("hidden", h), bf, ("fused_residual", True))))
    logits = ("gemm", (("n", c["vocab_size"]), ("k", h), bf))
    return c, sites, logits


def _gpu_deployment(preset_name):
    """The H200 deployment of a preset (limits, facts, a pinned dispatcher with every site's
    selector built): (config, sites, logit site, limits, facts, dispatcher)."""
    from detent.selection.facts import default_facts_for
    c, sites, logits = _gpu_sites(preset_name)
    lim = Limits(8192, 256, 4096)
    facts = default_facts_for(c, device="cuda", dtype="bfloat16", max_context=4096, max_num_batched_tokens=8192,
                              max_num_seqs=256, num_sms=132, arch="sm90", triton=True)
    d = make_dispatcher(facts, "pinned", None)
    for fam, site in sites:
        d._selectors[(fam, site)] = d.provider.selector(fam, dict(site))
    return c, sites, logits, lim, facts, d


@pytest.mark.parametrize("preset_name", ["llama-3.1-8b", "qwen3-30b-a3b"])
def test_gpu_deployment_every_reachable_selection_is_warmed(preset_name):
    """On the H200 deployments (selectors are pure Python, so this runs on CPU):
    every selection SelIR finds reachable, at every site, is reached by a planned
    step (checked here independently of the planner's own bookkeeping)."""
    c, sites, logits, lim, facts, d = _gpu_deployment(preset_name)
    plan = plan_warmup(d, facts, lim, {logits})
    assert plan.uncovered == []
    # a warm start of seconds, not minutes (97 with the GEMM bands, 103 with lease 15's
    # decode-only probes, which are steps of one token per sequence)
    assert len(plan.shapes) <= 110
    for fam, site in sites:
        if (fam, site) == logits:
            continue
        sel = d._selectors[(fam, site)]
        sol = solve(programs.load(fam), {**facts, **dict(site)})
        for key, points in reachable(sol, sel).items():
            classes = {p["num_tokens"] % 16 == 0 for p in points if p.get("num_tokens", 1) >= 1} \
                if "num_tokens" in sol.vra.inputs else {None}
            for cls in classes:
                assert any(selection_key(sel(**s.runtime())) == key and
                           (cls is None or (s.num_tokens % 16 == 0) == cls) for s in plan.shapes), \
                    (fam, dict(site), dict(key), cls)
    # a step with a chunk longer than a 16-row tile runs its decodes in a launch of their
    # own (kernels/attention_triton.py, one configuration): some planned step must have both
    g = c["num_attention_heads"] // c["num_key_value_heads"]
    assert any(1 in s.query_lens and max(s.query_lens) * g > 16 for s in plan.shapes)


def test_warm_start_changes_no_bits():
    """Warm steps write only scratch KV slots the scheduler has not handed out:
    a request after them gets the bits it gets without them (`==`)."""
    b = bundle("llama")
    vocab = b.config.vocab_size
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=8, logprobs=3)
    outs = []
    for warm in (False, True):
        llm = make_llm(b, "pinned", warmup=warm)
        o = llm.generate([{"prompt_token_ids": prompt(5, 60, vocab)}], params, use_tqdm=False)[0].outputs[0]
        outs.append((o.token_ids, [sorted(lp.items()) for lp in o.logprobs]))
    assert outs[0] == outs[1]


def test_step_shape_runtime():
    s = StepShape((5, 1, 1), (40, 9, 3))
    assert s.runtime() == {"num_tokens": 7, "num_seqs": 3, "max_seqlen_q": 5, "max_seqlen_k": 40, "total_kv": 52}


def _served_steps(n: int, lim: Limits, seed: int = 0):
    """Steps a loaded server makes (not the probes' grid): prompt chunks of 2..2,048 tokens,
    0..255 decodes, KV lengths anywhere up to the model's limit; and one step in ten
    decode-only (what an eager engine launches itself; graphs replay them otherwise)."""
    import random
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        if rng.random() < 0.1:
            d = rng.choice([1, 3, 16, 40, 64, 100, 200, 255, 256, 300, 511, 700])
            if d <= min(lim.max_num_seqs, lim.max_num_batched_tokens):
                out.append(StepShape((1,) * d, tuple(rng.choice([rng.randint(2, 256), rng.randint(2, lim.max_model_len)])
                                                     for _ in range(d))))
            continue
        d = rng.choice([0, 0, 1, 3, 16, 40, 64, 100, 200, 255])
        q = [rng.choice([rng.randint(2, 4), rng.randint(5, 16), rng.randint(17, 127), rng.randint(128, 1024),
                         rng.randint(1025, 2048)]) for _ in range(rng.choice([1, 1, 2, 3]))]
        if sum(q) + d > lim.max_num_batched_tokens or len(q) + d > lim.max_num_seqs:
            continue
        k = [min(lim.max_model_len, x + rng.choice([0, 0, rng.randint(0, 3000)])) for x in q]
        out.append(StepShape(tuple(q) + (1,) * d, tuple(k) + tuple(rng.randint(2, lim.max_model_len)
                                                                     for _ in range(d))))
    return out


@pytest.mark.parametrize("preset_name", ["llama-3.1-8b", "qwen3-30b-a3b"])
@pytest.mark.parametrize("probes", [True, False])
def test_warm_steps_reach_every_attention_compile_a_served_step_needs(preset_name, probes, monkeypatch):
    """Lease 6: five attention compiles while serving, after a warm start that reached every
    selection. A selection leaves the Triton attention's launches (decode, short, split
    combine) to the step: each combination any of 5,000 served steps needs must be among the
    planned steps'. Without the probe steps some are not (the control: this test can fail)."""
    pytest.importorskip("detent.kernels.attention_triton")
    from detent.kernels.attention_triton import step_variants
    c, sites, logits, lim, facts, d = _gpu_deployment(preset_name)
    if not probes:
        monkeypatch.setattr("detent.engine.warmup.probe_variants", lambda *a, **k: [])
    plan = plan_warmup(d, facts, lim, {logits})
    (att, site), = [(f, s) for f, s in sites if f == "attention"]
    sel, heads = d._selectors[(att, site)], dict(site)

    def variants(s):
        return step_variants(sel(**s.runtime()), query_lens=s.query_lens, kv_lens=s.kv_lens, num_sms=132,
                             num_heads=heads["num_heads"], num_kv_heads=heads["num_kv_heads"])
    covered = set().union(*(variants(s) for s in plan.shapes))
    missing = {v for s in _served_steps(5000, lim) for v in variants(s)} - covered
    if probes:
        assert missing == set()
    else:
        assert missing  # what lease 6 met


@pytest.mark.parametrize("probes", [True, False])
def test_warm_steps_reach_every_moe_alignment_an_eager_step_needs(probes, monkeypatch):
    """Lease 31: the tune's profile ran Qwen3-30B-A3B steps of more than 512 tokens eagerly and
    compiled the fused MoE's counted alignment, which no warm step had reached (its selection is
    one tile for every step). Each alignment launch any of 5,000 served steps needs must be
    among the planned steps'; without the probe steps the counted one is not (the control)."""
    pytest.importorskip("detent.kernels.moe_triton")
    from detent.kernels.moe_triton import step_variants
    c, sites, logits, lim, facts, d = _gpu_deployment("qwen3-30b-a3b")
    if not probes:
        monkeypatch.setattr("detent.engine.warmup.probe_variants", lambda *a, **k: [])
    plan = plan_warmup(d, facts, lim, {logits})
    (site,) = [s for f, s in sites if f == "moe"]
    sel = d._selectors[("moe", site)]

    def variants(s):
        return step_variants(sel(**s.runtime()), query_lens=s.query_lens, **dict(site))
    covered = set().union(*(variants(s) for s in plan.shapes))
    needed = {v for s in _served_steps(5000, lim) for v in variants(s)}
    assert any(dict(v[1:])["COUNTED"] for v in needed)  # served steps of more than 512 tokens
    if probes:
        assert needed - covered == set()
        assert len(plan.shapes) <= 110
    else:
        assert needed - covered  # what lease 31's tune met


def test_the_h200_deployments_attention_may_go_inside_whole_step_graphs():
    # engine/mixed_graph.refusal on the real pinned selector (pure Python: runs on CPU)
    from detent.engine.mixed_graph import refusal
    _, sites, _, _, _, d = _gpu_deployment("llama-3.1-8b")
    (site,) = [s for f, s in sites if f == "attention"]
    assert refusal(d._selectors[("attention", site)]) is None
