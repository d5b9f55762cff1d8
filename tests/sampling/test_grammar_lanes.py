"""Grammar compiles a client controls, bounded: a schema over the limits is refused at
add_request; hostile compiles in the large lane time out alone, an aborted request's queued
compile is dropped unrun, and a full lane refuses a new spec (the server's 503) while
admitting the specs it already holds."""
from __future__ import annotations

import pytest

from detent.engine import SamplingParams
from detent.sampling.params import StructuredOutputs

from .engine_util import tiny_llm
from .test_engine_grammar import SPECS, VOCAB, check


def test_a_schema_over_the_limits_is_refused_at_add_request():
    """Refused before anything compiles, naming the limit (the server answers 400)."""
    eng = tiny_llm(VOCAB).llm_engine
    many = {"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(1001)}}
    with pytest.raises(ValueError, match=r"more than 1000 properties.*max_schema_properties = 1000"):
        eng.add_request("big", [3, 4], SamplingParams(max_tokens=5, structured_outputs=StructuredOutputs(json=many)))
    assert not eng.has_unfinished_requests()


def _slow(name: str) -> StructuredOutputs:
    """About 20 s to compile here, within GrammarLimits: a hostile client's schema (large lane)."""
    return StructuredOutputs(json={"type": "object", "properties": {
        f"{name}{i}": {"type": "string", "pattern": "[a-f]{1,%d}" % (i + 3)} for i in range(1000)}})


def _warm_large_lane(eng):
    """A large-lane request served under a 120 s timeout (the lane's worker may be starting);
    the engine's grammar cache."""
    cache = eng._grammar_cache()
    timeout, cache.timeout_s = cache.timeout_s, 120.0
    eng.add_request("warm", [3], SamplingParams(max_tokens=1, structured_outputs=StructuredOutputs(
        grammar='root ::= "' + "w" * 5000 + '"')))
    assert _drain(eng)["warm"].error is None
    cache.timeout_s = timeout
    return cache


def _begun(eng, rid):
    import time
    eng.step()  # drains the inbox
    req = eng.scheduler.requests.get(rid)
    assert req is not None, f"{rid} finished before its compile was seen begun (its compile timeout passed?)"
    fut, t0 = req.grammar._future, time.monotonic()
    while fut.started is None:
        assert time.monotonic() - t0 < 60
        time.sleep(0.01)


def _drain(eng, done=None, once=False):
    """Step until no request is left (or `once`): the finished outputs by request id."""
    done = {} if done is None else done
    while eng.has_unfinished_requests():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        if once:
            break
    return done


def test_the_offline_engine_bounds_no_compile_lane():
    """Offline (no max_queued_grammar_compiles, as vLLM's LLM) a caller's many distinct specs all wait."""
    assert tiny_llm(VOCAB).llm_engine._grammar_cache().limits.max_queued_compiles is None


def test_an_aborted_requests_queued_compile_is_dropped():
    """Three hostile schemas in the large lane, compile timeout 2 s; the last two requests are
    aborted while the first compiles. Their compiles are dropped, never run: a good request behind
    them waits for one compile timeout, not three, and only the first one's worker is killed. The
    two join the lane once the first has begun (adding a 1,000-property schema takes a while on a
    busy CPU: added first, the first's 2 s could pass before the step that shows it begun)."""
    from detent.sampling import grammar_workers
    eng = tiny_llm(VOCAB).llm_engine
    _warm_large_lane(eng).timeout_s = 2.0
    large = grammar_workers.lanes()["large"]
    kills = large.kills
    slow = {rid: SamplingParams(max_tokens=4, structured_outputs=_slow(rid)) for rid in ("h1", "h2", "h3")}
    eng.add_request("h1", [3, 4], slow["h1"])
    _begun(eng, "h1")
    for rid in ("h2", "h3"):
        eng.add_request(rid, [3, 4], slow[rid])
    eng.abort_request(["h2", "h3"])
    eng.add_request("good", [5, 6], SamplingParams(seed=0, max_tokens=3, structured_outputs=StructuredOutputs(
        grammar='root ::= "' + "g" * 5000 + '"')))
    done = _drain(eng)
    assert large.kills == kills + 1  # h2's and h3's compiles never ran
    assert [done[r].outputs[0].finish_reason for r in ("h1", "h2", "h3")] == ["error", "abort", "abort"]
    assert "timed out" in done["h1"].error
    assert done["good"].error is None and done["good"].outputs[0].text == "ggg"


def test_a_full_compile_lane_refuses_a_new_spec_at_add_request():
    """max_queued_grammar_compiles = 1, one hostile compile running and one waiting in the large
    lane: a request with a third large spec is refused at add_request (CompileQueueFull, a
    ValueError naming the limit; the server's 503), its id left free; a request with the waiting
    spec, a small-spec one and a plain one are admitted and served; once the hostile requests are
    aborted, the refused one is admitted."""
    from detent.engine import CompileQueueFull
    eng = tiny_llm(VOCAB, max_queued_grammar_compiles=1).llm_engine
    _warm_large_lane(eng).timeout_s = 2.0
    eng.add_request("h1", [3, 4], SamplingParams(max_tokens=4, structured_outputs=_slow("h1")))
    _begun(eng, "h1")
    eng.add_request("h2", [3, 4], SamplingParams(max_tokens=4, structured_outputs=_slow("h2")))
    with pytest.raises(CompileQueueFull, match=r"max_queued_grammar_compiles = 1\b"):
        eng.add_request("new", [3, 4], SamplingParams(max_tokens=4, structured_outputs=_slow("new")))
    with pytest.raises(CompileQueueFull):  # n = 2: both samples share one job, refused as one
        eng.add_request("new2", [3, 4], SamplingParams(n=2, max_tokens=4, structured_outputs=_slow("new")))
    eng.add_request("h2b", [3, 5], SamplingParams(max_tokens=4, structured_outputs=_slow("h2")))
    eng.add_request("small", [5, 6], SamplingParams(seed=0, max_tokens=60, structured_outputs=SPECS["regex"]))
    eng.add_request("free", [8, 9], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    done = _drain(eng, once=True)
    eng.abort_request(["h1", "h2", "h2b"])
    _drain(eng, done, once=True)  # the aborts are applied: h2's waiting compile is dropped
    eng.add_request("new", [3, 4], SamplingParams(max_tokens=4, structured_outputs=_slow("new")))
    eng.abort_request("new")
    _drain(eng, done)
    assert check("regex", done["small"].outputs[0].text) and done["small"].error is None
    assert len(done["free"].outputs[0].token_ids) == 4
    assert {r: done[r].outputs[0].finish_reason for r in ("h2", "h2b", "new")} == dict.fromkeys(
        ("h2", "h2b", "new"), "abort")
    assert done["h1"].outputs[0].finish_reason in ("abort", "error")  # its compile may time out first
