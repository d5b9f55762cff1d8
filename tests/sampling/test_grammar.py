"""GrammarCompilerCache and GrammarState (xgrammar) on the tiny raw vocabulary."""
from __future__ import annotations

import json
import os
import time

import pytest
import torch

from detent.sampling.params import StructuredOutputs
from detent.sampling.processors import bitmask_to_bool
from detent.sampling.sampler import SamplingRow, sample
from detent.sampling.params import SamplingParams

from .tiny_vocab import EOS, VOCAB, V, decode, tiny_cache


def wait(state, limit=30.0):
    t0 = time.monotonic()
    while not state.ready and state.error is None:
        assert time.monotonic() - t0 < limit
        time.sleep(0.005)
    return state


def allowed(state, vocab=V):
    return [i for i in range(vocab) if bitmask_to_bool(state.bitmask()[None], vocab)[0, i]]


def test_cache_shares_one_compiled_grammar_per_spec_and_is_lru():
    cache = tiny_cache(max_entries=2)
    a1 = cache.submit(StructuredOutputs(regex="a+"))
    a2 = cache.submit(StructuredOutputs(regex="a+"))
    assert a1 is a2 and cache.hits == 1 and cache.misses == 1
    cache.submit(StructuredOutputs(regex="b+"))
    cache.submit(StructuredOutputs(regex="c+"))  # evicts a+
    assert len(cache) == 2
    assert cache.submit(StructuredOutputs(regex="a+")) is not a1
    # different any_whitespace is a different grammar
    j1 = cache.submit(StructuredOutputs(json_object=True))
    assert cache.submit(StructuredOutputs(json_object=True, any_whitespace=True)) is not j1


def test_states_are_per_request():
    cache = tiny_cache()
    s1, s2 = wait(cache.new_state(StructuredOutputs(regex="[a-f][0-9]+"))), \
        wait(cache.new_state(StructuredOutputs(regex="[a-f][0-9]+")))
    assert s1.accept(VOCAB.index("a"))
    assert allowed(s2) != allowed(s1)  # s2 did not move


def test_eos_only_where_the_grammar_may_end_and_rollback():
    st = wait(tiny_cache().new_state(StructuredOutputs(regex="[a-f][0-9]+")))
    assert EOS not in allowed(st)
    assert st.accept(VOCAB.index("c"))
    assert EOS not in allowed(st)
    assert st.accept(VOCAB.index("7"))
    assert EOS in allowed(st)
    st.rollback(1)
    assert EOS not in allowed(st) and st.num_accepted == 1
    assert not st.accept(VOCAB.index("x"))  # not in the grammar
    assert st.accept(VOCAB.index("12")) and st.accept(EOS)
    assert st.is_terminated()
    with pytest.raises(ValueError, match="rollback"):
        st.rollback(9)


def test_padded_model_vocab_never_allows_padding_ids():
    st = wait(tiny_cache(vocab_size=V + 80).new_state(StructuredOutputs(json_object=True)))
    ids = allowed(st, V + 80)
    assert ids and max(ids) < V
    # the sampler masks a padded logits row the same way: padding ids never come out
    logits = torch.zeros(200, V + 80)
    logits[:, V:] = 50.0  # the padding is the most likely by far
    rows = [SamplingRow(SamplingParams(temperature=1.0), seed=s, position=0, grammar=st) for s in range(200)]
    assert max(sample(logits, rows).token_ids) < V


def test_json_whitespace_is_fixed_by_default():
    st = wait(tiny_cache().new_state(StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}},
                                                             "required": ["a"]})))
    assert st.accept(VOCAB.index("{"))
    assert VOCAB.index(" ") not in allowed(st)
    st2 = wait(tiny_cache().new_state(StructuredOutputs(json={"type": "object"}, any_whitespace=True)))
    assert st2.accept(VOCAB.index("{"))
    assert VOCAB.index(" ") in allowed(st2)


def test_choice_compiles_to_exact_alternatives():
    st = wait(tiny_cache().new_state(StructuredOutputs(choice=["ab", "b2", 'a"1'])))
    assert sorted(VOCAB[i] for i in allowed(st)) == sorted(["a", "b", "ab", "b2"])  # not "a1": the choice is a"1
    for t in ("a", '"', "1", EOS):
        assert st.accept(VOCAB.index(t) if isinstance(t, str) else t)
    assert st.is_terminated()


def test_compile_error_is_reported_on_the_state_only():
    cache = tiny_cache()
    bad = wait(cache.new_state(StructuredOutputs(json={"$ref": "#/definitions/missing"})))
    good = wait(cache.new_state(StructuredOutputs(regex="a+")))
    assert not bad.ready and "grammar compilation failed" in bad.error and "definitions" in bad.error
    assert good.ready and good.error is None
    with pytest.raises(RuntimeError, match="before it is ready"):
        bad.bitmask()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_a_timed_out_compile_is_stopped_and_small_grammars_keep_compiling():
    """A 3,000-property schema (about 10 s to compile here) times out at 3 s: its worker process is
    killed, so the compile stops, while a small grammar compiles in the other lane meanwhile."""
    from detent.sampling import grammar_workers
    from detent.sampling.grammar_limits import GrammarLimits
    cache = tiny_cache(timeout_s=3.0, limits=GrammarLimits(max_schema_properties=10 ** 6, max_spec_bytes=10 ** 8))
    cache.timeout_s = 120.0  # the lanes are warm once each has compiled something
    wait(cache.new_state(StructuredOutputs(regex="warm")), limit=150)
    wait(cache.new_state(StructuredOutputs(grammar='root ::= "' + "w" * 5000 + '"')), limit=150)
    cache.timeout_s = 3.0
    large = grammar_workers.lanes()["large"]
    kills, pid = large.kills, large.workers[0].pid
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(3000)}}
    slow = cache.new_state(StructuredOutputs(json=big))
    t0 = time.monotonic()
    fast = wait(cache.new_state(StructuredOutputs(regex="[0-9]+")))
    assert fast.ready and not slow.ready and time.monotonic() - t0 < 3.0  # before the big one was stopped
    wait(slow)
    assert not slow.ready and "timed out" in slow.error
    deadline = time.monotonic() + 30
    while large.kills == kills and time.monotonic() < deadline:
        time.sleep(0.05)
    assert large.kills == kills + 1 and not _pid_alive(pid)  # the compile stopped with its process
    cache.timeout_s = 120.0
    again = wait(cache.new_state(StructuredOutputs(grammar='root ::= "' + "v" * 5000 + '"')), limit=150)
    assert again.ready  # the lane has a new worker


def test_a_grammar_queued_behind_timed_out_compiles_still_compiles():
    """Two 3,000-property schemas, then a small grammar, in one lane with a 1 s compile timeout:
    the small one waits for both to be killed and for the worker to restart twice (more than the
    twice-the-timeout budget it has), yet compiles, since its budget counts from when a worker
    begins it. The two still fail at the timeout, their workers killed."""
    from detent.sampling import grammar_workers
    from detent.sampling.grammar_limits import GrammarLimits
    cache = tiny_cache(timeout_s=120.0, limits=GrammarLimits(max_schema_properties=10 ** 6, max_spec_bytes=10 ** 8))
    wait(cache.new_state(StructuredOutputs(grammar='root ::= "' + "w" * 5000 + '"')), limit=150)  # a warm lane
    cache.timeout_s = 1.0
    large = grammar_workers.lanes()["large"]
    kills = large.kills
    slow = [cache.new_state(StructuredOutputs(json={"type": "object", "properties": {
        f"{name}{i}": {"type": "string"} for i in range(3000)}})) for name in ("p", "q")]
    t0 = time.monotonic()
    queued = wait(cache.new_state(StructuredOutputs(grammar='root ::= "' + "u" * 5000 + '"')), limit=150)
    assert queued.error is None and queued.ready
    assert time.monotonic() - t0 > 2 * cache.timeout_s  # it waited past the budget a queued request had
    for s in slow:
        wait(s)
        assert not s.ready and "grammar compilation failed: grammar compilation timed out" in s.error
    assert large.kills == kills + 2
    cache.timeout_s = 120.0


def slow_schema(name: str) -> dict:
    """About 20 s to compile here, within GrammarLimits (1,000 properties, 55 KB): a hostile spec."""
    return {"type": "object", "properties": {f"{name}{i}": {"type": "string", "pattern": "[a-f]{1,%d}" % (i + 3)}
                                             for i in range(1000)}}


def begun(state, limit=60.0):
    """Wait until a worker has begun the state's compile."""
    t0 = time.monotonic()
    while state._future.started is None:
        assert time.monotonic() - t0 < limit
        time.sleep(0.01)
    return state


def warm_large_lane(cache):
    timeout = cache.timeout_s
    cache.timeout_s = 120.0
    wait(cache.new_state(StructuredOutputs(grammar='root ::= "' + "w" * 5000 + '"')), limit=150)
    cache.timeout_s = timeout


def test_a_queued_compile_no_request_wants_is_dropped_and_a_begun_one_runs_on():
    """Requests gone before a worker began their compile: the job leaves the lane, never compiled,
    once its last holder is released (two states with one spec share one job). A compile a worker
    has begun runs on to its timeout and stays cached for a retry of its spec."""
    from detent.sampling import grammar_workers
    cache = tiny_cache(timeout_s=3.0)
    warm_large_lane(cache)
    large = grammar_workers.lanes()["large"]
    kills, dropped = large.kills, large.dropped
    running = begun(cache.new_state(StructuredOutputs(json=slow_schema("r"))))
    shared = [cache.new_state(StructuredOutputs(json=slow_schema("s"))) for _ in range(2)]
    alone = cache.new_state(StructuredOutputs(json=slow_schema("a")))
    assert shared[0]._future is shared[1]._future and large.queued() == 2
    alone.release()
    alone.release()  # idempotent
    assert alone._future.cancelled() and large.queued() == 1 and large.dropped == dropped + 1
    shared[0].release()
    assert not shared[1]._future.cancelled() and large.queued() == 1  # the other request still waits for it
    shared[1].release()
    assert shared[1]._future.cancelled() and large.queued() == 0 and large.dropped == dropped + 2
    assert alone._future.started is None and shared[0]._future.started is None  # never compiled
    assert not alone.ready and "dropped" in alone.error  # a released state polled: an error, never a raise
    again = cache.new_state(StructuredOutputs(json=slow_schema("a")))  # a dropped job left the cache
    assert again._future is not alone._future and large.queued() == 1
    again.release()
    running.release()
    assert not running._future.cancelled() and cache.submit(StructuredOutputs(json=slow_schema("r"))) is running._future
    wait(running)
    assert "timed out" in running.error and large.kills == kills + 1  # only the begun compile ran


def test_a_full_compile_lane_refuses_a_new_spec_and_nothing_else():
    """max_queued_compiles = 1: with one compile running and one waiting in the large lane, a new
    large spec is refused (naming the limit); the waiting spec again, a small spec and, once the
    waiting job is dropped, the refused spec are not."""
    from detent.sampling import grammar_workers
    from detent.sampling.grammar_limits import GrammarLimits
    cache = tiny_cache(timeout_s=3.0, limits=GrammarLimits(max_queued_compiles=1))
    warm_large_lane(cache)
    large = grammar_workers.lanes()["large"]
    running = begun(cache.new_state(StructuredOutputs(json=slow_schema("r1"))))
    queued = cache.new_state(StructuredOutputs(json=slow_schema("q1")))
    with pytest.raises(grammar_workers.CompileQueueFull,
                       match=r"1 in the large-spec lane, its limit \(max_queued_grammar_compiles = 1,"):
        cache.new_state(StructuredOutputs(json=slow_schema("x1")))
    assert isinstance(grammar_workers.CompileQueueFull("large", 1, 1), ValueError)  # refused as a bad request is
    assert large.queued() == 1
    same = cache.new_state(StructuredOutputs(json=slow_schema("q1")))  # shares the waiting job
    assert same._future is queued._future
    assert wait(cache.new_state(StructuredOutputs(regex="[0-9]+x"))).ready  # the small lane is not bounded by it
    queued.release()
    same.release()
    refused_before = cache.new_state(StructuredOutputs(json=slow_schema("x1")))  # room again
    refused_before.release()
    running.release()
    wait(running)


def test_a_schema_over_a_limit_is_refused_naming_the_limit():
    from detent.sampling.grammar_limits import GrammarLimits, check_limits
    cache = tiny_cache()
    many = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(1001)}}
    with pytest.raises(ValueError, match=r"structured_outputs.json has more than 1000 properties.*"
                                         r"max_schema_properties = 1000"):
        cache.new_state(StructuredOutputs(json=many))
    deep: dict = {"type": "string"}
    for _ in range(20):
        deep = {"type": "array", "items": deep}
    with pytest.raises(ValueError, match=r"nests deeper than 16 levels; the limit is max_schema_depth = 16"):
        check_limits(StructuredOutputs(json=deep))
    with pytest.raises(ValueError, match=r"structured_outputs.regex is \d+ bytes; the limit is max_spec_bytes = 100"):
        check_limits(StructuredOutputs(regex="a" * 200), GrammarLimits(max_spec_bytes=100))
    enum = {"type": "string", "enum": [str(i) for i in range(1001)]}
    with pytest.raises(ValueError, match=r"max_enum_values = 1000"):
        check_limits(StructuredOutputs(json=enum))
    check_limits(StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "string"}}}))
    # a reference to another document compiled as "any value" (nothing is fetched): refused, where a
    # reference inside the schema, and a property named $ref, are not
    for ref in ("http://example.com/s.json", "file:///etc/passwd", "defs.json#/x"):
        with pytest.raises(ValueError, match=r"structured_outputs.json: \$ref .* names another document"):
            check_limits(StructuredOutputs(json={"type": "object", "properties": {"a": {"$ref": ref}}}))
    check_limits(StructuredOutputs(json={"$defs": {"s": {"type": "string"}}, "type": "object",
                                         "properties": {"a": {"$ref": "#/$defs/s"}, "$ref": {"type": "integer"}}}))


def test_sampled_tokens_follow_the_grammar_to_the_end():
    """Drive a matcher with the sampler (random logits): the text fullmatches the regex."""
    import re
    cache = tiny_cache(64)
    for seed in range(10):
        st = wait(cache.new_state(StructuredOutputs(regex="[a-f]{2,4}-[0-9]{1,3}")))
        toks = []
        g = torch.Generator().manual_seed(seed)
        while not st.is_terminated():
            row = SamplingRow(SamplingParams(temperature=1.0, top_p=0.9), seed=seed, position=len(toks), grammar=st)
            t = sample(torch.randn(1, 64, generator=g) * 3, [row]).token_ids[0]
            assert st.accept(t)
            toks.append(t)
            assert len(toks) < 20
        assert toks[-1] == EOS
        assert re.fullmatch("[a-f]{2,4}-[0-9]{1,3}", decode(toks)), decode(toks)


def test_pending_reads_the_last_poll_and_never_polls():
    """`pending` is what LLMEngine.stats() reads from any thread (the "deferred" waiting requests):
    it must not build the matcher itself, which only the step thread's `ready` does."""
    from concurrent.futures import Future

    from detent.sampling.grammar import GrammarState
    done = tiny_cache().new_state(StructuredOutputs(choice=["yes", "no"]))
    wait(done)
    fut = Future()
    st = GrammarState(fut, V, timeout_s=30)
    assert st.pending and not st.ready
    fut.set_result(done._future.result())
    assert st.pending  # compiled, but not polled yet
    assert st.ready and not st.pending
    failed = GrammarState(Future(), V, timeout_s=30)
    failed._future.set_exception(RuntimeError("bad grammar"))
    assert not failed.ready and not failed.pending
