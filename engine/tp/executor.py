"""`TPExecutor`: the driver side of tensor parallelism.

The engine process keeps the scheduler, the block manager and the
detokenizer; the N ranks are spawned processes (NCCL on GPU, gloo on CPU),
each running the same `ModelRunner` on its shard. Per step the driver sends
the plan (a `SchedulerOutput`: plain frozen dataclasses, made portable by
engine/tp/plan.py, where a request's sampling parameters travel once) to
every rank over its pipe and gets rank 0's `ModelOutput` back, plus every
rank's digest of its own output, which must agree.

Async scheduling: `launch(plan)` sends the plan and returns at once; each
rank launches it and then answers with the result of the step before it, so
the driver reads step N while the ranks compute step N+1 (`collect`).

The driver never enters a collective itself, so it cannot hang in one: it
waits on the ranks' pipes *and* their process sentinels, and a rank that
dies (or raises) makes `execute` raise `TPWorkerError` at once, after the
remaining ranks are terminated. Shutdown is explicit (`shutdown()`), on
garbage collection and at interpreter exit; ranks are daemonic and also
exit by themselves when the driver disappears.
"""
from __future__ import annotations

import os
import pickle
import socket
import time
import weakref
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

import torch.multiprocessing as mp

from detent.engine.tp.plan import PlanSender
from detent.engine.tp.worker import RankInfo, worker_main

STARTUP_POLL_S = 1.0


class TPWorkerError(RuntimeError):
    """A tensor-parallel rank died, raised, or disagreed with rank 0."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(procs: list, conns: list, grace_s: float = 5.0) -> None:
    """Ask every live rank to exit, then terminate, then kill (idempotent)."""
    msg = pickle.dumps(("shutdown",))
    for p, c in zip(procs, conns):
        if p.is_alive():
            try:
                c.send_bytes(msg)
            except (OSError, ValueError):
                pass
    deadline = time.monotonic() + grace_s
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join(timeout=2.0)
    for c in conns:
        try:
            c.close()
        except OSError:
            pass


@dataclass(frozen=True)
class TPStep:
    """A plan sent to the ranks and not yet collected."""
    plan: Any
    seq: int  # launch number


class TPExecutor:
    def __init__(self, config, resolved, *, startup_timeout_s: float | None = None,
                 collective_timeout_s: float = 600.0):
        world = config.tensor_parallel_size
        self.world = world
        self._error: str | None = None
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        cpu_threads = max(1, (os.cpu_count() or 1) // world)
        self.procs, self.conns = [], []
        try:
            for rank in range(world):
                parent, child = ctx.Pipe(duplex=True)
                p = ctx.Process(target=worker_main, name=f"detent-tp{rank}", daemon=True,
                                args=(rank, world, init_method, config, resolved, child, os.getpid(),
                                      cpu_threads, collective_timeout_s))
                p.start()
                child.close()
                self.procs.append(p)
                self.conns.append(parent)
        except BaseException:
            _stop(self.procs, self.conns, grace_s=0.0)
            raise
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.conns)
        replies = self._collect("startup", timeout_s=startup_timeout_s)
        self.infos: list[RankInfo] = [r[1] for r in replies]
        self._launched = 0  # plans sent with "launch"
        self._plans = PlanSender()  # each step's message; which requests' parameters the ranks keep

    # ------------------------------------------------------------ the step
    def execute(self, plan) -> Any:
        """Run one plan on every rank; rank 0's ModelOutput."""
        self._send_all(self._plans.message("execute", plan), "the step plan")
        return self._step_result()

    def launch(self, plan, prev=None) -> TPStep:
        """Send a plan to every rank without waiting for it (async scheduling).

        Each rank launches it, then returns the result of the step before it,
        whose sampled tokens it used for this plan's `PLACEHOLDER` inputs:
        every rank samples the same tokens (the digests check it), so each
        fills them from its own device tensor. `prev` is that earlier step."""
        self._send_all(self._plans.message("launch", plan), "the step plan")
        self._launched += 1
        return TPStep(plan, self._launched)

    def collect(self, handle: TPStep) -> Any:
        """Rank 0's ModelOutput of a launched step (steps are collected in launch order)."""
        if handle.seq == self._launched:  # no later launch made the ranks send it: ask
            self._send_all(("collect",), "a collect request")
        return self._step_result()

    def _send_all(self, msg: tuple, what: str) -> None:
        self._check_alive()
        data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
        for rank, c in enumerate(self.conns):
            try:
                c.send_bytes(data)
            except (OSError, ValueError):
                self._fail(f"cannot send {what} to tensor-parallel rank {rank} "
                           f"(pid {self.procs[rank].pid}): {self._exit_text(rank)}")

    def _step_result(self) -> Any:
        replies = self._collect("step")
        digests = [r[2] for r in replies]
        if len(set(digests)) != 1:
            bad = [i for i, d in enumerate(digests) if d != digests[0]]
            self._fail(f"tensor-parallel ranks {bad} computed a different step output than rank 0 "
                       "(tokens or logprobs differ between ranks)")
        return replies[0][1]

    def collective_rpc(self, fn, *args) -> list:
        """fn(rank_state, *args) on every rank (fn picklable by reference,
        e.g. a module-level function); the per-rank results, rank order.
        For tools (benchmarks switch selection modes this way), not the step."""
        self._check_alive()
        data = pickle.dumps(("call", fn, args), protocol=pickle.HIGHEST_PROTOCOL)
        for c in self.conns:
            c.send_bytes(data)
        return [r[1] for r in self._collect(f"collective_rpc({getattr(fn, '__name__', fn)})")]

    # ------------------------------------------------------------ plumbing
    def _collect(self, what: str, timeout_s: float | None = None) -> list[tuple]:
        """One reply per rank, watching every rank's pipe and process sentinel."""
        replies: dict[int, tuple] = {}
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        sentinels = {p.sentinel: r for r, p in enumerate(self.procs)}
        while len(replies) < self.world:
            pending = {self.conns[r]: r for r in range(self.world) if r not in replies}
            ready = wait(list(pending) + list(sentinels), timeout=STARTUP_POLL_S)
            for obj in ready:
                if obj in pending:
                    rank = pending[obj]
                    try:
                        msg = pickle.loads(obj.recv_bytes())
                    except (EOFError, OSError):
                        self._fail(f"tensor-parallel rank {rank} (pid {self.procs[rank].pid}) died during "
                                   f"{what}: {self._exit_text(rank)}")
                    if msg[0] == "error":
                        self._fail(f"tensor-parallel {msg[1]}")
                    replies[rank] = msg
            for obj in ready:
                if obj in sentinels:
                    rank = sentinels[obj]
                    if rank in replies and what == "shutdown":
                        continue
                    # a last message (its traceback) may still be in the pipe
                    c = self.conns[rank]
                    try:
                        if c.poll(0.2):
                            msg = pickle.loads(c.recv_bytes())
                            if msg[0] == "error":
                                self._fail(f"tensor-parallel {msg[1]}")
                    except (EOFError, OSError):
                        pass
                    self._fail(f"tensor-parallel rank {rank} (pid {self.procs[rank].pid}) died during "
                               f"{what}: {self._exit_text(rank)}")
            if deadline is not None and time.monotonic() > deadline:
                missing = sorted(set(range(self.world)) - set(replies))
                self._fail(f"tensor-parallel ranks {missing} did not answer within {timeout_s}s during {what}")
        return [replies[r] for r in range(self.world)]

    def _exit_text(self, rank: int) -> str:
        p = self.procs[rank]
        p.join(timeout=0.5)
        code = p.exitcode
        if code is None:
            return "still running"
        if code < 0:
            return f"killed by signal {-code}"
        return f"exit code {code}"

    def _fail(self, msg: str):
        self._error = msg
        self._finalizer()  # stop every rank: the others may be stuck in a collective
        raise TPWorkerError(msg)

    def _check_alive(self) -> None:
        if self._error is not None:
            raise TPWorkerError(f"the tensor-parallel workers are gone: {self._error}")
        for rank, p in enumerate(self.procs):
            if not p.is_alive():
                self._fail(f"tensor-parallel rank {rank} (pid {p.pid}) is not running: {self._exit_text(rank)}")

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def shutdown(self) -> None:
        if self._error is None:
            self._error = "the engine was shut down"
        self._finalizer()
