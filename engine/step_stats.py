"""The engine's step accounting: cumulative counters per step kind
(`LLMEngine.stats()["steps_by_kind"]`: kind -> the counters as a tuple in
`STEP_KIND_FIELDS` order; the server's per-kind /metrics series are keyed by
these names), and the step loop's host time by part.

A step's kind is "decode" (one-token rows only), "mixed" (prompt chunks
beside one-token rows) or "prefill" (prompt chunks only). A step's seconds
run from the return of its launch, or from the previous step's end if later,
to its end: under async scheduling the time the pipeline spent on it (a step
collected after the next one's launch also holds that launch's host time).
A request's time per output token is the mean of its steps' seconds, so the
mean over requests weighs each step by its decode rows: `decode_row_seconds`
over `decode_rows` (benchmarks/serve_load.py reads that ratio).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, fields
from operator import attrgetter

STEP_KINDS = ("decode", "mixed", "prefill")

# where the step loop's host time goes (stats()["host_seconds"], /metrics engine_host_seconds):
# taking in new requests, planning, launching, waiting for results, advancing the requests,
# building their outputs; the engine core process adds its pipe traffic (engine/core_process.py)
HOST_PARTS = ("inbox", "schedule", "launch", "wait", "update", "outputs", "ipc_in", "ipc_out")
# the host parts the step kinds count, and the field that counts each; the engine times the others
KIND_HOST_PARTS = {"launch": "launch_seconds", "wait": "wait_seconds"}


def step_kind(plan) -> str:
    """"decode" (every row one token), "prefill" (no one-token row) or "mixed"."""
    ones = sum(1 for s in plan.seqs if s.num_tokens == 1)
    return "decode" if ones == len(plan.seqs) else "mixed" if ones else "prefill"


@dataclass(slots=True)
class KindCounters:
    """One step kind's counters; `KindCounters(*t)` reads back a `steps_by_kind` tuple."""

    steps: int = 0
    seconds: float = 0.0  # the time the pipeline spent on the steps (module docstring)
    tokens: int = 0  # tokens computed
    wait_seconds: float = 0.0  # the host's wait for their results (near 0: the host, not the device, set the pace)
    launch_seconds: float = 0.0  # the host's time launching them (input copies, graph replays, eager kernels)
    prepare_seconds: float = 0.0  # of the launch, preparing the inputs
    forward_seconds: float = 0.0  # of the launch, the model call (the rest: sampling, prompt logprobs)
    whole_graph_steps: int = 0  # steps that replayed one whole graph (a decode graph or a whole-step graph)
    piecewise_steps: int = 0  # steps that replayed the piecewise graphs (the rest ran eagerly)
    device_seconds: float = 0.0  # CUDA: the device's span of the steps (first to last kernel, CUDA events)
    device_idle_seconds: float = 0.0  # CUDA: the device's idle time before each, from the previous step's end
    decode_rows: int = 0  # one-token rows that sample
    decode_row_seconds: float = 0.0  # those rows times their step's seconds
    rows_left_out: int = 0  # running requests past their prompt left out though they could have run

    def as_tuple(self) -> tuple:
        """The counters in `STEP_KIND_FIELDS` order."""
        return _values(self)


STEP_KIND_FIELDS = tuple(f.name for f in fields(KindCounters))
_values = attrgetter(*STEP_KIND_FIELDS)


class StepStats:
    """An engine's counters by step kind, fed at a step's launch (`on_launch`, `add_launch_time`)
    and its collection (`on_collect`); a step's CUDA events are read at a collection after they
    have completed (never waited for)."""

    def __init__(self):
        self.kinds = {k: KindCounters() for k in STEP_KINDS}
        self._launched_at: dict[int, float] = {}  # id(handle) -> when its launch returned
        self._last_done = 0.0  # when the last step collected ended
        # (kind's counters, start event, end event, work left after it) of collected steps
        self._device_pending: deque = deque()
        self._device_last = None  # (end event, work left after it) of the last step counted

    def on_launch(self, kind: str, handle, started: float, returned: float, left_out: int) -> None:
        """`handle`'s step, of `kind`, was launched from `started` to `returned` (perf_counter);
        it left out `left_out` running requests past their prompt (Scheduler.num_left_out)."""
        self._launched_at[id(handle)] = returned
        c = self.kinds[kind]
        c.launch_seconds += returned - started
        split = getattr(handle, "launch_split", None)  # ModelRunner's StepHandle; not every runner's
        if split is not None:
            c.prepare_seconds += split[0]
            c.forward_seconds += split[1]
        path = getattr(handle, "forward_path", None)
        c.whole_graph_steps += path in ("decode_graph", "whole_graph")
        c.piecewise_steps += path == "pieces"
        c.rows_left_out += left_out

    def add_launch_time(self, plan, seconds: float) -> None:
        """More host time launching `plan`'s step (its deferred sampling)."""
        self.kinds[step_kind(plan)].launch_seconds += seconds

    def drop(self, handle) -> None:
        """`handle`'s step will not be collected (it was undone)."""
        self._launched_at.pop(id(handle), None)

    def on_collect(self, handle, waited: float, busy: bool) -> None:
        """`handle`'s step was collected and its requests advanced, after the host waited `waited`
        seconds for its results; `busy`: the engine had work left after it."""
        done = time.perf_counter()
        start = max(self._launched_at.pop(id(handle), done), self._last_done)
        self._last_done = done
        c = self.kinds[step_kind(handle.plan)]
        rows = sum(1 for s in handle.plan.seqs if s.num_tokens == 1 and s.sample is not None)
        c.steps += 1
        c.seconds += done - start
        c.tokens += handle.plan.num_batched_tokens
        c.wait_seconds += waited
        c.decode_rows += rows
        c.decode_row_seconds += rows * (done - start)
        events = getattr(handle, "events", None)
        if events is not None:
            self._device_pending.append((c, *events, busy))
        self._count_device_time()

    def _count_device_time(self) -> None:
        """Device span and idle time of the collected steps whose events have completed, in
        order (a step collected without waiting, e.g. a prompt chunk that samples nothing, is
        counted at a later step; never waited for). The idle time before a step counts only
        when the step before it left work (the engine had no request in between otherwise)."""
        while self._device_pending and self._device_pending[0][2].query():
            c, start, end, busy = self._device_pending.popleft()
            c.device_seconds += start.elapsed_time(end) / 1e3
            if self._device_last is not None and self._device_last[1]:
                c.device_idle_seconds += max(0.0, self._device_last[0].elapsed_time(start) / 1e3)
            self._device_last = (end, busy)

    def as_dict(self) -> dict[str, tuple]:
        """kind -> its counters in `STEP_KIND_FIELDS` order (`stats()["steps_by_kind"]`)."""
        return {k: c.as_tuple() for k, c in self.kinds.items()}

    def host_time(self, others: dict[str, float]) -> dict[str, float]:
        """The step loop's host seconds by part (HOST_PARTS): launch and wait summed over the
        step kinds, the other parts from `others`."""
        kinds = list(self.kinds.values())
        return {p: sum(getattr(c, KIND_HOST_PARTS[p]) for c in kinds) if p in KIND_HOST_PARTS else others[p]
                for p in HOST_PARTS}
