"""The engine core in its own process.

A server's HTTP work (parsing, tokenizing, SSE writes, JSON) and the engine's
step loop are both Python. In one process they share the GIL: under load the
step loop was runnable but not running for 9-25% of its time, waiting for the
event loop (docs/performance.md, "Serving under load"). So, as vLLM's
`EngineCore` does, the step loop runs in a child process: it owns the
`LLMEngine` (model, scheduler, KV cache, detokenizer) and nothing else, and
talks to the server over one duplex pipe.

    server process                     core process
    add(rid, ids, params)   ─────────▶ engine.add_request  ─▶ "admitted" | "rejected" (busy or not)
    abort(rid)              ─────────▶ engine.abort_request
                            ◀───────── "out": OutputDeltas of one step, step time, stats
    stop()                  ─────────▶ leave the loop, engine.shutdown(), exit

Outputs are cumulative in the engine's API; across the pipe only what is new
travels (`OutputDelta`: new token ids, new logprobs, new text), and
`DeltaDecoder` rebuilds the cumulative `RequestOutput` on the server's side,
so a request's cost per step stays O(new tokens) on the wire.

The core does nothing on SIGINT and SIGTERM: the server decides when it stops
(after draining). It exits when the pipe closes, so a server killed with SIGKILL
leaves no core behind.
"""
from __future__ import annotations

import atexit
import gc
import logging
import multiprocessing as mp
import pickle
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable

from detent.engine.outputs import CompletionOutput, RequestOutput
from detent.sampling.grammar_workers import CompileQueueFull

log = logging.getLogger("detent.engine.core")

STATS_EVERY_S = 0.1  # stats ride along with outputs at most this often (and when idle)
SLOW_STEP_S = 10.0  # a step that takes longer is logged (what it carried): on any machine something is wrong


@dataclass(frozen=True)
class SampleDelta:
    index: int
    text_keep: int  # the text is text[:text_keep] + text_add (a stop string can cut it back)
    text_add: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: Any
    seed: int | None


@dataclass(frozen=True)
class OutputDelta:
    request_id: str
    finished: bool
    samples: tuple[SampleDelta, ...]
    prompt: str | None = None  # first delta only
    prompt_token_ids: tuple[int, ...] | None = None  # first delta only
    prompt_logprobs: list | None = None  # once complete
    num_cached_tokens: int = 0
    metrics: Any = None
    error: str | None = None


class DeltaEncoder:
    """Core side: cumulative RequestOutputs -> what the server has not seen yet."""

    def __init__(self):
        self.sent: dict[str, dict[int, tuple[int, int, str]]] = {}  # rid -> index -> (tokens, logprobs, text)
        self.prompt_sent: set[str] = set()

    def encode(self, out: RequestOutput) -> OutputDelta:
        rid = out.request_id
        seen = self.sent.setdefault(rid, {})
        samples = []
        for c in out.outputs:
            nt, nl, text = seen.get(c.index, (0, 0, ""))
            keep = len(text) if c.text.startswith(text) else _common_prefix(text, c.text)
            lps = c.logprobs
            samples.append(SampleDelta(c.index, keep, c.text[keep:], tuple(c.token_ids[nt:]),
                                       None if lps is None else tuple(lps[nl:]), c.cumulative_logprob,
                                       c.finish_reason, c.stop_reason, c.seed))
            seen[c.index] = (len(c.token_ids), len(lps) if lps is not None else 0, c.text)
        first = rid not in self.prompt_sent
        plp = out.prompt_logprobs if (out.prompt_logprobs is not None and (first or out.finished)) else None
        self.prompt_sent.add(rid)
        if out.finished:
            self.sent.pop(rid, None)
            self.prompt_sent.discard(rid)
        return OutputDelta(rid, out.finished, tuple(samples),
                           out.prompt if first else None,
                           tuple(out.prompt_token_ids) if first else None,
                           plp, out.num_cached_tokens, out.metrics, out.error)


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class DeltaDecoder:
    """Server side: OutputDeltas -> cumulative RequestOutputs (new objects each time)."""

    def __init__(self):
        self.outs: dict[str, RequestOutput] = {}

    def decode(self, d: OutputDelta) -> RequestOutput:
        prev = self.outs.get(d.request_id)
        by_index = {c.index: c for c in prev.outputs} if prev is not None else {}
        outs = []
        for s in d.samples:
            c = by_index.get(s.index)
            text = (c.text[:s.text_keep] if c is not None else "") + s.text_add
            ids = (c.token_ids if c is not None else []) + list(s.new_token_ids)
            lps = None
            if s.new_logprobs is not None:
                lps = ((c.logprobs or []) if c is not None else []) + list(s.new_logprobs)
            outs.append(CompletionOutput(s.index, text, ids, s.cumulative_logprob, lps, s.finish_reason,
                                         s.stop_reason, s.seed))
        plp = d.prompt_logprobs if d.prompt_logprobs is not None else (prev.prompt_logprobs if prev else None)
        out = RequestOutput(
            request_id=d.request_id,
            prompt=d.prompt if prev is None else prev.prompt,
            prompt_token_ids=list(d.prompt_token_ids) if prev is None else prev.prompt_token_ids,
            prompt_logprobs=plp, outputs=outs, finished=d.finished, num_cached_tokens=d.num_cached_tokens,
            metrics=d.metrics, error=d.error)
        if d.finished:
            self.outs.pop(d.request_id, None)
        else:
            self.outs[d.request_id] = out
        return out

    def forget(self, request_id: str) -> None:
        self.outs.pop(request_id, None)


# ---------------------------------------------------------------- the core process
@dataclass(frozen=True)
class CoreInfo:
    """What the server needs to know of the engine it did not build."""
    fingerprint: Any  # engine.fingerprint(): the tuple and deployment hashes
    limits: Any  # engine.limits(): max_model_len, vocab_size, ...


def _ignore(signum, frame) -> None:
    """The server decides when the core stops. A Python handler rather than SIG_IGN:
    an ignored signal stays ignored in processes the core starts (grammar compile
    workers, TP ranks), which then survive the terminate() of an orderly exit."""


def _core_main(conn, build: Callable[[], Any]) -> None:
    signal.signal(signal.SIGINT, _ignore)
    signal.signal(signal.SIGTERM, _ignore)
    try:
        engine = build()
        info = CoreInfo(engine.fingerprint(), engine.limits())
    except BaseException as e:  # noqa: BLE001  (refuse startup with the reason)
        conn.send(("failed", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    freeze_startup_heap()
    conn.send(("ready", info))
    try:
        _loop(conn, engine)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass  # the server is gone
    except BaseException as e:  # noqa: BLE001  (report, then die: the server answers 503)
        try:
            conn.send(("dead", f"{type(e).__name__}: {e}", traceback.format_exc()))
        except OSError:
            pass
    finally:
        stop = getattr(engine, "shutdown", None)
        if stop is not None:
            stop()


def freeze_startup_heap() -> None:
    """Leave what startup built (modules, the model's objects: about 200k with torch and
    transformers imported) out of every later garbage collection. A full collection scans them
    all: 114 ms on a 2-core CPU, a stall of the step loop whenever one comes, and under load
    with logprobs one came every few dozen steps (docs/performance.md, "Host time per step").
    The server does this after startup too; an offline LLM leaves its caller's heap alone."""
    gc.collect()
    gc.freeze()
    # thawed at exit, so that the interpreter's last collection frees them (nanobind's
    # extensions, xgrammar's, report what is still alive then as leaks)
    atexit.register(gc.unfreeze)


def _call(fn: Callable, engine: Any, args: tuple) -> tuple[bool, Any]:
    try:
        return True, fn(engine, *args)
    except Exception as e:  # noqa: BLE001  (the caller gets the error; the core goes on)
        try:
            pickle.dumps(e)
        except Exception:  # noqa: BLE001
            e = RuntimeError(f"{type(e).__name__}: {e}")
        return False, e


def _loop(conn, engine) -> None:
    enc = DeltaEncoder()
    last_stats = 0.0
    warned_idle = False
    if getattr(engine, "outputs", None) is not None:  # each step's outputs are encoded before the next step
        engine.outputs.share_lists = True
    host = getattr(engine, "host_seconds", None)  # the step loop's host time, by part (LLMEngine)
    stalled = getattr(engine, "stalled", lambda outs: False)
    idle_step = False  # the last step stalled: wait on the pipe 1 ms rather than step again at once
    while True:
        busy = engine.has_unfinished_requests()
        timeout = (0.001 if idle_step else 0.0) if busy else 0.5
        idle_step = False
        while conn.poll(timeout):
            t_in = time.perf_counter()
            msg = conn.recv()
            kind = msg[0]
            if kind == "add":
                _, rid, ids, params = msg
                try:
                    engine.add_request(rid, ids, params)
                except (ValueError, TypeError, NotImplementedError) as e:
                    # the last field: refused because the engine is busy, not for the request
                    # (a full grammar compile lane: the server answers 503, not 400)
                    conn.send(("rejected", rid, str(e), isinstance(e, CompileQueueFull)))
                else:
                    conn.send(("admitted", rid))
            elif kind == "abort":
                engine.abort_request(msg[1])
            elif kind == "call":  # fn(engine, *args) between steps (e.g. a weight update)
                conn.send(("result", msg[1], *_call(msg[2], engine, msg[3])))
            elif kind == "stop":
                return
            if busy and host is not None:  # taking requests in while others run
                host["ipc_in"] += time.perf_counter() - t_in
            timeout = 0.0
        if engine.has_unfinished_requests():
            t0 = time.perf_counter()
            outs = engine.step()
            dt = time.perf_counter() - t0
            idle_step = stalled(outs)
            if dt > SLOW_STEP_S:
                log.warning("engine step took %.1f s; %s", dt, _held(engine))
            now = time.monotonic()
            stats = None
            if now - last_stats >= STATS_EVERY_S:
                stats, last_stats = engine.stats(), now
            if outs or stats is not None:
                t_out = time.perf_counter()
                conn.send(("out", [enc.encode(o) for o in outs], dt, stats))
                if host is not None:
                    host["ipc_out"] += time.perf_counter() - t_out
        else:
            held = getattr(getattr(engine, "scheduler", None), "requests", None)
            if held and not warned_idle:  # the engine says it has nothing to do, yet its scheduler holds requests
                log.error("engine idle with requests in its scheduler; %s", _held(engine))
            warned_idle = bool(held)
            conn.send(("out", [], None, engine.stats()))
            last_stats = time.monotonic()


def _held(engine) -> str:
    """The scheduler's requests and their counters, for a log line (the first 8)."""
    sch = getattr(engine, "scheduler", None)
    if sch is None:
        return "no scheduler to show"
    reqs = list(sch.requests.values())
    shown = ", ".join(f"{r.request_id} {r.status.value} computed={r.num_computed_tokens} tokens={r.num_tokens} "
                      f"pending={r.num_pending} blocks={len(r.block_ids)}" for r in reqs[:8])
    return f"{len(reqs)} request(s) held: {shown or '-'}; running {len(sch.running)}, waiting {len(sch.waiting)}"


class CoreProcess:
    """Server side of the pipe: start the core, send it commands, receive its messages.

    `build` is a picklable callable (a module-level function or a
    functools.partial of one) that returns the engine inside the child."""

    def __init__(self, build: Callable[[], Any]):
        ctx = mp.get_context("spawn")  # never fork a process that holds CUDA or threads
        self.conn, child = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_core_main, args=(child, build), name="detent-core", daemon=False)
        self.proc.start()
        child.close()
        self.info: CoreInfo | None = None

    def wait_ready(self, timeout: float | None = None) -> CoreInfo:
        """Blocks until the engine is built; raises RuntimeError with the core's reason if it failed."""
        if not self.conn.poll(timeout):
            self.kill()
            raise RuntimeError(f"the engine core did not start within {timeout} s")
        try:
            msg = self.conn.recv()
        except EOFError:
            self.proc.join(5)
            raise RuntimeError(f"the engine core exited during startup (exit code {self.proc.exitcode})") from None
        if msg[0] == "failed":
            self.proc.join(10)
            log.debug("engine core startup failure:\n%s", msg[2])
            raise RuntimeError(msg[1])
        self.info = msg[1]
        return self.info

    def send(self, *msg) -> None:
        self.conn.send(msg)

    def recv(self):
        return self.conn.recv()

    def stop(self, timeout: float = 30.0) -> None:
        try:
            self.conn.send(("stop",))
        except OSError:
            pass
        self.proc.join(timeout)
        if self.proc.is_alive():
            log.error("the engine core did not stop within %.0f s; killing it", timeout)
            self.kill()
        self.conn.close()

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.is_alive()


def build_engine(**llm_kwargs) -> Any:
    """The default `build`: the LLMEngine that `LLM(**llm_kwargs)` would run."""
    from detent.engine.llm import LLM
    return LLM(**llm_kwargs).llm_engine

