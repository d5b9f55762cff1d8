"""The engine's step loop, fanned out to asyncio streams.

HTTP handlers run on the event loop and never call the engine. Two ways to
run the step loop share this interface (`add`, `cancel`, `stats`, `running`):

- `AsyncCoreEngine` (what `detent-serve` runs): the engine core in its own
  process (engine/core_process.py). The step loop then never waits for the
  GIL that HTTP work holds. A reader thread here receives each step's output
  deltas and hands them to the event loop in one call per step.
- `AsyncEngine`: `LLMEngine.step()` in one background thread of this
  process (tests with a fake engine, and `--no-engine-process`). Handlers
  talk to it through a command deque (add, abort) and a wake event.

Either way each step's outputs reach the request's `asyncio.Queue` with
`loop.call_soon_threadsafe`. Outputs are cumulative (the engine's contract),
so a consumer that falls behind only needs the newest one: `_outputs`
coalesces its queue.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import threading
import time
import traceback
from typing import Any, AsyncIterator

from detent.engine import CompileQueueFull
from detent.server.errors import APIError, CompilesOverloaded, EngineDead, Overloaded, engine_refusal

log = logging.getLogger("detent.server")
CORE_SILENT_S = 5.0  # the core sends at least its stats every 0.5 s: this long without a message is logged


def short_reason(why: str, limit: int = 300) -> str:
    """The first line of an engine failure, bounded: what /health and 503s say
    (the whole traceback goes to the log, never to clients)."""
    line = (why or "").strip().splitlines()[0] if (why or "").strip() else "unknown error"
    return line if len(line) <= limit else line[:limit] + "..."


class AsyncEngine:
    def __init__(self, engine: Any, *, max_queue_len: int | None = None):
        self.engine = engine
        self._stalled = getattr(engine, "stalled", lambda outputs: False)  # LLMEngine.stalled
        self.max_queue_len = max_queue_len
        self._cmds: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._streams: dict[str, asyncio.Queue] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop = False
        self._lock = threading.Lock()
        self._pending_adds = 0
        self.dead: str | None = None
        self.steps = 0
        self.step_times: collections.deque = collections.deque(maxlen=4096)  # seconds, for /metrics
        # per-request metrics (server/request_stats.py: begin / step / ended / forget), or None
        self.observer: Any = None
        self._stats: dict[str, Any] = self._read_stats()

    # ---- lifecycle (event loop side) ----
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="detent-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stops the step loop, then the engine's own workers (TP ranks, grammar threads)."""
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                log.error("the engine thread did not stop within %.0f s; not shutting the engine down", timeout)
                return
        stop = getattr(self.engine, "shutdown", None)
        if stop is not None:
            stop()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead is None

    def stats(self) -> dict[str, Any]:
        """A snapshot taken by the engine thread after its latest step."""
        out = dict(self._stats)
        out["num_pending"] = self._pending_adds
        out["num_streams"] = len(self._streams)
        return out

    def queued(self) -> int:
        return int(self._stats.get("num_waiting", 0)) + self._pending_adds

    # ---- requests (event loop side) ----
    def check_admission(self) -> None:
        if self.dead is not None:
            raise EngineDead(self.dead)
        if not self.running:
            raise EngineDead("the engine thread is not running")
        if self.max_queue_len is not None and self.queued() >= self.max_queue_len:
            raise Overloaded(self.queued(), self.max_queue_len)

    async def add(self, request_id: str, prompt_token_ids: list[int], params: Any) -> AsyncIterator[Any]:
        """Admits the request (raising its 400/503 here, before any response
        starts) and returns the stream of its cumulative outputs."""
        self.check_admission()
        if request_id in self._streams:
            raise APIError(400, f"request id {request_id!r} is already in use", param="request_id")
        q: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = q
        if self.observer is not None:  # before the engine sees it: its first output may come before we resume
            self.observer.begin(request_id, len(prompt_token_ids), params)
        admitted = asyncio.get_running_loop().create_future()
        with self._lock:
            self._pending_adds += 1
        try:
            # a tuple (the pool's HashedPrompt: its blocks' hashes travel with it) cannot change: kept
            ids = prompt_token_ids if isinstance(prompt_token_ids, tuple) else list(prompt_token_ids)
            self._submit(request_id, ids, params, admitted)
            await admitted
        except BaseException:  # refused, or the caller was cancelled while waiting
            self._streams.pop(request_id, None)
            if self.observer is not None:
                self.observer.forget(request_id)
            self.abort(request_id)  # harmless if it never reached the engine
            raise
        finally:
            self._admission_done(request_id)
        return self._outputs(request_id, q)

    def _submit(self, request_id: str, ids: list[int], params: Any, admitted: asyncio.Future) -> None:
        """Hand the request to the step loop; `admitted` resolves when the engine took or refused it."""
        self._cmds.append(("add", request_id, ids, params, admitted))
        self._wake.set()

    def _admission_done(self, request_id: str) -> None:
        """After admission (the thread counts its pending adds itself)."""

    async def _outputs(self, request_id: str, q: asyncio.Queue) -> AsyncIterator[Any]:
        finished = False
        try:
            while True:
                item = await q.get()
                while not q.empty() and not isinstance(item, BaseException):
                    item = q.get_nowait()
                if isinstance(item, BaseException):
                    finished = isinstance(item, EngineDead)  # a dead engine has nothing left to abort
                    raise item
                finished = bool(item.finished)
                yield item
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)
            self._ended(request_id, aborted=not finished)

    def _ended(self, request_id: str, aborted: bool) -> None:
        """The stream is closed: an unfinished request counts as aborted (a no-op for one
        the metrics saw finish); a dead engine's requests are not counted."""
        if self.observer is not None:
            (self.observer.ended if aborted else self.observer.forget)(request_id)

    async def call(self, fn: Any, *args: Any) -> Any:
        """`fn(engine, *args)` where the engine lives (here: a worker thread; the
        engine serializes it with its steps), e.g. a weight update."""
        return await asyncio.to_thread(fn, self.engine, *args)

    def end_streams(self, why: str) -> None:
        """On the event loop: end every open stream with a 503 (`why`) and abort its
        request; an SSE response then sends the error event and [DONE] and closes."""
        for q in self._streams.values():
            q.put_nowait(APIError(503, why, code="shutting_down"))

    def cancel(self, request_id: str) -> None:
        """Stops delivering to a request's stream and aborts it in the engine (idempotent)."""
        if self._streams.pop(request_id, None) is not None:
            self.abort(request_id)
            self._ended(request_id, aborted=True)

    def abort(self, request_id: str) -> None:
        self._cmds.append(("abort", request_id))
        self._wake.set()

    # ---- the engine thread ----
    def _deliver(self, request_id: str, item: Any) -> None:
        q = self._streams.get(request_id)
        if q is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(q.put_nowait, item)

    def _fan_out(self, outputs: list[Any]) -> None:
        """On the event loop: each output to its request's queue (gone requests are skipped)."""
        if self.observer is not None:
            self.observer.step(outputs)
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is not None:
                q.put_nowait(out)

    def _resolve(self, fut: asyncio.Future, error: BaseException | None) -> None:
        def set_() -> None:
            if fut.done():
                return
            if error is None:
                fut.set_result(None)
            else:
                fut.set_exception(error)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(set_)

    def _apply_commands(self) -> None:
        while self._cmds:
            cmd = self._cmds.popleft()
            if cmd[0] == "add":
                _, rid, ids, params, admitted = cmd
                with self._lock:
                    self._pending_adds -= 1
                if rid not in self._streams:  # the client left before admission
                    continue
                try:
                    self.engine.add_request(rid, ids, params)
                except CompileQueueFull as e:  # the server is busy, the request is fine
                    self._resolve(admitted, CompilesOverloaded(str(e)))
                except (ValueError, TypeError, NotImplementedError) as e:
                    self._resolve(admitted, engine_refusal(e))
                else:
                    self._resolve(admitted, None)
            else:
                try:
                    self.engine.abort_request(cmd[1])
                except (KeyError, ValueError):
                    pass  # finished or never admitted

    def _read_stats(self) -> dict[str, Any]:
        try:
            return dict(self.engine.stats())
        except Exception as e:  # stats must never take the server down
            return {"stats_error": repr(e)}

    def _run(self) -> None:
        try:
            while not self._stop:
                self._apply_commands()
                if self.engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    outputs = self.engine.step()
                    self.step_times.append(time.perf_counter() - t0)
                    self.steps += 1
                    if outputs and self._loop is not None:  # one wake-up of the event loop per step
                        self._loop.call_soon_threadsafe(self._fan_out, outputs)
                    elif self._stalled(outputs):  # only grammar compiles pending: a command still wakes it
                        self._wake.wait(0.001)
                        self._wake.clear()
                else:
                    self._wake.wait(0.5)
                    self._wake.clear()
                self._stats = self._read_stats()
        except BaseException as e:  # the engine is broken: fail every request, report unhealthy
            self.dead = short_reason(f"{type(e).__name__}: {e}")
            log.error("engine step loop died:\n%s", traceback.format_exc())
            for rid in list(self._streams):
                self._deliver(rid, EngineDead(self.dead))
            while self._cmds:
                cmd = self._cmds.popleft()
                if cmd[0] == "add":
                    self._resolve(cmd[4], EngineDead(self.dead))


class AsyncCoreEngine(AsyncEngine):
    """The same streams over an engine core in its own process (`CoreProcess`).

    Commands go down the core's pipe from the event loop (a send is a few µs);
    a reader thread receives "admitted"/"rejected" answers and each step's
    output deltas, rebuilds cumulative outputs (`DeltaDecoder`) and wakes the
    loop once per message."""

    def __init__(self, core: Any, *, max_queue_len: int | None = None):
        super().__init__(None, max_queue_len=max_queue_len)
        from detent.engine import DeltaDecoder
        self.core = core
        self._decoder = DeltaDecoder()
        self._admitting: dict[str, asyncio.Future] = {}
        self._calls: dict[int, asyncio.Future] = {}
        self._call_ids = itertools.count()
        self._stats = {}

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._read, name="detent-core-reader", daemon=True)
        self._thread.start()

    @property
    def running(self) -> bool:
        return super().running and self.core.alive()

    def _submit(self, request_id: str, ids: list[int], params: Any, admitted: asyncio.Future) -> None:
        self._admitting[request_id] = admitted
        self.core.send("add", request_id, ids, params)

    def _admission_done(self, request_id: str) -> None:
        if self._admitting.pop(request_id, None) is not None:
            with self._lock:
                self._pending_adds -= 1

    async def call(self, fn: Any, *args: Any) -> Any:
        """`fn(engine, *args)` in the core process, between two steps; its result or its error."""
        if self.dead is not None:
            raise EngineDead(self.dead)
        cid = next(self._call_ids)
        fut = asyncio.get_running_loop().create_future()
        self._calls[cid] = fut
        try:
            self.core.send("call", cid, fn, args)
            return await fut
        finally:
            self._calls.pop(cid, None)

    def abort(self, request_id: str) -> None:
        self._decoder.forget(request_id)
        if self.dead is None:
            try:
                self.core.send("abort", request_id)
            except OSError:
                pass

    def shutdown(self, timeout: float = 30.0) -> None:
        self._stop = True
        self.core.stop(timeout)
        if self._thread is not None:
            self._thread.join(5)

    # ---- the reader thread ----
    def _on_loop(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "out":
            _, deltas, dt, stats = msg
            if dt is not None:
                self.step_times.append(dt)
                self.steps += 1
            if stats is not None:
                self._stats = stats
            outs = []
            for d in deltas:
                q = self._streams.get(d.request_id)
                if q is None:  # the client left (its abort is on its way to the core)
                    self._decoder.forget(d.request_id)
                    continue
                try:
                    out = self._decoder.decode(d)
                except Exception as e:  # noqa: BLE001  (one request's bad delta never loses the others')
                    log.exception("could not rebuild the output of %s", d.request_id)
                    q.put_nowait(APIError(500, f"internal error: {type(e).__name__}: {e}"))
                    continue
                outs.append(out)
                q.put_nowait(out)
            if self.observer is not None:
                self.observer.step(outs)
        elif kind == "result":
            _, cid, ok, value = msg
            fut = self._calls.get(cid)
            if fut is not None and not fut.done():
                fut.set_result(value) if ok else fut.set_exception(value)
        elif kind in ("admitted", "rejected"):
            fut = self._admitting.get(msg[1])
            if fut is not None and not fut.done():
                if kind == "admitted":
                    fut.set_result(None)
                elif msg[3]:  # the core's compile lanes are full (CompileQueueFull)
                    fut.set_exception(CompilesOverloaded(msg[2]))
                else:
                    fut.set_exception(engine_refusal(ValueError(msg[2])))

    def _died(self, why: str) -> None:
        self.dead = why = short_reason(why)
        for q in self._streams.values():
            q.put_nowait(EngineDead(why))
        for fut in [*self._admitting.values(), *self._calls.values()]:
            if not fut.done():
                fut.set_exception(EngineDead(why))

    def _read(self) -> None:
        why = None
        try:
            while True:
                if not self.core.conn.poll(CORE_SILENT_S):  # an idle core still sends its stats twice a second
                    if self._stop:
                        continue
                    log.warning("no message from the engine core for %.0f s (alive: %s)", CORE_SILENT_S,
                                self.core.alive())
                    continue
                msg = self.core.recv()
                if msg[0] == "dead":
                    why = msg[1]
                    log.error("the engine core died:\n%s", msg[2])
                    break
                self._loop.call_soon_threadsafe(self._on_loop, msg)
        except (EOFError, OSError):
            why = None if self._stop else f"the engine core exited (exit code {self.core.proc.exitcode})"
        if why is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._died, why)
