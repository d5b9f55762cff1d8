"""Unit tests of server pieces, in process (no sockets)."""
from __future__ import annotations

import asyncio
import time

import pytest
from pydantic import ValidationError

from fake_engine import FakeEngine

from detent.sampling.params import SamplingParams
from detent.server.async_engine import AsyncEngine
from detent.server.errors import APIError, EngineDead, validation_error
from detent.server.formatting import ChoiceDelta
from detent.server.metrics import kv_usage
from detent.server.params import resolve_max_tokens, structured_outputs
from detent.server.protocol import ChatCompletionRequest, CompletionRequest


def test_stop_holdback_never_streams_a_dropped_stop_prefix():
    d = ChoiceDelta(["END"], include_stop=False)
    got = [d.next("abc", 1, False)[0], d.next("abcE", 2, False)[0], d.next("abcEN", 3, False)[0]]
    got.append(d.next("abc", 4, True)[0])  # the stop string completed: the final text drops it
    assert "".join(got) == "abc" and got[0] == "a"
    d = ChoiceDelta(["END"], include_stop=False)
    assert "".join([d.next("xyEz", 1, False)[0], d.next("xyEzq", 2, False)[0], d.next("xyEzqr", 3, True)[0]]) == "xyEzqr"
    d = ChoiceDelta([], include_stop=False)
    assert d.next("ab", 1, False) == ("ab", 0, 1)


def test_union_type_error_reported_once_naming_field():
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": 5})
    err = validation_error(e.value)
    assert err.status == 400 and err.param == "prompt"
    assert err.message.count("prompt") == 1 and "got 5" in err.message
    with pytest.raises(ValidationError) as e:
        CompletionRequest.model_validate({"prompt": "x", "max_tokens": "5", "temperature": True})
    err = validation_error(e.value)
    assert "max_tokens" in err.message and "temperature" in err.message


def test_max_tokens_against_context():
    assert resolve_max_tokens(None, 10, 100, "max_tokens") == 90
    with pytest.raises(APIError, match="maximum context length is 100 tokens"):
        resolve_max_tokens(5, 100, 100, "max_tokens")
    with pytest.raises(APIError, match=r"you requested 101 tokens \(10 in the prompt, 91"):
        resolve_max_tokens(91, 10, 100, "max_tokens")


def test_structured_outputs_sources():
    """Each source of a constraint; the spec is validated on the preprocessing pool, off the loop."""
    ran = []

    class Pool:
        async def run(self, fn, *args):
            ran.append(fn.__name__)
            return await asyncio.to_thread(fn, *args)

    def so(req):
        return asyncio.run(structured_outputs(req, Pool()))
    req = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                "response_format": {"type": "json_schema", "json_schema": {
                                                    "name": "a", "schema": {"type": "object"}}}})
    assert so(req).json == {"type": "object"}
    req = CompletionRequest.model_validate({"prompt": "x", "structured_outputs": {"choice": ["a", "b"]}})
    assert so(req).choice == ["a", "b"]
    req = CompletionRequest.model_validate({"prompt": "x", "guided_regex": "[", "top_k": 3})
    with pytest.raises(APIError) as e:
        so(req)
    assert e.value.param == "guided_regex"
    assert so(CompletionRequest.model_validate({"prompt": "x"})) is None
    assert ran == ["checked_spec"] * 3  # every spec on the pool; no hop without one


def test_kv_usage_from_stats():
    assert kv_usage({"kv_cache_usage": 0.25}) == 0.25
    assert kv_usage({"num_total_blocks": 10, "num_free_blocks": 10}) == 0.0
    assert kv_usage({"num_total_blocks": 10, "num_free_blocks": 4}) == 0.6


def _sp(**kw):
    return SamplingParams(temperature=0, **kw)


def test_async_engine_abort_on_early_exit_frees_blocks():
    eng = FakeEngine(step_s=0.001)

    async def main():
        ae = AsyncEngine(eng)
        ae.start(asyncio.get_running_loop())
        stream = await ae.add("a", [5, 6, 7], _sp(max_tokens=300))
        n = 0
        async for out in stream:
            n += 1
            if n == 3:
                break
        await stream.aclose()
        for _ in range(200):
            if not eng.running and eng.used_blocks == 0:
                break
            await asyncio.sleep(0.01)
        done = [o async for o in await ae.add("b", [5], _sp(max_tokens=3))]
        ae.shutdown()
        return done

    done = asyncio.run(main())
    assert eng.aborted == ["a"] and eng.used_blocks == 0
    assert done[-1].finished and len(done[-1].outputs[0].token_ids) == 3


def test_async_engine_refusal_and_death():
    class Broken(FakeEngine):
        def step(self):
            raise RuntimeError("boom")

    async def main():
        ae = AsyncEngine(Broken(max_model_len=8))
        ae.start(asyncio.get_running_loop())
        with pytest.raises(APIError, match="max_model_len"):
            await ae.add("long", list(range(20)), _sp())
        stream = await ae.add("x", [1, 2], _sp())
        with pytest.raises(EngineDead, match="boom"):
            async for _ in stream:
                pass
        assert not ae.running
        with pytest.raises(EngineDead):
            await ae.add("y", [1], _sp())
        ae.shutdown()

    asyncio.run(main())


def test_a_full_grammar_compile_lane_is_a_503_with_retry_after():
    """The engine refuses a structured request when its compile lane is full (CompileQueueFull, a
    ValueError): the server answers 503 `overloaded` with Retry-After, as over --max-queue-len,
    not 400; in process and from the engine core's process (its "rejected" says busy)."""
    import multiprocessing as mp
    import threading

    from detent.engine import CompileQueueFull
    from detent.engine.core_process import _loop
    from detent.server.async_engine import AsyncCoreEngine

    class Busy(FakeEngine):
        def add_request(self, request_id, prompt_token_ids, sampling_params) -> None:
            if request_id == "full":
                raise CompileQueueFull("large", 64, 64)
            super().add_request(request_id, prompt_token_ids, sampling_params)

    def check(e: APIError) -> None:
        assert e.status == 503 and e.body()["error"]["code"] == "overloaded", e.body()
        assert e.headers["Retry-After"] == "1" and e.param == "structured_outputs"
        assert "--max-queued-grammar-compiles" in e.message

    async def in_process():
        ae = AsyncEngine(Busy())
        ae.start(asyncio.get_running_loop())
        with pytest.raises(APIError) as e:
            await ae.add("full", [5], _sp())
        check(e.value)
        with pytest.raises(APIError) as e:  # a bad request is still a 400
            await ae.add("long", list(range(600)), _sp())
        assert e.value.status == 400
        ae.shutdown()

    asyncio.run(in_process())

    parent, child = mp.Pipe()
    core = threading.Thread(target=_loop, args=(child, Busy()), daemon=True)
    core.start()
    answers = []
    for rid, ids in (("full", [5]), ("long", list(range(600)))):
        parent.send(("add", rid, ids, _sp()))
        msg = parent.recv()
        while msg[0] == "out":  # the core's stats
            msg = parent.recv()
        answers.append(msg)
    parent.send(("stop",))
    core.join(10)
    full, long = answers
    assert full[:2] == ("rejected", "full") and long[:2] == ("rejected", "long")
    assert full[3] is True and long[3] is False

    async def from_core():
        ae = AsyncCoreEngine(None)
        ae._loop = asyncio.get_running_loop()
        futs = {rid: ae._loop.create_future() for rid in ("full", "long")}
        ae._admitting.update(futs)
        ae._on_loop(full)
        ae._on_loop(long)
        check(futs["full"].exception())
        assert futs["long"].exception().status == 400

    asyncio.run(from_core())


class _Compiling(FakeEngine):
    """A fake whose requests wait `hold` seconds (as on a grammar compile) before they run: its
    steps return nothing meanwhile, and `stalled` says so, as LLMEngine.stalled does."""

    def __init__(self, hold: float):
        super().__init__(step_s=0.0)
        self.until, self.steps = time.monotonic() + hold, 0

    def step(self):
        self.steps += 1
        return [] if time.monotonic() < self.until else super().step()

    def stalled(self, outputs) -> bool:
        return not outputs and not self.running


def test_the_step_loops_wait_while_only_grammar_compiles_are_pending():
    """The server's step loops (in process, and the engine core's) stepped back to back while
    their only request waited on a grammar compile, taking a core (and the GIL from the
    compile's thread): here some 10^5 empty steps in 0.3 s. After a step that stalled they wait
    1 ms on their commands (a new request still wakes them at once)."""
    import multiprocessing as mp
    import threading

    from detent.engine.core_process import _loop

    async def in_process(eng):
        ae = AsyncEngine(eng)
        ae.start(asyncio.get_running_loop())
        outs = [o async for o in await ae.add("a", [5, 6], _sp(max_tokens=3))]
        ae.shutdown()
        return outs

    eng = _Compiling(0.3)
    t0 = time.monotonic()
    outs = asyncio.run(in_process(eng))
    wall = time.monotonic() - t0
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    assert eng.steps <= wall * 1000 + 10, (eng.steps, wall)

    eng = _Compiling(0.3)
    parent, child = mp.Pipe()
    core = threading.Thread(target=_loop, args=(child, eng), daemon=True)
    t0 = time.monotonic()
    core.start()
    parent.send(("add", "a", [5, 6], _sp(max_tokens=3)))
    while True:
        msg = parent.recv()
        if msg[0] == "out" and msg[1]:
            if eng.steps and not eng.has_unfinished_requests():
                break
    wall = time.monotonic() - t0
    parent.send(("stop",))
    core.join(10)
    assert eng.steps <= wall * 1000 + 10, (eng.steps, wall)


def test_cli_flags(monkeypatch):
    from detent.server.cli import parse_args
    monkeypatch.setenv("DETENT_API_KEY", "from-env")
    a = parse_args([])
    assert (a.api_key, a.host, a.port, a.selection, a.tp) == ("from-env", "127.0.0.1", 8000, "pinned", 1)
    assert parse_args(["--api-key", "flag"]).api_key == "flag"
    a = parse_args(["--served-model-name", "a", "b", "--max-queue-len", "0", "--tuple", "t.json"])
    assert a.served_model_name == ["a", "b"] and a.max_queue_len == 0 and a.tuple == "t.json"
    for bad in (["--max-request-bytes", "0"], ["--tp", "0"], ["--selection", "fast"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_scheduling_flags_reach_the_engine_config():
    from detent.engine.config import EngineConfig
    from detent.server.cli import engine_kwargs, parse_args
    kw = engine_kwargs(parse_args(["--mixed-token-align", "1024", "--max-mixed-batched-tokens", "0"]))
    assert kw["mixed_token_align"] == 1024 and kw["max_mixed_batched_tokens"] is None
    cfg = EngineConfig(**{k: kw[k] for k in ("mixed_token_align", "max_mixed_batched_tokens")})
    assert cfg.mixed_token_align == 1024
    assert "mixed_token_align" not in engine_kwargs(parse_args([]))  # the engine's default
    assert EngineConfig().mixed_token_align == 1024
    off = engine_kwargs(parse_args(["--mixed-token-align", "0"]))
    assert off["mixed_token_align"] is None and EngineConfig(mixed_token_align=None).mixed_token_align is None
    with pytest.raises(SystemExit):
        parse_args(["--mixed-token-align", "-1"])


def test_grammar_compile_queue_flag_reaches_the_engine_config():
    """--max-queued-grammar-compiles (64; 0: no bound) -> EngineConfig.max_queued_grammar_compiles."""
    from detent.engine.config import EngineConfig
    from detent.server.cli import engine_kwargs, parse_args
    assert engine_kwargs(parse_args([]))["max_queued_grammar_compiles"] == 64
    kw = engine_kwargs(parse_args(["--max-queued-grammar-compiles", "3"]))
    assert EngineConfig(max_queued_grammar_compiles=kw["max_queued_grammar_compiles"]).max_queued_grammar_compiles == 3
    assert engine_kwargs(parse_args(["--max-queued-grammar-compiles", "0"]))["max_queued_grammar_compiles"] is None
    assert EngineConfig().max_queued_grammar_compiles is None  # offline: no bound
    with pytest.raises(SystemExit):
        parse_args(["--max-queued-grammar-compiles", "-1"])
    with pytest.raises(ValueError, match="max_queued_grammar_compiles"):
        EngineConfig(max_queued_grammar_compiles=0)


def test_block_size_flag_reaches_the_engine_config():
    from detent.engine.config import EngineConfig
    from detent.server.cli import engine_kwargs, parse_args
    kw = engine_kwargs(parse_args(["--block-size", "128"]))
    assert EngineConfig(block_size=kw["block_size"]).block_size == 128
    assert "block_size" not in engine_kwargs(parse_args([])) and EngineConfig().block_size == 16
    with pytest.raises(SystemExit):
        parse_args(["--block-size", "0"])


def test_mixed_graph_flag_reaches_the_engine_config():
    from detent.engine.config import EngineConfig
    from detent.server.cli import engine_kwargs, parse_args
    kw = engine_kwargs(parse_args(["--mixed-graph-max-tokens", "512"]))
    assert EngineConfig(mixed_graph_max_tokens=kw["mixed_graph_max_tokens"]).mixed_graph_max_tokens == 512
    assert "mixed_graph_max_tokens" not in engine_kwargs(parse_args([]))  # default: the config's
    assert EngineConfig().mixed_graph_max_tokens == 2048  # on (docs/performance.md, lease 12)
    assert engine_kwargs(parse_args(["--mixed-graph-max-tokens", "0"]))["mixed_graph_max_tokens"] == 0
    for bad in ("-1", "8", "4096"):
        with pytest.raises(SystemExit):
            parse_args(["--mixed-graph-max-tokens", bad])
    with pytest.raises(ValueError, match="mixed_graph_max_tokens"):
        EngineConfig(mixed_graph_max_tokens=True)
    with pytest.raises(ValueError, match="16 .. 2048"):
        EngineConfig(mixed_graph_max_tokens=4096)  # never silently capped
    assert EngineConfig(mixed_graph_max_tokens=2048).mixed_graph_max_tokens == 2048
    from detent.engine.mixed_graph import graph_pairs
    ts = [t for t, _ in graph_pairs(10 ** 6, 256, 10 ** 6)]
    assert (min(ts), max(ts)) == (16, 2048)  # the bounds the checks name
