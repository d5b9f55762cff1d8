"""Tensor parallelism end to end on CPU (gloo): `LLM(..., tensor_parallel_size=N)`.

- tp = 2 and 4 agree with tp = 1 within fp32 tolerance (different sums,
  so not bitwise);
- at fixed tp, pinned selection gives a request the same token ids,
  logprobs and top-k logprobs in every battery cell (alone, batched with
  others, arriving while others decode, prefix-cache hit), compared with
  `==`; stock selection fails at least one cell;
- a dead rank makes the engine raise within seconds; shutdown, garbage
  collection and a killed driver leave no rank process behind;
- models that do not shard over N are refused before anything is spawned.

The tiny model (4 query heads, 2 KV heads) exercises KV-head sharding at
tp = 2 and KV-head replication at tp = 4. Weights are dummy (seeded per
checkpoint tensor, then sharded), so every tp holds the same full weights.
"""
from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from detent.engine import LLM, SamplingParams
from detent.engine.tp import TPConfigError, TPWorkerError

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "max_position_embeddings": 256, "tie_word_embeddings": False, "eos_token_id": 1,
        "torch_dtype": "float32"}

TARGET = [(7 * i + 3) % 250 + 2 for i in range(40)]  # 2 full blocks + 8 tokens
OTHERS = [[(11 * i + k) % 250 + 2 for i in range(n)] for k, n in ((1, 23), (2, 57), (3, 9))]
TARGET_SP = SamplingParams(temperature=0, max_tokens=6, logprobs=3, prompt_logprobs=2, ignore_eos=True)
OTHER_SP = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)


def _write_model(root, name: str, **changes) -> str:
    d = root / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**TINY, **changes}))
    return str(d)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return _write_model(tmp_path_factory.mktemp("tp"), "tiny")


def make_llm(path: str, tp: int, selection: str = "pinned", **kw) -> LLM:
    kw = {"max_model_len": 128, "kv_cache_memory_bytes": 1 << 22, **kw}
    return LLM(model=path, tensor_parallel_size=tp, selection=selection, load_format="dummy", device="cpu",
               seed=0, **kw)


# tp = 2 engines chunk every prefill at 32 tokens (the target's 40 split differently
# by its neighbours); the tp = 4 engine has 6 usable KV blocks, so in its
# extra cell three neighbours growing to 45 tokens preempt
CHUNKED = {"max_num_batched_tokens": 32}
PREEMPTING = {"max_model_len": 64, "num_gpu_blocks": 7, "kv_cache_memory_bytes": None}


def _lps(positions) -> list:
    if positions is None:
        return None
    return [None if p is None else sorted((t, lp.logprob, lp.rank) for t, lp in p.items()) for p in positions]


def _result(out) -> tuple:
    c = out.outputs[0]
    return (list(c.token_ids), _lps(c.logprobs), _lps(out.prompt_logprobs))


def _prompt(ids):
    return {"prompt_token_ids": ids}


def run_cells(llm: LLM, preempt: bool = False) -> dict[str, tuple]:
    """The target request's result in each battery cell (`preempt`: also a
    cell whose neighbours outgrow a small KV pool, for an engine built so)."""
    cells = {}
    llm.reset_prefix_cache()
    cells["alone"] = _result(llm.generate([_prompt(TARGET)], TARGET_SP, use_tqdm=False)[0])
    # the target's first two blocks are now cached: its prefill starts at token 32
    cells["prefix_hit"] = _result(llm.generate([_prompt(TARGET)], TARGET_SP, use_tqdm=False)[0])
    llm.reset_prefix_cache()
    outs = llm.generate([_prompt(OTHERS[0]), _prompt(TARGET), _prompt(OTHERS[1]), _prompt(OTHERS[2])],
                        [OTHER_SP, TARGET_SP, OTHER_SP, OTHER_SP], use_tqdm=False)
    cells["batched"] = _result(outs[1])
    llm.reset_prefix_cache()
    eng = llm.llm_engine
    for i, p in enumerate(OTHERS):  # others prefill and start decoding, then the target arrives
        eng.add_request(f"o{i}", p, OTHER_SP)
    eng.step()
    eng.step()
    eng.add_request("t", TARGET, TARGET_SP)
    done = {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    cells["staggered"] = _result(done["t"])
    if preempt:
        llm.reset_prefix_cache()
        before = eng.stats()["num_preemptions"]
        grow = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        outs = llm.generate([_prompt(p[:5]) for p in OTHERS] + [_prompt(TARGET)], [grow] * 3 + [TARGET_SP],
                            use_tqdm=False)
        cells["preempted"] = _result(outs[3])
        cells["preemptions"] = eng.stats()["num_preemptions"] - before
    return cells


def _shutdown(llm: LLM) -> list[int]:
    ex = llm.llm_engine.runner
    pids = ex.pids
    ex.shutdown()
    return pids


def _wait_gone(pids: list[int], timeout: float = 10.0) -> list[int]:
    deadline = time.monotonic() + timeout
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if _alive(p)]
        time.sleep(0.1)
    return alive


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped) is gone for our purposes
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return False


# ---------------------------------------------------------------- engines (one per tp, mode)
@pytest.fixture(scope="module")
def tp1(tiny_dir):
    from detent.models import ModelConfig, load_model
    mc = ModelConfig.from_hf(tiny_dir)
    model = load_model(mc, device="cpu", dtype="auto", load_format="dummy", seed=0)  # the same full weights
    return run_cells(LLM.from_model(model, mc, device="cpu", max_model_len=128, kv_cache_memory_bytes=1 << 22,
                                    seed=0))


@pytest.fixture(scope="module")
def tp2_pinned(tiny_dir):
    llm = make_llm(tiny_dir, 2, **CHUNKED)
    cells = run_cells(llm)
    pids = llm.llm_engine.runner.pids
    del llm
    gc.collect()
    return cells, pids


def _rank_layout(st) -> tuple:
    attn = st.runner.model.model.layers[0].self_attn.qkv_proj
    kv = st.runner.kv_caches[0]
    return st.info.rank, attn.num_heads, attn.num_kv_heads, tuple(kv.shape)


def _sabotage(st, rank: int) -> None:
    """On `rank` only: report a shifted token (after computing the step normally,
    so the collectives still line up)."""
    if st.info.rank != rank:
        return
    from dataclasses import replace

    from detent.scheduler.outputs import ModelOutput
    collect = st.runner.collect  # where every step's ModelOutput comes from (execute and launch/collect)

    def shifted(handle):
        out = collect(handle)
        return ModelOutput({k: replace(v, token_id=v.token_id + 1) for k, v in out.sampled.items()},
                           out.prompt_logprobs)
    st.runner.collect = shifted


@pytest.fixture(scope="module")
def tp4_pinned(tiny_dir):
    llm = make_llm(tiny_dir, 4, **PREEMPTING)
    cells = run_cells(llm, preempt=True)
    ex = llm.llm_engine.runner
    cells["layout"] = ex.collective_rpc(_rank_layout)
    ex.collective_rpc(_sabotage, 3)
    try:
        llm.generate([_prompt(TARGET)], TARGET_SP, use_tqdm=False)
        cells["disagreement"] = None
    except TPWorkerError as e:
        cells["disagreement"] = str(e)
    return cells, _shutdown(llm)


@pytest.fixture(scope="module")
def tp2_stock(tiny_dir):
    llm = make_llm(tiny_dir, 2, "stock", **CHUNKED)
    yield llm, run_cells(llm)
    llm.llm_engine.runner.shutdown()


# ---------------------------------------------------------------- tests
MOE = {**TINY, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 4,
       "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True, "decoder_sparse_step": 1,
       "mlp_only_layers": []}


def test_qwen3_moe_tp2_matches_tp1(tmp_path):
    """Qwen3-MoE (q/k norm; experts split by their intermediate dim, summed by
    the all-reduce) at tp = 2 against tp = 1 on the same full weights."""
    from detent.models import ModelConfig, load_model
    path = _write_model(tmp_path, "moe", **MOE)
    mc = ModelConfig.from_hf(path)
    ref_llm = LLM.from_model(load_model(mc, device="cpu", load_format="dummy", seed=0), mc, device="cpu",
                             max_model_len=128, kv_cache_memory_bytes=1 << 22, seed=0)
    ref = _result(ref_llm.generate([_prompt(TARGET)], TARGET_SP, use_tqdm=False)[0])
    llm = make_llm(path, 2)
    try:
        got = _result(llm.generate([_prompt(TARGET)], TARGET_SP, use_tqdm=False)[0])
    finally:
        pids = _shutdown(llm)
    assert _wait_gone(pids) == []  # explicit shutdown
    assert got[0] == ref[0]
    for ref_pos, got_pos in zip(ref[1] + ref[2][1:], got[1] + got[2][1:]):
        assert [t for t, _, _ in got_pos] == [t for t, _, _ in ref_pos]
        assert all(abs(a - b) < 1e-4 for (_, a, _), (_, b, _) in zip(ref_pos, got_pos))


def test_refuses_models_that_do_not_shard(tmp_path):
    cases = [({"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 16}, 4, "attention heads"),
             ({"num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16}, 2, "num_kv_heads=3"),
             ({"num_attention_heads": 12, "num_key_value_heads": 3, "head_dim": 16}, 4, "not a multiple"),
             ({"vocab_size": 250}, 4, "vocab_size=250"),
             ({"intermediate_size": 130}, 4, "intermediate_size=130")]
    for i, (changes, tp, needle) in enumerate(cases):
        path = _write_model(tmp_path, f"m{i}", **changes)
        t0 = time.monotonic()
        with pytest.raises(TPConfigError, match=needle) as e:
            make_llm(path, tp)
        assert f"tensor_parallel_size={tp}" in str(e.value)
        assert time.monotonic() - t0 < 5, "refused before spawning any rank"


@pytest.mark.parametrize("fx", ["tp2_pinned", "tp4_pinned"])
def test_tp_matches_tp1_within_fp32_tolerance(request, tp1, fx):
    cells, _ = request.getfixturevalue(fx)
    ref, got = tp1["alone"], cells["alone"]
    assert got[0] == ref[0], "greedy tokens"
    for ref_pos, got_pos in zip(ref[1] + ref[2][1:], got[1] + got[2][1:]):
        assert [t for t, _, _ in got_pos] == [t for t, _, _ in ref_pos]
        for (_, a, _), (_, b, _) in zip(ref_pos, got_pos):
            assert abs(a - b) < 1e-4


@pytest.mark.parametrize("fx", ["tp2_pinned", "tp4_pinned"])
def test_tp_pinned_battery_is_bitwise(request, fx):
    cells, _ = request.getfixturevalue(fx)
    for name, res in cells.items():
        if name not in ("layout", "disagreement", "preemptions"):
            assert res == cells["alone"], f"{fx}: cell {name!r} differs from 'alone'"


def test_tp4_battery_exercised_preemption(tp4_pinned):
    cells, _ = tp4_pinned
    assert cells["preemptions"] >= 1


def test_tp4_replicates_kv_heads(tp4_pinned):
    """4 query heads and 2 KV heads over 4 ranks: one query head per rank and
    a replica of its KV head; each rank's KV cache holds one head."""
    cells, _ = tp4_pinned
    assert [r[:3] for r in cells["layout"]] == [(r, 1, 1) for r in range(4)]
    assert {r[3][3] for r in cells["layout"]} == {1}  # [2, blocks, block_size, KVH, D]


def test_ranks_that_disagree_fail_the_step(tp4_pinned):
    """Every rank's output is checked against rank 0's (a digest per step)."""
    cells, _ = tp4_pinned
    assert cells["disagreement"] is not None and "ranks [3] computed a different step output" in cells["disagreement"]


def test_tp_stock_fails_a_cell(tp2_stock):
    _, cells = tp2_stock
    differ = [n for n, r in cells.items() if r != cells["alone"]]
    assert differ, "stock selection passed every cell: the cells cannot fail"


def test_shutdown_and_gc_leave_no_rank_process(tp2_pinned, tp4_pinned):
    for _, pids in (tp2_pinned, tp4_pinned):
        assert _wait_gone(pids) == []


def test_dead_rank_raises_within_seconds(tp2_stock):
    llm, _ = tp2_stock
    ex = llm.llm_engine.runner
    pids = ex.pids
    os.kill(pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(TPWorkerError, match=r"rank 1 .*(died|not running).*signal 9"):
        llm.generate([_prompt(TARGET)], TARGET_SP, use_tqdm=False)
    assert time.monotonic() - t0 < 10
    assert _wait_gone(pids) == []
    with pytest.raises(TPWorkerError, match="gone"):  # and it stays failed, with the reason
        llm.generate([_prompt(TARGET)], TARGET_SP, use_tqdm=False)


def test_killed_driver_leaves_no_orphans(tiny_dir, tmp_path):
    script = textwrap.dedent(f"""
        import sys, time
        from detent.engine import LLM
        if __name__ == "__main__":
            llm = LLM(model={tiny_dir!r}, tensor_parallel_size=2, load_format="dummy", device="cpu",
                      max_model_len=128, kv_cache_memory_bytes=1 << 22)
            print(*llm.llm_engine.runner.pids, flush=True)
            time.sleep(120)
    """)
    path = tmp_path / "driver.py"
    path.write_text(script)
    drv = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        line = drv.stdout.readline()
        pids = [int(x) for x in line.split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        drv.kill()
        drv.wait(timeout=10)
        assert _wait_gone(pids, timeout=10) == []
    finally:
        if drv.poll() is None:
            drv.kill()


def test_plan_sent_to_ranks_carries_the_grammar_bitmask_not_the_matcher():
    """The xgrammar matcher stays with the scheduler; ranks get this step's mask."""
    import pickle
    import threading

    import torch

    from detent.engine.tp.plan import KeptParams, PlanSender
    from detent.sampling.sampler import SamplingRow
    from detent.scheduler.outputs import ScheduledSeq, SchedulerOutput

    class Matcher:  # unpicklable, like a live matcher
        lock = threading.Lock()

        def bitmask(self):
            return torch.tensor([5, -1], dtype=torch.int32)

    sp = SamplingParams(temperature=0)
    plan = SchedulerOutput((ScheduledSeq("a", (1, 2), 0, (1,), SamplingRow(sp, 0, 2, grammar=Matcher())),
                            ScheduledSeq("b", (3,), 0, (2,), SamplingRow(sp, 0, 1)),
                            ScheduledSeq("c", (4,), 0, (3,), None)), 4)
    with pytest.raises((TypeError, AttributeError, pickle.PicklingError)):
        pickle.dumps(plan)
    kind, sent, params, drop = pickle.loads(pickle.dumps(PlanSender().message("launch", plan)))
    sent = KeptParams().plan(sent, params, drop)
    assert torch.equal(sent.seqs[0].sample.grammar.bitmask(), torch.tensor([5, -1], dtype=torch.int32))
    assert sent.seqs[1] == plan.seqs[1] and sent.seqs[2] == plan.seqs[2]
    assert PlanSender().message("execute", SchedulerOutput(plan.seqs[1:], 2))[1] == SchedulerOutput(plan.seqs[1:], 2)


def test_tp2_async_scheduling_gives_the_same_outputs(tiny_dir, count_placeholders):
    """Async scheduling over the ranks: the driver sends plan N+1 before it
    reads step N's tokens, and each rank fills N+1's PLACEHOLDER inputs from
    its own step N (every rank samples the same tokens). Comparator: token ids
    and logprob dicts with `==`, against the same tp = 2 engine without overlap."""
    prompts = [_prompt(TARGET)] + [_prompt(p) for p in OTHERS]
    params = [SamplingParams(temperature=0, max_tokens=9, logprobs=3, ignore_eos=True),
              SamplingParams(temperature=0.8, seed=5, max_tokens=7, logprobs=2, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[7], ignore_eos=True)]
    results, holes = {}, []
    for overlap in (False, True):
        llm = make_llm(tiny_dir, 2, async_scheduling=overlap, **CHUNKED)
        eng = llm.llm_engine
        try:
            assert eng.async_scheduling is overlap
            if overlap:
                holes = count_placeholders(eng)
            results[overlap] = [_result(o) for o in llm.generate(prompts, params, use_tqdm=False)]
            results[overlap] += [_result(o) for o in llm.generate(prompts[::-1], params[::-1], use_tqdm=False)]
        finally:
            _shutdown(llm)
    assert results[True] == results[False]
    assert sum(holes) >= 10, holes  # the overlap happened


def _kept_params(st) -> list[str]:
    return sorted(st.params.kept)


def test_a_requests_sampling_parameters_reach_the_ranks_once(tiny_dir):
    """50k bad words (and a logit_bias) pickled into every step's plan made every step's
    message 0.4 MB; the prompt and output travelled whole at every step too. They reach the ranks with the request's first plan: later messages are
    as small as a plain request's, and a finished request's parameters leave the ranks with
    the next plan. Comparator: the request's tokens and logprobs with `==` against the same
    tp = 2 engine sending them in every plan (the old way), and alone against among
    neighbours; tokens `==` and logprobs within fp32 tolerance against tp = 1."""
    import pickle
    import random

    from detent.models import ModelConfig, load_model
    rng = random.Random(0)
    words = [[t] for t in range(100, 110)] + [[rng.randrange(2, 256), rng.randrange(2, 256)] for _ in range(50_000)]
    hostile = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True, bad_words_token_ids=words,
                             logit_bias={t: 4.0 for t in range(100, 140)})
    plain = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)
    # the penalties read the prompt and the output, which the ranks rebuild from the prompt sent once
    # and the output's new tokens (engine/tp/plan.py)
    penalised = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True, repetition_penalty=3.0,
                               frequency_penalty=2.0)
    llm = make_llm(tiny_dir, 2)
    ex = llm.llm_engine.runner
    sizes, send = {}, ex._send_all

    def recorded(msg, what):
        if msg[0] in ("execute", "launch"):
            sizes[name].append(len(pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)))
        send(msg, what)
    ex._send_all = recorded
    try:
        got = {}
        for name, prompts, params in (("hostile", [TARGET], [hostile]), ("plain", [TARGET], [plain]),
                                      ("among", [OTHERS[0], TARGET, OTHERS[1]], [OTHER_SP, hostile, OTHER_SP]),
                                      ("last", [OTHERS[2]], [OTHER_SP]), ("penalised", [TARGET], [penalised])):
            sizes[name] = []
            outs = llm.generate([_prompt(p) for p in prompts], params, use_tqdm=False)
            got[name] = _result(outs[params.index(hostile) if hostile in params else 0])
        kept = ex.collective_rpc(_kept_params)  # "among"'s three dropped with "last"'s first plan
        ex._plans.message = lambda kind, plan: (kind, plan, {}, ())  # every row's parameters in every plan
        name = "every"
        sizes[name] = []
        every = _result(llm.generate([_prompt(TARGET)], hostile, use_tqdm=False)[0])
        name = "every-penalised"
        sizes[name] = []
        every_penalised = _result(llm.generate([_prompt(TARGET)], penalised, use_tqdm=False)[0])
    finally:
        _shutdown(llm)
    mc = ModelConfig.from_hf(tiny_dir)
    tp1 = LLM.from_model(load_model(mc, device="cpu", dtype="auto", load_format="dummy", seed=0), mc, device="cpu",
                         max_model_len=128, kv_cache_memory_bytes=1 << 22, seed=0)
    ref = _result(tp1.generate([_prompt(TARGET)], hostile, use_tqdm=False)[0])
    assert sizes["hostile"][0] > 400_000 and sizes["every"][-1] > 400_000
    assert len(sizes["hostile"]) == len(sizes["plain"]) >= 6
    assert all(h <= p + 64 for h, p in zip(sizes["hostile"][1:], sizes["plain"][1:])), sizes
    assert every == got["hostile"] == got["among"]
    assert every_penalised == got["penalised"] and got["penalised"][0] != got["plain"][0]
    assert not set(got["hostile"][0]) & set(range(100, 110)) and got["hostile"][0] != got["plain"][0]
    assert got["hostile"][0] == ref[0]
    for ref_pos, got_pos in zip(ref[1], got["hostile"][1]):
        assert [t for t, _, _ in got_pos] == [t for t, _, _ in ref_pos]
        assert all(abs(a - b) < 1e-4 for (_, a, _), (_, b, _) in zip(ref_pos, got_pos))
    assert len(kept) == 2 and kept[0] == kept[1] and len(kept[0]) == 1
