"""benchmarks/step_trace.py on CPU with a tiny random Llama: every step the
engine launches is recorded once, and the records account for the whole
workload — prompt tokens plus one decode row per generated token after the
first — so the split into prefill, mixed and decode steps is a partition."""
from __future__ import annotations

import os
import sys

import torch

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.insert(0, BENCH)


def test_steps_account_for_every_token():
    import common_side as cs
    import step_trace as st
    from compare_vllm import TINY
    from detent_side import DetentSide
    from gpu_engine import build, set_mode

    ctx, new, batches = 40, 6, [2, 5]
    llm, mc, _ = build("tiny", hf_config=TINY, device="cpu", dtype=torch.float32, max_model_len=128,
                       max_num_seqs=5, max_num_batched_tokens=64, enable_prefix_caching=True)
    side, rec = DetentSide(llm), st.StepRecorder(llm.llm_engine.runner)
    set_mode(llm, "pinned", graphs=False)
    r = st.trace(side, rec, batches, ctx, new, cs.prompt_hi(mc.vocab_size), 1, log=lambda s: None)["5"]
    assert r["tpot_ms"] == (r[f"t_{new + 1}_tokens_s"] - r["t_1_token_s"]) / new * 1e3  # measure_decode's own
    one, many = r["call_1"], r[f"call_{new + 1}"]
    # fresh prompts (drawn for both batch sizes at once): nothing comes from the prefix cache
    assert sum(k["tokens"] for k in one["kinds"].values()) == 5 * ctx
    assert sum(k["tokens"] for k in many["kinds"].values()) == 5 * ctx + 5 * new
    assert sum(k["steps"] for k in many["kinds"].values()) == many["steps"] == len(r[f"steps_{new + 1}"])
    # a 64-token budget cannot hold 200 prompt tokens: decodes overlap the later prompts' chunks
    assert "mixed" in many["kinds"] and "decode b=5" in many["kinds"]
    assert abs(sum(k["device_ms"] for k in many["kinds"].values()) - many["device_ms"]) < 1e-6
    assert st.report("t", r, new).count("steps") >= 3


def test_set_mode_adds_a_parameter_to_one_family():
    # the benchmarks' MODE+FAMILY:PARAM=VALUE (e.g. "pinned+moe:fuse_glue=1"): that family's
    # selection gains the parameter, every other family is selected as deployed
    from compare_vllm import TINY
    from gpu_engine import build, set_mode

    llm, _, _ = build("tiny", hf_config=TINY, device="cpu", dtype=torch.float32, max_model_len=64,
                      max_num_seqs=2, max_num_batched_tokens=64)
    plain = set_mode(llm, "pinned", graphs=False)
    site, rt = (("n", 64), ("k", 64), ("dtype", "float32")), {"num_tokens": 3}
    want = llm.llm_engine.dispatcher.select("gemm", site, rt)
    info = set_mode(llm, "pinned+gemm:chunk=8", graphs=False)
    assert plain["overrides"] == {} and info["overrides"] == {"gemm": {"chunk": 8}}
    d = llm.llm_engine.dispatcher
    assert d is llm.llm_engine.runner.dispatcher
    assert d.select("gemm", site, rt) == {**want, "chunk": 8}
    norm = (("hidden", 64), ("dtype", "float32"), ("fused_residual", False))
    assert d.select("norm", norm, rt) == {"impl": "torch_rowwise"}


def test_serving_graphs_are_the_engines_own(monkeypatch):
    # `--detent-graphs serving`: the engine built eager (gpu_engine.build) installs the graphs
    # detent-serve runs (engine/graphs.py), through a config that asks for them; its own stays eager
    import detent.engine.graphs as graphs
    from compare_vllm import TINY, build_specs, parse_args
    from gpu_engine import build, set_mode

    llm, _, _ = build("tiny", hf_config=TINY, device="cpu", dtype=torch.float32, max_model_len=64,
                      max_num_seqs=2, max_num_batched_tokens=64)
    seen = []
    monkeypatch.setattr(graphs, "enable_graphs",
                        lambda runner, config, max_model_len: seen.append((runner, config.enforce_eager, max_model_len)))
    eng = llm.llm_engine
    info = set_mode(llm, "pinned", graphs="serving")
    assert seen == [(eng.runner, False, eng.state.max_model_len)] and eng.config.enforce_eager
    assert "graph_capture_s" in info and "cuda_graphs" not in info
    for flag, want in (([], "decode"), (["--detent-graphs", "serving"], "serving")):  # compare_vllm's spec
        specs = build_specs(parse_args(["--engine", "detent", "--tiny", "--parts", "decode", "--decode-ctx", "16",
                                          "--decode-tokens", "4", "--prefill-lens", "32", "--cell-lens", "40",
                                          "--cell-long-lens", "20,16", *flag]))
        assert specs and {s["graphs"] for s in specs} == {want}


def test_set_mode_sets_a_tuple_knob():
    # MODE+FAMILY.KNOB=VALUE runs the default tuple with that knob (on CUDA "pinned+attention.impl=fa4")
    import pytest
    from compare_vllm import TINY
    from gpu_engine import build, set_mode

    from detent.selection import TupleError
    llm, _, _ = build("tiny", hf_config=TINY, device="cpu", dtype=torch.float32, max_model_len=64,
                      max_num_seqs=2, max_num_batched_tokens=64)
    info = set_mode(llm, "pinned+attention.split_stride=64", graphs=False)
    assert info["knobs"] == {"attention": {"split_stride": 64}} and "tuple" in info["selection_source"]
    d, f = llm.llm_engine.dispatcher, llm.llm_engine.facts
    site = (("num_heads", f["num_heads"]), ("num_kv_heads", f["num_kv_heads"]), ("head_dim", f["head_dim"]),
            ("block_size", f["page_size"]), ("dtype", f["dtype"]))
    assert d.tuple.families["attention"]["knobs"] == {"split_stride": 64}
    assert d.select("attention", site, dict(num_tokens=1, num_seqs=1, max_seqlen_q=1, max_seqlen_k=40,
                                            total_kv=40))["impl"] == "paged_split"
    with pytest.raises(TupleError, match="unknown pin or knob 'impl'"):  # CPU attention has one implementation
        set_mode(llm, "pinned+attention.impl=fa4", graphs=False)
    with pytest.raises(ValueError, match="apply in mode pinned"):
        set_mode(llm, "stock+attention.split_stride=64", graphs=False)


def test_mode_values_parse_to_the_types_knobs_take():
    # "pinned+attention.overlap_short=false" must reach the tuple as False, not the string "false"
    # (a bool knob's legal values are True / False); numbers as ints, the rest as strings
    from gpu_engine import _value
    assert [_value(v) for v in ("false", "True", "64", "-1", "fa4")] == [False, True, 64, -1, "fa4"]
    assert _value("false") is False and _value("True") is True
