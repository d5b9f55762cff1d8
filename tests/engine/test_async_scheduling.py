"""Async scheduling (engine overlap): the engine plans and launches step N+1
before it collects step N, feeding step N's sampled tokens to step N+1 on the
device (PLACEHOLDER inputs).

Contract: every request's outputs are the same with and without overlap.
Comparator: token ids, finish reasons and stop reasons with `==`; chosen and
top-k logprobs and prompt logprobs as Python floats with `==` (bit-equal
float32 values). The workload mixes everything the overlap has to get right:
stop tokens and stop strings found one step late, max_tokens 1 and 2 (a
pending token that must be the last), n = 2, seeded sampling with and without
top-p, requests that need their token on the host (penalties, min_tokens,
prompt logprobs), chunked prefill, and a KV pool small enough to preempt.
"""
from __future__ import annotations

import pytest

from detent.engine import SamplingParams
from detent.scheduler.outputs import PLACEHOLDER
from engine_helpers import prompt, summary, text_llm


def workload() -> list[tuple[list[int], SamplingParams]]:
    out = []
    for i in range(14):
        p = prompt(100 + i, 5 + (i * 11) % 60, 160)
        kind = i % 7
        if kind == 0:
            sp = SamplingParams(temperature=0, max_tokens=12, logprobs=3)
        elif kind == 1:
            sp = SamplingParams(temperature=0.8, seed=i, max_tokens=10, logprobs=2, ignore_eos=True)
        elif kind == 2:
            sp = SamplingParams(temperature=0.9, top_p=0.8, seed=i, max_tokens=9, ignore_eos=True)
        elif kind == 3:
            sp = SamplingParams(temperature=0, max_tokens=1 + i % 2, ignore_eos=True)
        elif kind == 4:
            sp = SamplingParams(temperature=0, max_tokens=14, repetition_penalty=1.3, min_tokens=2,
                                ignore_eos=True)
        elif kind == 5:
            sp = SamplingParams(temperature=0.7, seed=i, n=2, max_tokens=8, stop=["~", "a"], ignore_eos=True)
        else:
            sp = SamplingParams(temperature=0, max_tokens=6, prompt_logprobs=2, logprobs=1, ignore_eos=True)
        out.append((p, sp))
    return out


def run(llm, items, stop_tokens: bool = False):
    eng = llm.llm_engine
    params = []
    for p, sp in items:
        params.append(sp)
    if stop_tokens:  # stop at a token the free run produces mid-way (found by a first run)
        params = [SamplingParams(**{**_fields(sp), "stop_token_ids": [t]}) if t is not None else sp
                  for sp, t in zip(params, stop_tokens)]
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in items], params, use_tqdm=False)
    return [summary(o) for o in outs], eng


def _fields(sp: SamplingParams) -> dict:
    keys = ("temperature", "top_p", "seed", "n", "max_tokens", "logprobs", "prompt_logprobs", "stop",
            "ignore_eos", "repetition_penalty", "min_tokens")
    return {k: getattr(sp, k) for k in keys}


def _llm(async_scheduling: bool, selection: str = "pinned"):
    # 24 usable blocks of 16 tokens for up to 16 running requests: preemption happens
    return text_llm(selection, async_scheduling=async_scheduling, num_gpu_blocks=25, max_num_seqs=16,
                    max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def serial():
    llm = _llm(False)
    first, _ = run(llm, workload())
    # stop tokens: the 4th token each request produced in the free run (stops mid-stream, one step early)
    stops = [rows[0][0][3] if len(rows[0][0]) > 4 else None for rows, _, _ in first]
    again, eng = run(llm, workload(), stops)
    return first, stops, again, eng.stats()["num_preemptions"]


def test_overlap_gives_the_same_outputs_as_serial(serial, count_placeholders):
    first, stops, again, preemptions = serial
    llm = _llm(True)
    eng = llm.llm_engine
    assert eng.async_scheduling
    holes = count_placeholders(eng)
    got_first, _ = run(llm, workload())
    got_again, _ = run(llm, workload(), stops)
    assert got_first == first
    assert got_again == again
    # the overlap really happened, and so did preemption and early stops
    assert sum(holes) >= 10, holes
    assert preemptions > 0 and eng.stats()["num_preemptions"] > 0
    assert any(rows[0][1] == "stop" for rows, _, _ in again)
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks


def test_comparison_detects_a_wrong_placeholder_token(serial, monkeypatch):
    """The check above can fail: feed step N+1 a token other than the one step N sampled."""
    first = serial[0]
    llm = _llm(True)
    runner = llm.llm_engine.runner
    real = runner.prepare

    def prepare(plan, prev=None):
        batch = real(plan, prev)
        if prev is not None and any(PLACEHOLDER in s.token_ids for s in plan.seqs):
            batch.input_ids.add_(1).remainder_(160)  # every input token of the step shifted
        return batch
    monkeypatch.setattr(runner, "prepare", prepare)
    got, _ = run(llm, workload())
    assert got != first


def test_abort_while_a_token_is_in_flight_frees_everything():
    llm = _llm(True)
    eng = llm.llm_engine
    for i in range(6):
        eng.add_request(f"r{i}", prompt(200 + i, 20, 160), SamplingParams(temperature=0, max_tokens=30,
                                                                           ignore_eos=True))
    done = {}
    for _ in range(6):
        for o in eng.step():
            done[o.request_id] = o
    assert eng._inflight is not None  # a launched step holds pending tokens of every request
    eng.abort_request(["r1", "r4"])
    while eng.has_unfinished_requests():
        for o in eng.step():
            done[o.request_id] = o
    assert {r: o.outputs[0].finish_reason for r, o in done.items() if o.finished} == {
        "r0": "length", "r1": "abort", "r2": "length", "r3": "length", "r4": "abort", "r5": "length"}
    assert all(len(done[f"r{i}"].outputs[0].token_ids) == 30 for i in (0, 2, 3, 5))
    eng.step()  # collects the last launched step (its rows belong to finished requests)
    assert eng._inflight is None
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_usable_blocks


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_same_with_and_without_overlap(seed):
    """Seeded random workloads (prompt lengths, max_tokens, max_model_len, stop tokens, sampling
    with top-p, top-k, min-p, logit bias, allowed tokens, min_tokens, penalties or bad words, n,
    KV pool and token budget): every request's outputs are `==` with and without overlap."""
    import random
    r = random.Random(seed)
    items = []
    for i in range(r.randrange(6, 18)):
        kw = dict(max_tokens=r.randrange(1, 20), ignore_eos=r.random() < 0.5, logprobs=r.choice([None, 0, 2]))
        if r.random() < 0.5:
            kw.update(temperature=r.choice([0.5, 1.0]), seed=r.randrange(100))
        else:
            kw.update(temperature=0)
        if r.random() < 0.3:
            kw["stop_token_ids"] = [r.randrange(2, 160) for _ in range(3)]
        if r.random() < 0.2:
            kw["n"] = 2
        if r.random() < 0.4:  # one more sampling feature, each read at a different point of the step
            kw.update(r.choice([dict(top_p=0.8), dict(top_k=5, min_p=0.05), dict(logit_bias={7: 3.0, 9: -2.0}),
                                dict(allowed_token_ids=list(range(40, 90))), dict(min_tokens=kw["max_tokens"] // 2),
                                dict(repetition_penalty=1.3, presence_penalty=0.2),
                                dict(bad_words_token_ids=[[r.randrange(2, 160), r.randrange(2, 160)],
                                                          [r.randrange(2, 160)]])]))
        items.append((prompt(1000 * seed + i, r.randrange(1, 45), 160), SamplingParams(**kw)))
    max_len = r.choice([48, 256])  # 256 needs 16 blocks of 16 tokens for one request
    engine_kw = dict(num_gpu_blocks=r.choice([12, 20, 200] if max_len == 48 else [20, 200]),
                     max_num_seqs=r.choice([4, 16]), max_num_batched_tokens=r.choice([32, 128]),
                     max_model_len=max_len)
    outs = {}
    for overlap in (False, True):
        llm = text_llm("pinned", async_scheduling=overlap, **engine_kw)
        outs[overlap] = run(llm, items)[0]
        bm = llm.llm_engine.block_manager
        assert bm.num_free_blocks == bm.num_usable_blocks
    assert outs[True] == outs[False]


def test_a_bad_word_of_several_tokens_is_banned_the_same_with_and_without_overlap():
    """The ban of a bad word's last token reads whether the output ends with the word's
    prefix: under overlap the host had not yet got that prefix's last token, so the word
    went through (and whether it did depended on a neighbour forcing the step to be
    collected first). The sampler now compares that token on the device."""
    p = prompt(7, 20, 160)
    greedy = dict(temperature=0, max_tokens=12, ignore_eos=True)
    free = text_llm("pinned", async_scheduling=False).generate(
        [{"prompt_token_ids": p}], SamplingParams(**greedy), use_tqdm=False)[0].outputs[0].token_ids
    word = list(free[3:5])  # two tokens the free run produces in a row
    sp = SamplingParams(**greedy, bad_words_token_ids=[word])
    outs = {}
    for overlap in (False, True):
        llm = text_llm("pinned", async_scheduling=overlap)
        outs[overlap] = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0].token_ids
    assert outs[False][:4] == free[:4] and outs[False][4] != word[1]  # the ban bites
    assert outs[True] == outs[False]


@pytest.mark.parametrize("feature", [
    # processed logprobs: the penalised or masked distribution is reported, so a miss shows
    dict(repetition_penalty=1.5, frequency_penalty=1.0, presence_penalty=0.5, logprobs=2, logprobs_mode="processed"),
    dict(min_tokens=8, ignore_eos=False, logprobs=2, logprobs_mode="processed"),
    dict(bad_words_token_ids=[[40, 41], [41, 42, 43], [44]], logprobs=2, logprobs_mode="processed"),
    dict(golden_token_ids=[50, 51, 52, 53, 54, 55]),
], ids=["penalties", "min_tokens", "bad words", "golden tokens"])
def test_requests_that_read_their_output_overlap_and_match_serial(feature, count_placeholders):
    """Penalties, min_tokens, bad words and golden tokens read the output so far, whose last
    token is still on the device under overlap (SamplingRow.pending): their steps overlap,
    and every output is the serial one."""
    items = [(prompt(300 + i, 10 + 3 * i, 160), SamplingParams(**{**dict(temperature=0.8, seed=i, max_tokens=12,
                                                                          ignore_eos=True), **feature}))
             for i in range(4)]
    serial = run(_llm(False), items)[0]
    llm = _llm(True)
    holes = count_placeholders(llm.llm_engine)
    assert run(llm, items)[0] == serial
    assert sum(holes) >= 8, holes  # the steps did overlap


def test_prompt_logprobs_stay_on_the_device_until_their_step_is_collected(monkeypatch):
    """A step with prompt-logprob rows is launched without waiting for any result (the host
    would wait for the forward), and the next chunk is planned before those rows come back:
    their step overlaps like any other, and the outputs equal the serial run's."""
    from detent.sampling.sampler import PendingSample
    items = [(prompt(400 + i, 40 + 40 * i, 160), SamplingParams(temperature=0.8, seed=i, max_tokens=6,
                                                                 prompt_logprobs=2, logprobs=1, ignore_eos=True))
             for i in range(3)]
    serial = run(_llm(False), items)[0]
    llm = _llm(True)
    runner, resolved, launches = llm.llm_engine.runner, [], []
    real_resolve, real_launch = PendingSample.resolve, runner.launch
    monkeypatch.setattr(PendingSample, "resolve", lambda self: (resolved.append(1), real_resolve(self))[1])

    def launch(plan, prev=None):
        before = len(resolved)
        handle = real_launch(plan, prev)
        launches.append((len(resolved) - before, prev is not None and any(s.prompt_targets for s in plan.seqs)))
        return handle
    runner.launch = launch
    assert run(llm, items)[0] == serial
    assert resolved and sum(n for n, _ in launches) == 0  # every result came back in collect
    assert sum(ahead for _, ahead in launches) >= 3, launches  # prompt chunks planned while one was in flight
