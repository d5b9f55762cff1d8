"""Grammar compilation in worker processes that can be killed.

xgrammar compiles in C++ and cannot be interrupted from Python: a compile
that a request gave up on in a thread keeps its core until it ends (minutes
for a large schema). So each grammar is first compiled in a worker process:
one that passes its deadline gets its worker killed and replaced, and stops
at once. A grammar that compiled there in time is compiled again in the
lane's thread, for the engine, and takes about as long. (Sending the
compiled grammar back instead costs more than compiling it:
`CompiledGrammar.serialize_json` of a 300-property schema is 54 MB and took
24 s, its compile 0.1 s.)

Two lanes, each with its own workers: specs up to `SMALL_SPEC_BYTES` go to
the small lane, larger ones to the large lane, so small grammars keep
compiling while large ones run. A job's future says when a worker began it
(`CompileFuture.started`): a request's compile budget counts from there, so
the time it waited behind other compiles, or for a killed worker's
replacement to start, is not charged to it. The lanes are shared by every compile cache
of the process (a worker costs an interpreter and an xgrammar import); a
worker keeps one compiler per tokenizer, sent with its first job.

A lane's queue is bounded: `submit` with `max_queued` raises
`CompileQueueFull` when that many jobs already wait in the lane (a flood
of slow specs would otherwise delay every structured-output request behind
it by a compile timeout each). A job no request wants any more is taken
out of the queue (`drop`) and never compiled. One a worker has begun is
left to finish (bounded by its timeout): its result stays cached for a
request that asks again with the same spec (a client retrying after its
own timeout), and a client that stayed connected would hold the lane as
long, so killing it would gain nothing against a hostile one.
"""
from __future__ import annotations

import multiprocessing as mp
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass

SMALL_SPEC_BYTES = 4096
WORKERS_PER_LANE = 1
STARTUP_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class CompileJob:
    tokenizer_key: str
    info_json: str  # xgrammar TokenizerInfo.serialize_json()
    kind: str  # "json" (schema text) | "regex" | "grammar" (EBNF)
    text: str
    any_whitespace: bool
    strict: bool


class CompileFuture(Future):
    """A compile job's future; `started` is when a worker began the compile (time.monotonic()),
    None while the job waits in its lane or for a worker to start. Cancelled when the job was
    dropped from its lane's queue (`drop`), before any worker began it."""
    started: float | None = None
    lane: "Lane | None" = None  # the lane it was queued in


class CompileQueueFull(ValueError):
    """A new compile job would pass its lane's bound on waiting jobs (`submit`'s `max_queued`).
    A ValueError, so every caller that refuses a bad request refuses this one too (never an
    uncaught error in a step loop); the server answers it 503 with Retry-After, as a full
    request queue: the request is fine, the server is busy."""

    def __init__(self, lane: str, queued: int, limit: int):
        super().__init__(f"too many structured-output grammars are waiting to compile: {queued} in the "
                         f"{lane}-spec lane, its limit (max_queued_grammar_compiles = {limit}, detent-serve's "
                         f"--max-queued-grammar-compiles); retry later")
        self.lane, self.queued, self.limit = lane, queued, limit


def compile_job(compiler, job: CompileJob):
    if job.kind == "json":
        return compiler.compile_json_schema(job.text, any_whitespace=job.any_whitespace, strict_mode=job.strict)
    if job.kind == "regex":
        return compiler.compile_regex(job.text)
    return compiler.compile_grammar(job.text)


def _worker_main(conn) -> None:
    """A worker process: compile jobs from `conn` one at a time, answer ("ok", seconds) or ("error", message)."""
    import xgrammar as xgr
    compilers: dict[str, object] = {}
    conn.send(("ready", None))
    while True:
        try:
            job = conn.recv()
        except EOFError:
            return
        try:
            c = compilers.get(job.tokenizer_key)
            if c is None:
                info = xgr.TokenizerInfo.deserialize_json(job.info_json)
                c = compilers[job.tokenizer_key] = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            t0 = time.perf_counter()
            compile_job(c, job)
            conn.send(("ok", time.perf_counter() - t0))
        except Exception as e:  # noqa: BLE001 - the message goes back to the request
            conn.send(("error", f"{type(e).__name__}: {e}"))


class _Worker:
    """One worker process and the thread that feeds it jobs from its lane's queue."""

    def __init__(self, lane: "Lane", index: int):
        self.lane, self.name = lane, f"detent-grammar-{lane.name}-{index}"
        self.proc = self.conn = None
        threading.Thread(target=self._run, name=self.name, daemon=True).start()

    def _start(self) -> None:
        """A fresh worker process, once it has imported xgrammar (a compile's timeout starts after)."""
        ctx = mp.get_context("spawn")  # fork would copy the engine's threads and CUDA state
        parent, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child,), name=self.name, daemon=True)
        self.proc.start()
        child.close()
        self.conn = parent
        try:
            ready = parent.poll(STARTUP_TIMEOUT_S) and parent.recv() == ("ready", None)
        except EOFError:  # it died starting: an OSError as a late start, which the callers handle
            ready = False
        if not ready:
            raise OSError(f"grammar compile worker {self.name} did not start (it died, or was not ready in "
                          f"{STARTUP_TIMEOUT_S:g} s)")

    def _restart(self) -> None:
        """A new worker right away, so the lane's next job does not wait for one."""
        try:
            self._start()
        except OSError:
            self.kill()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.join(5)
            self.conn.close()
            self.lane.kills += 1
        self.proc = self.conn = None

    def _run(self) -> None:
        self._restart()  # started ahead of the first job
        while True:
            job, compile_here, fut, timeout_s = self.lane.take()
            try:
                if self.proc is None or not self.proc.is_alive():
                    self._start()
                fut.started = time.monotonic()
                self.conn.send(job)
                if not self.conn.poll(timeout_s):
                    self.kill()  # the compile stops with its process
                    fut.set_exception(TimeoutError("grammar compilation timed out (its worker was stopped)"))
                    self._restart()
                    continue
                status, payload = self.conn.recv()
            except (OSError, EOFError) as e:
                self.kill()
                fut.set_exception(RuntimeError(f"the grammar compile worker died: {e!r}"))
                continue
            if status != "ok":
                fut.set_exception(ValueError(payload))
                continue
            try:
                fut.set_result(compile_here(job))  # known to finish: it just did, in `payload` s
            except Exception as e:  # noqa: BLE001
                fut.set_exception(e)


class Lane:
    def __init__(self, name: str, workers: int):
        self.name = name
        # the jobs no worker has begun, (job, compile_here, future, timeout_s): a dropped one
        # leaves at once, so the bound counts only jobs some request still waits for, and a
        # flood of abandoned ones holds no memory
        self._jobs: deque[tuple] = deque()
        self._cv = threading.Condition()
        self.kills = 0
        self.dropped = 0  # jobs taken out of the queue by `drop`, never compiled
        self.workers = [_Worker(self, i) for i in range(workers)]

    def put(self, item: tuple, max_queued: int | None) -> None:
        with self._cv:
            if max_queued is not None and len(self._jobs) >= max_queued:
                raise CompileQueueFull(self.name, len(self._jobs), max_queued)
            self._jobs.append(item)
            self._cv.notify()

    def take(self) -> tuple:
        """The next job, its future marked running (under the lock `drop` takes: a job is
        either still queued, and droppable, or begun)."""
        with self._cv:
            while True:
                while not self._jobs:
                    self._cv.wait()
                item = self._jobs.popleft()
                if item[2].set_running_or_notify_cancel():
                    return item

    def drop(self, fut: CompileFuture) -> bool:
        """Take `fut`'s job out of the queue and cancel it; False if a worker has begun it
        (or it is not queued here)."""
        with self._cv:
            for i, item in enumerate(self._jobs):
                if item[2] is fut:
                    del self._jobs[i]
                    fut.cancel()
                    self.dropped += 1
                    return True
            return False

    def queued(self) -> int:
        """Jobs waiting for a worker (not the ones being compiled)."""
        with self._cv:
            return len(self._jobs)


_LANES: dict[str, Lane] = {}
_LOCK = threading.Lock()


def _lane(name: str) -> Lane:
    with _LOCK:
        if name not in _LANES:
            _LANES[name] = Lane(name, WORKERS_PER_LANE)
        return _LANES[name]


def lane_for(job: CompileJob) -> Lane:
    return _lane("small" if len(job.text.encode()) <= SMALL_SPEC_BYTES else "large")


def submit(job: CompileJob, compile_here, timeout_s: float, max_queued: int | None = None) -> CompileFuture:
    """Compile `job` in its lane: `compile_here(job)` (the engine's compile) once a worker
    compiled it within `timeout_s`; else the worker is killed and the future fails with
    TimeoutError. (The request's own deadline, GrammarState's, counts from `started`.)
    CompileQueueFull if `max_queued` jobs already wait in the lane: nothing is queued."""
    fut = CompileFuture()
    fut.lane = lane_for(job)
    fut.lane.put((job, compile_here, fut, timeout_s), max_queued)
    return fut


def drop(fut: CompileFuture) -> bool:
    """Drop a job no request wants any more if no worker has begun it: it leaves its lane's
    queue and its future is cancelled (True). A begun one runs on (False)."""
    return fut.lane.drop(fut)


def warm() -> None:
    """Start both lanes' workers now (an interpreter and an xgrammar import each), not at the first compile."""
    for name in ("small", "large"):
        _lane(name)


def lanes() -> dict[str, Lane]:
    with _LOCK:
        return dict(_LANES)
