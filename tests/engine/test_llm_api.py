"""The offline API with vLLM's names: LLM.generate, SamplingParams fields of
this issue, RequestOutput/CompletionOutput/Logprob, and LLMEngine's
add/step/abort loop (also driven from a second thread)."""
from __future__ import annotations

import functools
import operator
import re
import threading
import time

import pytest

from detent.engine import LLM, CompletionOutput, Logprob, RequestOutput, SamplingParams
from detent.engine.config import EngineConfig
from detent.engine.llm_engine import LLMEngine
from detent.engine.step_stats import KindCounters
from engine_helpers import bundle, failing_launch, make_llm, prompt, text_llm

G = dict(temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def llm():
    return text_llm()


def free_run(llm, p, n=24):
    return llm.generate([p], SamplingParams(max_tokens=n, **G), use_tqdm=False)[0].outputs[0]


def test_output_types_and_text(llm):
    outs = llm.generate(["Hello world", {"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=5, **G),
                        use_tqdm=False)
    assert [type(o) for o in outs] == [RequestOutput, RequestOutput]
    a, b = outs
    assert a.prompt == "Hello world" and a.prompt_token_ids == llm.get_tokenizer().encode("Hello world")
    assert b.prompt is None and b.prompt_token_ids == [5, 6, 7]
    c = a.outputs[0]
    assert isinstance(c, CompletionOutput) and c.index == 0 and len(c.token_ids) == 5
    assert c.text == llm.get_tokenizer().decode(c.token_ids) and c.finish_reason == "length"
    assert a.finished and c.logprobs is None and c.cumulative_logprob is None
    assert [o.request_id for o in outs] == sorted({o.request_id for o in outs}, key=int)


def test_stop_string_truncates_text(llm):
    full = free_run(llm, "abc")
    stop = full.text[5:7]
    first = full.text.find(stop)
    c = llm.generate(["abc"], SamplingParams(max_tokens=24, stop=[stop, "\u2603"], **G), use_tqdm=False)[0].outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", stop)
    assert c.text == full.text[:first]
    assert c.token_ids == full.token_ids[:first + len(stop)]  # the token that completed the stop string stays
    c2 = llm.generate(["abc"], SamplingParams(max_tokens=24, stop=stop, include_stop_str_in_output=True, **G),
                      use_tqdm=False)[0].outputs[0]
    assert c2.text == full.text[:first + len(stop)]
    # the token that completes the stop string is also the last max_tokens allows: the string wins
    c3 = llm.generate(["abc"], SamplingParams(max_tokens=len(c.token_ids), stop=stop, **G),
                      use_tqdm=False)[0].outputs[0]
    assert (c3.finish_reason, c3.stop_reason, c3.text) == ("stop", stop, c.text)


def test_stop_token_ids_and_eos(llm):
    full = free_run(llm, "xyz")
    tok = full.token_ids[3]
    k = full.token_ids.index(tok)
    c = llm.generate(["xyz"], SamplingParams(max_tokens=24, stop_token_ids=[tok], **G), use_tqdm=False)[0].outputs[0]
    assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", tok, full.token_ids[:k + 1])
    b = bundle("llama")
    eos_llm = make_llm(type(b)("llama", b.model, b.config.replace(eos_token_ids=(tok,)), None))
    ids = {"prompt_token_ids": llm.get_tokenizer().encode("xyz")}
    c = eos_llm.generate([ids], SamplingParams(max_tokens=24, temperature=0), use_tqdm=False)[0].outputs[0]
    assert (c.finish_reason, c.stop_reason, c.token_ids) == ("stop", None, full.token_ids[:k + 1])
    c = eos_llm.generate([ids], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                         use_tqdm=False)[0].outputs[0]
    assert c.token_ids == full.token_ids and c.finish_reason == "length"
    c = eos_llm.generate([ids], SamplingParams(max_tokens=24, temperature=0, min_tokens=k + 2),
                         use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) > k + 1


def test_logprobs_include_chosen_token(llm):
    c = llm.generate(["logprobs"], SamplingParams(max_tokens=6, logprobs=3, **G), use_tqdm=False)[0].outputs[0]
    assert len(c.logprobs) == 6
    for tok, pos in zip(c.token_ids, c.logprobs):
        assert tok in pos and all(isinstance(v, Logprob) for v in pos.values())
        ranks = sorted(v.rank for i, v in pos.items() if i != tok)
        assert pos[tok].rank == 1 and len(pos) == 3  # greedy: the chosen one is the top-1
        assert ranks == [2, 3]
        lps = [v.logprob for v in pos.values()]
        assert lps == sorted(lps, reverse=True)
    # the chosen tokens' logprobs added in order (as vLLM's; Python 3.12's sum() compensates, so not sum())
    assert c.cumulative_logprob == functools.reduce(operator.add, (p[t].logprob for t, p in
                                                                   zip(c.token_ids, c.logprobs)), 0.0)
    c0 = llm.generate(["logprobs"], SamplingParams(max_tokens=2, logprobs=0, **G), use_tqdm=False)[0].outputs[0]
    assert [list(p) for p in c0.logprobs] == [[t] for t in c0.token_ids]


def test_prompt_logprobs(llm):
    p = [7, 8, 9, 10, 11, 12]
    out = llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1, prompt_logprobs=2, **G),
                       use_tqdm=False)[0]
    pl = out.prompt_logprobs
    assert len(pl) == len(p) and pl[0] is None
    for tok, pos in zip(p[1:], pl[1:]):
        assert tok in pos and pos[tok].rank >= 1 and len(pos) in (2, 3)
        top = sorted(v.rank for i, v in pos.items() if v.rank <= 2)
        assert top[:2] == [1, 2] or pos[tok].rank <= 2


def test_n_samples_are_grouped(llm):
    out = llm.generate(["n two"], SamplingParams(n=2, max_tokens=4, **G), use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert out.outputs[0].token_ids == out.outputs[1].token_ids  # greedy


def test_until_max_model_len():
    llm = text_llm(max_model_len=20)
    c = llm.generate([{"prompt_token_ids": list(range(2, 12))}], SamplingParams(max_tokens=None, **G),
                     use_tqdm=False)[0].outputs[0]
    assert (c.finish_reason, len(c.token_ids)) == ("length", 10)


def test_bad_input_errors(llm):
    sp = SamplingParams(max_tokens=2, **G)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([{"prompt_token_ids": [3] * 300}], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        llm.generate([{"prompt_token_ids": []}], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="vocabulary"):
        llm.generate([{"prompt_token_ids": [3, 100_000]}], sp, use_tqdm=False)
    with pytest.raises(ValueError, match="logprobs=3 exceeds max_logprobs=2"):
        text_llm(max_logprobs=2).generate(["x"], SamplingParams(max_tokens=2, logprobs=3, **G), use_tqdm=False)
    # allowed ids the request's own bans cover: no token to sample (the sampler took token 0)
    eos = sorted(llm.llm_engine.eos_token_ids)
    for kw in ({"allowed_token_ids": eos, "min_tokens": 1}, {"allowed_token_ids": [7], "bad_words_token_ids": [[7]]},
               {"allowed_token_ids": [7, *eos], "min_tokens": 3, "stop_token_ids": [7]}):
        with pytest.raises(ValueError, match="no token can be sampled"):
            llm.generate([{"prompt_token_ids": [3, 4]}], SamplingParams(max_tokens=4, **kw, **G), use_tqdm=False)
    # one-token bad words (with min_tokens' bans) over the whole vocabulary: the same, without allowed ids
    V = llm.llm_engine.model_config.vocab_size
    for kw in ({"bad_words_token_ids": [[i] for i in range(V)]},
               {"bad_words_token_ids": [[i] for i in range(V) if i not in eos], "min_tokens": 1},
               {"stop_token_ids": list(range(V)), "min_tokens": 2}):
        with pytest.raises(ValueError, match="every token of the vocabulary .*no token can be sampled"):
            llm.generate([{"prompt_token_ids": [3, 4]}], SamplingParams(max_tokens=4, **kw, **G), use_tqdm=False)
    for kw in ({"allowed_token_ids": eos}, {"allowed_token_ids": [7, *eos], "min_tokens": 1},
               {"allowed_token_ids": [7, 8], "bad_words_token_ids": [[7], [3, 8]]}):
        out = llm.generate([{"prompt_token_ids": [3, 4]}], SamplingParams(max_tokens=4, **kw, **G), use_tqdm=False)
        assert set(out[0].outputs[0].token_ids) <= set(kw["allowed_token_ids"])
    with pytest.raises(ValueError, match="2 prompts but 1 sampling_params"):
        llm.generate(["a", "b"], [sp], use_tqdm=False)
    with pytest.raises(ValueError, match="selection"):
        EngineConfig(selection="fast")
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    assert not llm.llm_engine.has_unfinished_requests()


def test_a_refused_prompt_takes_its_batch_back(llm):
    """generate([good, bad]) raises for the bad prompt and leaves nothing queued: the good one
    queued before it does not run on unseen (into the next call's steps), nor hold off
    update_weights as "requests running". A sampling_params that is not one is a TypeError
    naming the argument, before anything is queued."""
    eng = llm.llm_engine
    sp = SamplingParams(max_tokens=2, **G)
    good = {"prompt_token_ids": [3, 4, 5]}
    for bad, err, match in (({"prompt_token_ids": [3, 100_000]}, ValueError, "vocabulary"),
                            (7, ValueError, "a prompt is a str or a dict")):
        with pytest.raises(err, match=match):
            llm.generate([good, good, bad], sp, use_tqdm=False)
        assert not eng.has_unfinished_requests()
    for params, match in (({"temperature": 0}, "sampling_params must be a SamplingParams or a list"),
                          ([sp, {"temperature": 0}], r"sampling_params\[1\] must be a SamplingParams, got dict")):
        with pytest.raises(TypeError, match=match):
            llm.generate([good, good], params, use_tqdm=False)
        assert not eng.has_unfinished_requests()
    norm = eng.runner.model.model.norm.weight
    assert llm.update_weights({"model.norm.weight": norm.detach().clone()}) == 1
    steps = eng.stats()["num_steps"]
    out = llm.generate([good], sp, use_tqdm=False)
    assert len(out) == 1 and len(out[0].outputs[0].token_ids) == 2
    assert eng.stats()["num_steps"] - steps == 2  # its own prefill and decode, no leftover request's


def test_prompt_token_ids_must_be_integers(llm):
    """{"prompt_token_ids": "345"} ran as [3, 4, 5] and 3.7 as 3, silently; None and 5 were a bare
    TypeError, and so were 0-d arrays; a torch bool (0-d or in a tensor) ran as token 1, a one-id
    tensor as its id. Each is a ValueError naming prompt_token_ids; NumPy and torch integers are ids."""
    import numpy as np
    import torch
    sp = SamplingParams(max_tokens=2, **G)
    for ids, match in (("345", "got str"), ([3.7, 4], r"got element 3.7 \(float\) at index 0"),
                       ([3, True], r"got element True \(bool\) at index 1"), (None, "got NoneType"),
                       (5, "got int"), ([[3, 4]], r"got element \[3, 4\] \(list\)"),
                       ([3, torch.tensor(True)], r"got element tensor\(True\) \(Tensor\) at index 1"),
                       (torch.tensor([3, 1]).bool(), "got a bool Tensor"), (np.array([True]), "got a bool ndarray"),
                       ([torch.tensor([3])], r"got element tensor\(\[3\]\)"), (torch.tensor(3), "got Tensor")):
        with pytest.raises(ValueError, match=r"prompt_token_ids must be a list of token ids \(integers\), " + match):
            llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    want = llm.generate([{"prompt_token_ids": [3, 4, 5]}], sp, use_tqdm=False)[0].outputs[0].token_ids
    for ids in (np.array([3, 4, 5]), torch.tensor([3, 4, 5]), [np.int32(3), 4, 5], [torch.tensor(3), 4, 5]):
        out = llm.generate([{"prompt_token_ids": ids}], sp, use_tqdm=False)[0]
        assert out.prompt_token_ids == [3, 4, 5] and out.outputs[0].token_ids == want


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_longer_bad_word_that_bans_what_is_left_fails_its_request_alone(llm, temperature):
    """A two-token bad word bans its last token only after its first: [[7], [8, 8]] with
    allowed_token_ids [7, 8] leaves 8 at the first token and nothing at the second, and so does
    [8, 8] beside one-token words over the rest of the vocabulary. The sampler draws from a row
    with every logit -inf there (token 0, outside both, with a finite logprob, before): the
    request fails at that token, which is not emitted, and its neighbour's bits are its solo run's."""
    V = llm.llm_engine.model_config.vocab_size
    neighbour = ({"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=6, logprobs=2, temperature=0.8, seed=3))
    solo = llm.generate([neighbour[0]], [neighbour[1]], use_tqdm=False)[0].outputs[0]
    for kw, kinds in (({"allowed_token_ids": [7, 8], "bad_words_token_ids": [[7], [8, 8]]},
                       "allowed_token_ids and bad_words"),
                      ({"bad_words_token_ids": [[i] for i in range(V) if i != 8] + [[8, 8]]}, "bad_words")):
        sp = SamplingParams(max_tokens=4, logprobs=1, temperature=temperature, seed=1, ignore_eos=True, **kw)
        bad, n = llm.generate([{"prompt_token_ids": [3, 4]}, neighbour[0]], [sp, neighbour[1]], use_tqdm=False)
        c = bad.outputs[0]
        assert (c.finish_reason, c.token_ids) == ("error", [8]), c
        assert bad.error == f"no token left to sample at output token 1: the request's {kinds} ban every token there"
        got = n.outputs[0]
        assert got.token_ids == solo.token_ids and got.logprobs == solo.logprobs


def test_kv_cache_too_small_is_a_clear_error():
    with pytest.raises(ValueError, match=r"max_model_len=256 needs 16 blocks"):
        make_llm(bundle("llama"), num_gpu_blocks=10)
    with pytest.raises(ValueError, match="kv_cache_memory_bytes=1000"):
        make_llm(bundle("llama"), num_gpu_blocks=None, kv_cache_memory_bytes=1000)


def test_engine_loop_abort_and_stats():
    b = bundle("llama")
    eng = LLMEngine(EngineConfig(device="cpu", max_model_len=128, num_gpu_blocks=64),
                    model=b.model, model_config=b.config)
    eng.add_request("a", prompt(1, 20, 160), SamplingParams(max_tokens=50, **G))
    eng.add_request("b", prompt(2, 5, 160), SamplingParams(max_tokens=3, **G))
    with pytest.raises(ValueError, match="already in use"):
        eng.add_request("a", [5], SamplingParams(max_tokens=1, **G))
    seen = {}
    for _ in range(4):
        for o in eng.step():
            seen.setdefault(o.request_id, []).append(o)
    assert seen["b"][-1].finished and len(seen["b"][-1].outputs[0].token_ids) == 3
    lens = [len(o.outputs[0].token_ids) for o in seen["a"]]
    assert lens == sorted(lens) and not seen["a"][-1].finished  # cumulative outputs
    s = eng.stats()
    assert s["num_running"] == 1 and s["num_waiting"] == 0 and 0 < s["kv_cache_usage"] < 1
    assert {"prefix_cache_hit_rate", "num_preemptions", "num_free_kv_blocks"} <= s.keys()
    eng.abort_request("a")
    outs = eng.step()
    assert [(o.request_id, o.finished, o.outputs[0].finish_reason) for o in outs] == [("a", True, "abort")]
    assert not eng.has_unfinished_requests() and eng.stats()["kv_cache_usage"] == 0.0


def test_steps_are_counted_by_kind_with_their_tokens():
    b = bundle("llama")
    eng = LLMEngine(EngineConfig(device="cpu", max_model_len=128, num_gpu_blocks=64, max_num_batched_tokens=32),
                    model=b.model, model_config=b.config)
    eng.add_request("a", prompt(1, 40, 160), SamplingParams(max_tokens=4, **G))  # 32 + 8: two chunks
    for _ in range(3):  # chunk, chunk + first token, then a decode
        eng.step()
    eng.add_request("b", prompt(2, 6, 160), SamplingParams(max_tokens=2, **G))  # beside a's decodes: mixed
    while eng.has_unfinished_requests():
        eng.step()
    kinds = {k: KindCounters(*v) for k, v in eng.stats()["steps_by_kind"].items()}
    assert kinds["prefill"].steps == 2 and kinds["prefill"].tokens == 40
    assert kinds["mixed"].steps == 1 and kinds["mixed"].tokens == 6 + 1
    assert sum(k.steps for k in kinds.values()) == eng.stats()["num_steps"]
    assert sum(k.tokens for k in kinds.values()) == 40 + 3 + 6 + 1  # every token computed once
    assert all(k.seconds >= 0 and 0 <= k.wait_seconds and 0 <= k.launch_seconds for k in kinds.values())
    assert kinds["decode"].launch_seconds > 0
    # the launch's parts: preparing the inputs and the model call, within the launch's time
    assert all(0 < k.prepare_seconds and 0 < k.forward_seconds
               and k.prepare_seconds + k.forward_seconds <= k.launch_seconds for k in kinds.values())
    # on the CPU no step replays a graph and none has CUDA events (tests/gpu/test_gpu_mixed_graph.py
    # counts the GPU's)
    assert all(k.whole_graph_steps == 0 and k.piecewise_steps == 0 and k.device_seconds == 0.0
               and k.device_idle_seconds == 0.0 for k in kinds.values())
    # decode rows: a's tokens 2-4 (one of them in b's mixed step) and b's token 2; each row
    # carries its step's seconds
    assert (sum(k.decode_rows for k in kinds.values()), kinds["mixed"].decode_rows,
            kinds["prefill"].decode_rows) == (4, 1, 0)
    assert abs(kinds["mixed"].decode_row_seconds - kinds["mixed"].seconds) < 1e-12  # one row in the one mixed step
    assert 0 < kinds["decode"].decode_row_seconds <= kinds["decode"].decode_rows * kinds["decode"].seconds
    assert all(k.rows_left_out == 0 for k in kinds.values())  # no step left a generating request out
    # the step loop's host time by part: planning, launching and advancing took time; no pipe here
    host = eng.stats()["host_seconds"]
    assert set(host) == {"inbox", "schedule", "launch", "wait", "update", "outputs", "ipc_in", "ipc_out"}
    assert all(host[p] > 0 for p in ("schedule", "launch", "update", "outputs")) and host["ipc_out"] == 0.0
    # the launches and waits the kinds count
    assert abs(host["launch"] - sum(k.launch_seconds for k in kinds.values())) < 1e-9
    assert abs(host["wait"] - sum(k.wait_seconds for k in kinds.values())) < 1e-9


def test_add_and_abort_from_another_thread():
    b = bundle("llama")
    eng = LLMEngine(EngineConfig(device="cpu", max_model_len=128, num_gpu_blocks=64),
                    model=b.model, model_config=b.config)
    finished: dict[str, RequestOutput] = {}
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            for o in eng.step():
                if o.finished:
                    finished[o.request_id] = o
            if not eng.has_unfinished_requests():
                time.sleep(0.001)

    t = threading.Thread(target=loop)
    t.start()
    try:
        for i in range(12):
            eng.add_request(f"r{i}", prompt(i, 4 + i, 160), SamplingParams(max_tokens=200 if i % 3 == 0 else 5, **G))
        for i in range(0, 12, 3):
            eng.abort_request(f"r{i}")
        deadline = time.time() + 60
        while len(finished) < 12 and time.time() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        t.join()
    assert len(finished) == 12
    assert {r for r, o in finished.items() if o.outputs[0].finish_reason == "abort"} == {"r0", "r3", "r6", "r9"}
    assert all(len(finished[f"r{i}"].outputs[0].token_ids) == 5 for i in range(12) if i % 3)


def test_a_step_that_raises_fails_its_requests_only(monkeypatch):
    llm = text_llm()
    eng = llm.llm_engine
    monkeypatch.setattr(eng.runner, "launch",
                        failing_launch(eng.runner, 1, NotImplementedError("unsupported sampling field: demo")))
    outs = llm.generate(["abc"], SamplingParams(max_tokens=3, **G), use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "error" and "demo" in outs[0].error
    outs = llm.generate(["abc"], SamplingParams(max_tokens=3, **G), use_tqdm=False)
    assert outs[0].outputs[0].finish_reason == "length" and outs[0].error is None


def test_abort_waiting_and_unknown_requests():
    b = bundle("llama")
    eng = LLMEngine(EngineConfig(device="cpu", max_model_len=128, num_gpu_blocks=64, max_num_seqs=1),
                    model=b.model, model_config=b.config)
    eng.add_request("run", prompt(1, 8, 160), SamplingParams(max_tokens=5, **G))
    eng.add_request("wait", prompt(2, 8, 160), SamplingParams(max_tokens=5, **G))
    eng.step()
    assert eng.stats()["num_running"] == 1 and eng.stats()["num_waiting"] == 1
    eng.abort_request(["wait", "nope"])
    outs = eng.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outs if o.finished] == [("wait", "abort")]
    while eng.has_unfinished_requests():
        eng.step()


def test_prefix_cache_hit_rate_is_reported(llm):
    p = {"prompt_token_ids": prompt(3, 40, 160)}
    llm.reset_prefix_cache()
    a = llm.generate([p], SamplingParams(max_tokens=2, **G), use_tqdm=False)[0]
    q0 = llm.llm_engine.stats()
    b2 = llm.generate([p], SamplingParams(max_tokens=2, **G), use_tqdm=False)[0]
    q1 = llm.llm_engine.stats()
    assert (a.num_cached_tokens, b2.num_cached_tokens) == (0, 32)
    assert (q1["prefix_cache_queries"] - q0["prefix_cache_queries"], q1["prefix_cache_hits"] - q0["prefix_cache_hits"]) == (40, 32)
    assert 0 < q1["prefix_cache_hit_rate"] < 1


@pytest.fixture
def unfrozen_gc():
    import gc
    gc.unfreeze()
    yield gc
    gc.unfreeze()  # freezing is process-wide: give later tests a collector that sees everything


def test_freeze_gc_moves_startup_objects_out_of_the_collector(unfrozen_gc):
    gc = unfrozen_gc
    b = bundle("llama")
    off = make_llm(b)  # default on CPU: off (a test process builds many engines)
    assert not off.llm_engine.gc_frozen and gc.get_freeze_count() == 0
    on = make_llm(b, freeze_gc=True)
    assert on.llm_engine.gc_frozen and gc.get_freeze_count() > 0
    # objects made after startup stay collectable, and the engine keeps serving
    outs = on.generate([{"prompt_token_ids": prompt(0, 12, b.config.vocab_size)}], SamplingParams(max_tokens=4, **G),
                       use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 4
    frozen = gc.get_freeze_count()
    junk = [[i] for i in range(1000)]
    junk.append(junk)  # a cycle only a collection frees
    del junk
    # a collection leaves the frozen generation frozen; a collected cycle can hold the last reference
    # to a frozen object, which then goes (two did once, in a CI worker that had run other tests)
    assert gc.collect() >= 1000 and frozen - 100 <= gc.get_freeze_count() <= frozen


def test_progress_bar_shows_input_and_output_tokens_per_second(llm, capsys):
    prompts = [{"prompt_token_ids": [5 + i] * 10} for i in range(2)]
    llm.generate(prompts, SamplingParams(max_tokens=4, n=2, seed=0, ignore_eos=True))  # 2 x 2 x 10 in, 2 x 2 x 4 out
    err = capsys.readouterr().err
    assert "Processed prompts" in err and "2/2" in err
    speeds = re.findall(r"est\. speed input: ([\d.]+) toks/s, output: ([\d.]+) toks/s", err)
    assert speeds, err
    inp, out = map(float, speeds[-1])
    assert inp > 0 and out > 0 and inp / out == pytest.approx(40 / 16, rel=0.01)  # one clock for both


def _step_outputs(engine, rid: str) -> list:
    """Every output `engine.step()` gives for `rid`, as given (not copied)."""
    got = []
    while engine.has_unfinished_requests():
        got += [o for o in engine.step() if o.request_id == rid]
    return got


@pytest.mark.parametrize("share", [False, True])
def test_step_outputs_own_their_lists_unless_shared(llm, share):
    """By default each cumulative output keeps what it had when given; with share_lists (the
    engine core's setting: it encodes each step's deltas before the next step) outputs are views
    of the request's lists, which later steps extend. Tokens and logprobs are the same either way."""
    engine = llm.llm_engine
    engine.outputs.share_lists = share
    try:
        engine.add_request("own", [5, 6, 7], SamplingParams(max_tokens=6, logprobs=2, **G))
        outs = _step_outputs(engine, "own")
    finally:
        engine.outputs.share_lists = False
    final = outs[-1].outputs[0]
    assert len(outs) == 6 and len(final.token_ids) == len(final.logprobs) == 6
    lengths = [len(o.outputs[0].token_ids) for o in outs]
    assert lengths == ([6] * 6 if share else [1, 2, 3, 4, 5, 6])
    ref = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=6, logprobs=2, **G),
                       use_tqdm=False)[0].outputs[0]
    assert (final.token_ids, final.logprobs, final.cumulative_logprob) == (ref.token_ids, ref.logprobs,
                                                                          ref.cumulative_logprob)


def test_a_shut_down_llm_refuses_every_call_alike(tmp_path):
    """After shutdown(), generate raised but chat rendered its template first, and
    update_weights and reset_prefix_cache still ran on one rank (with several, the
    executor raised): each is the same RuntimeError now."""
    from detent.models.tiny import write_tiny_llama
    llm = LLM(model=write_tiny_llama(str(tmp_path / "tiny")), device="cpu", dtype="float32", max_model_len=256,
              num_gpu_blocks=40)
    norm = llm.llm_engine.runner.model.model.norm.weight.detach().clone()
    llm.shutdown()
    llm.shutdown()  # idempotent
    calls = {"generate": lambda: llm.generate("Hi", use_tqdm=False),
             "chat": lambda: llm.chat([{"role": "user", "content": "Hi"}], use_tqdm=False),
             "update_weights": lambda: llm.update_weights([("model.norm.weight", norm)]),
             "reset_prefix_cache": llm.reset_prefix_cache}
    for what, call in calls.items():
        with pytest.raises(RuntimeError, match=r"this LLM was shut down \(LLM.shutdown\(\)\); make a new one"):
            call()


def test_a_tiny_llama_with_a_word_level_tokenizer_needs_no_embedded_model(tmp_path, monkeypatch):
    """write_tiny_llama(tokenizer="wordlevel") (the GPU tune test's model): "t<i>" is token i,
    and the engine serves it with the embedded model's package out of reach."""
    import detent.models.resolve as resolve
    from detent.models.tiny import write_tiny_llama

    def no_package(*_a, **_k):
        raise AssertionError("the word-level model read the embedded model's package")

    monkeypatch.setattr(resolve, "resolve_model", no_package)
    path = write_tiny_llama(str(tmp_path / "tiny"), tokenizer="wordlevel")
    llm = LLM(model=path, device="cpu", dtype="float32", max_model_len=256, num_gpu_blocks=40)
    tok = llm.get_tokenizer()
    assert tok.encode("t5 t100 t49151", add_special_tokens=False) == [5, 100, 49151]
    assert tok.decode([5, 100]) == "t5 t100"
    out = llm.generate("t5 t100 t7", SamplingParams(temperature=0, max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3 and out[0].prompt_token_ids[-3:] == [5, 100, 7]
    llm.shutdown()
    with pytest.raises(ValueError, match="tokenizer"):
        write_tiny_llama(str(tmp_path / "x"), tokenizer="gpt2")
