"""The tuner's hands on a loaded engine (docs/tune.md): install a commitment
tuple without reloading the model, record the dispatcher's calls, and replay
a workload offline.

A tuple is installed by writing it to a file and building the engine's
dispatcher from it with `make_dispatcher` — the same loader `detent-serve
--tuple` runs, so an illegal tuple raises `TupleError` here too — then
recapturing the CUDA graphs (they hold the old selections) and running the
warm start (engine/warmup.py), as startup does. Under tensor
parallelism every rank does the same (`collective_rpc`); rank 0's calls are
the profile (all ranks select alike).

What a recorded call weighs is the tuner's objective (`OBJECTIVES`, docs/tune.md
"Objective"): "time" counts every step alike, "tpot" counts a step once per
decode row in it (`decode_rows`), so a prefill-only step, which delays no
generating request, weighs nothing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

from detent.selection import CommitmentTuple, active_tuple_hash, make_dispatcher
from detent.selection.facts import complete

OBJECTIVES = ("tpot", "time")  # the first: the default


def check_objective(objective: str) -> str:
    if objective not in OBJECTIVES:
        raise ValueError(f"tune objective {objective!r}: must be one of {', '.join(OBJECTIVES)}")
    return objective


def decode_rows(attn) -> int:
    """The step's sequences with one query token: the rows that generate a token after their first.
    An approximation: a one-token prompt chunk counts too (the engine's own decode-row counter,
    which also asks that the row sample, counts a prompt's one-token last chunk). A step without
    attention metadata (the runner always builds it) has no row known to generate: 0."""
    return 0 if attn is None else sum(q == 1 for q in attn.query_lens_cpu)


def engine_facts(llm) -> dict[str, Any]:
    """The deployment facts the engine's tuples are made for."""
    return complete(llm.llm_engine.facts)


class GraphCaptureError(RuntimeError):
    """A candidate's CUDA graphs did not capture where the default tuple's did: its steps would
    run eagerly, and their time is not comparable with the default's."""


class SampledProfile:
    """The profile's forward: every step with prompt rows runs eagerly and is recorded (a graph
    replay asks the dispatcher nothing), and so does one decode-only step in `every`, counted
    `every` times; the other decode steps run `replay` (the graphs, when they hold this tuple's
    selections). Eager decode steps of an 8B model are host-bound (about 48 ms against 5 through
    a graph, H200): profiling the whole W-A eagerly took 229 s of its tune (lease 21).

    A recorded step's calls weigh the steps it stands for (`every` or 1), times its decode rows
    under the "tpot" objective; `rows` counts the decode rows of every step, recorded or not."""

    def __init__(self, d, eager, replay, every: int, prior, objective: str = "tpot"):
        if every < 1:
            raise ValueError(f"profile every {every} decode steps: must be at least 1")
        self.d, self.eager, self.replay, self.every = d, eager, replay, every
        self.prior = prior  # the runner's forward before: `_end_profile` puts it back
        self.per_row = check_objective(objective) == "tpot"
        self.decode_steps = self.replayed = self.rows = 0

    def __call__(self, input_ids, positions, ctx):
        a = ctx.attn
        decode = a is not None and a.max_seqlen_q == 1
        take = not decode or self.decode_steps % self.every == 0
        self.decode_steps += decode
        rows = decode_rows(a)
        self.rows += rows
        steps = self.every if decode else 1
        self.d.record_calls, self.d.record_weight = take, steps * rows if self.per_row else steps
        if take:
            return self.eager(input_ids, positions, ctx)
        self.replayed += 1
        return self.replay(input_ids, positions, ctx)


def _install_local(runner, config, max_model_len: int, facts: dict, path: str | None,
                   record: bool, profile_every: int = 1, objective: str = "tpot") -> dict[str, str]:
    """Install the tuple at `path`; the graph sets that failed to capture, with why. With
    `record`, profile through `SampledProfile`, replaying the graphs the runner holds for the
    decode steps it leaves out when they were captured under this same tuple (else it records
    every step, eagerly)."""
    old = runner.dispatcher
    # the tuple the runner's graphs hold: the last one installed here, or the engine's own
    held = getattr(runner, "graphs_tuple", None)
    if held is None and old is not None and old.mode == "pinned" and getattr(old, "facts", None) is not None:
        held = active_tuple_hash(old)
    d = make_dispatcher(facts, "pinned", path)
    runner.dispatcher = d
    _end_profile(runner)
    if record:  # no capture: the graphs still hold `held`
        runner.graphs_tuple = held
        fwd = runner._forward
        eager = getattr(runner, "_eager_forward", None) or fwd
        # graphs of other selections cannot stand in for this tuple's steps: then every step runs
        # eagerly anyway, and is recorded
        same = held is not None and held == active_tuple_hash(d)
        runner._forward = SampledProfile(d, eager, fwd, profile_every if same else 1, fwd, objective)
        return {}
    from detent.engine.graphs import enable_graphs, graph_failures
    from detent.engine.startup import warm_start
    enable_graphs(runner, config, max_model_len=max_model_len)
    runner.graphs_tuple = active_tuple_hash(d)
    # the new selections' kernels compile here, not inside the measurement (on CUDA, as at startup)
    warm_start(runner, config, facts, max_model_len, world=config.tensor_parallel_size, progress=False)
    return graph_failures(runner)


def _rank_install(st, config, path: str | None, record: bool, profile_every: int = 1,
                  objective: str = "tpot") -> dict[str, str]:
    """On every tensor-parallel rank (collective_rpc)."""
    return _install_local(st.runner, config, st.info.max_model_len, complete(st.info.facts), path, record,
                          profile_every, objective)


def _rank_calls(st) -> dict:
    return dict(st.runner.dispatcher.calls)


def _end_profile(runner) -> dict[str, int]:
    """Put back the forward a profile wrapped; its decode steps, how many it replayed, and the
    decode rows of all its steps."""
    prof = runner._forward
    if not isinstance(prof, SampledProfile):
        return {}
    runner._forward = prof.prior
    return {"decode_steps": prof.decode_steps, "replayed": prof.replayed, "decode_rows": prof.rows}


def _rank_end_profile(st) -> dict[str, int]:
    return _end_profile(st.runner)


def _profile_rows(runner) -> int:
    """The decode rows a running profile has counted so far (0 when none runs)."""
    prof = runner._forward
    return prof.rows if isinstance(prof, SampledProfile) else 0


def _rank_profile_rows(st) -> int:
    return _profile_rows(st.runner)


class TupleInstaller:
    """Installs tuples on one engine; files go to `workdir`."""

    def __init__(self, llm, workdir: str, profile_every: int = 1, objective: str = "tpot"):
        """profile_every: a profile (`install(t, record=True)`) records one decode-only step in
        this many, counted that many times, and every step with prompt rows (`SampledProfile`);
        objective: "tpot" weighs each recorded step's calls by its decode rows as well."""
        self.llm, self.workdir, self.profile_every = llm, workdir, profile_every
        self.objective = check_objective(objective)
        self.profile_stats: dict[str, int] = {}  # the last profile's (`end_profile`)
        # the last profile per loop (detent/tune_cost.py `profile_workload`): (loop, calls, decode rows)
        self.profile_loops: list[tuple[Loop, dict, int]] = []
        self.facts = engine_facts(llm)
        self.current: str | None = None  # hash of the installed tuple (and whether recording)
        self._n = 0
        self.base_failures: dict[str, str] | None = None  # graph sets the first measured tuple lacked
        self.install_seconds: list[float] = []  # every install that changed the tuple (graphs, warm start)
        self.last_install_s = 0.0  # the last install call's (0 when the tuple was already in place)

    def install(self, t: CommitmentTuple, record: bool = False) -> None:
        key = f"{t.hash}:{record}"
        if key == self.current:
            self.last_install_s = 0.0
            return
        self._n += 1
        t0 = time.perf_counter()
        path = os.path.join(self.workdir, f"candidate-{self._n}.json")
        t.save(path)
        eng = self.llm.llm_engine
        if eng.dispatcher is None:  # tensor parallel: the ranks hold the dispatchers
            failed: dict[str, str] = {}
            for rank in eng.runner.collective_rpc(_rank_install, eng.config, path, record, self.profile_every,
                                                  self.objective):
                failed.update(rank or {})
        else:
            failed = _install_local(eng.runner, eng.config, eng.state.max_model_len, self.facts, path, record,
                                    self.profile_every, self.objective)
            eng.dispatcher = eng.runner.dispatcher
        self.current = key
        self.last_install_s = time.perf_counter() - t0
        self.install_seconds.append(self.last_install_s)
        if record:
            return
        if self.base_failures is None:  # the first tuple measured: the default
            self.base_failures = failed
        lost = {k: v for k, v in failed.items() if k not in self.base_failures}
        if lost:
            self.current = None
            raise GraphCaptureError(
                f"detent tune: candidate {t.hash[:16]}'s CUDA graphs did not capture where the default "
                f"tuple's did, so its steps would run eagerly and its time would not compare: "
                + "; ".join(f"{k}: {v}" for k, v in sorted(lost.items()))
                + ". Leave more GPU memory outside the KV cache (--gpu-memory-utilization) or use "
                  "--cost kernels (no graphs).")

    def end_profile(self) -> dict[str, int]:
        """After a recording install's run: the runner's own forward back (on every rank); the
        profile's decode steps and how many of them replayed unrecorded (rank 0's)."""
        eng = self.llm.llm_engine
        if eng.dispatcher is None:
            stats = eng.runner.collective_rpc(_rank_end_profile)[0]
        else:
            stats = _end_profile(eng.runner)
        self.current = None  # the next install leaves recording
        return stats

    def profile_rows(self) -> int:
        """The decode rows the running profile has counted so far (rank 0's)."""
        eng = self.llm.llm_engine
        if eng.dispatcher is None:
            return eng.runner.collective_rpc(_rank_profile_rows)[0]
        return _profile_rows(eng.runner)

    def calls(self) -> dict:
        """(family, site, runtime) -> weight (steps, or decode rows under "tpot"), as the installed
        dispatcher recorded them."""
        eng = self.llm.llm_engine
        if eng.dispatcher is None:
            return eng.runner.collective_rpc(_rank_calls)[0]
        return dict(eng.dispatcher.calls)


@dataclasses.dataclass(frozen=True)
class Loop:
    """A closed loop the tuner replays a workload under: at most `cap` requests in flight (None:
    every request at once), standing for the workload's `loads`: its closed-loop loads of that
    concurrency, or (`poisson`) Poisson loads measured to run about that many at a time
    (`load_loops`). Under the "tpot" objective a loop weighs one per load it stands for."""
    cap: int | None
    loads: tuple[str, ...] = ()
    poisson: bool = False

    @property
    def weight(self) -> int:
        return max(1, len(self.loads))

    @property
    def label(self) -> str:
        return ("all" if self.cap is None else str(self.cap)) + (f" ({', '.join(self.loads)})" if self.poisson else "")


def loops_unit(loops: list[Loop]) -> str:
    """What a cost over several loops adds to its unit."""
    return f", geometric mean over the closed loops of {', '.join(loop.label for loop in loops)}"


SATURATED = 1.05  # `load_loops` stops doubling the loop once a doubling gains less throughput than this
LOOP_REQUESTS = 8  # a loop of `cap` in flight replays this many requests per request in flight,
MIN_LOOP_REQUESTS = 16  # and at least these (`loop_requests`)


def loop_requests(workload, cap: int | None):
    """The head of `workload` a loop of `cap` replays: LOOP_REQUESTS rounds of its requests in
    flight, at least MIN_LOOP_REQUESTS, all of it for `cap` None. W-C's loop of one replays 16 of
    its 64 documents: one at a time, each 8k document's steps are alike, and replaying all 64 took
    most of the loop's time (50 s of the 79 s profile, lease 28)."""
    if cap is None:
        return workload
    n = max(MIN_LOOP_REQUESTS, LOOP_REQUESTS * cap)
    return workload if n >= len(workload.requests) else workload.head(n / len(workload.requests))


def _grouped(workload, caps: dict[str, int | None]) -> list[Loop]:
    """The loads named in `caps` (load -> its loop's cap) as loops, one per cap in the loads'
    order, a loop marked `poisson` when it stands for a Poisson load."""
    loops: dict[int | None, list] = {}
    for load in workload.loads:
        if load.name in caps:
            loops.setdefault(caps[load.name], []).append(load)
    return [Loop(c, tuple(ld.name for ld in lds), poisson=any(ld.fraction for ld in lds))
            for c, lds in loops.items()]


def closed_loops(workload) -> list[Loop]:
    """The loops of `workload`'s closed-loop loads, one per concurrency in the loads' order (W-C:
    1 and 8), or one loop of every request at once for a workload without any."""
    return _grouped(workload, {ld.name: ld.concurrency for ld in workload.loads if ld.concurrency}) or [
        Loop(None, tuple(ld.name for ld in workload.loads))]


def load_loops(llm, workload, progress=lambda s: None,
               max_throughput: float | None = None) -> tuple[list[Loop], dict[str, Any]]:
    """The loops that stand for every load of `workload` under "tpot", and how they were found.

    A Poisson load arrives at a fraction of the workload's maximum throughput (benchmarks/
    workloads: stock's, every request sent at once). How many requests it runs at a time sets the
    batches its tokens decode in, and a kernel's speed depends on them: served on one H100 (lease
    29), the default ran 0.78, 2.21 and 5.26 W-B requests in flight on average at 0.33, 0.67 and
    1.0 of the maximum (Little's law), and FlashAttention-4, 9.5% cheaper in one batch of every
    request, was +2.4 ms a token at 0.33 and -1.7 ms at 1.0. So each Poisson load becomes the
    closed loop whose throughput is its arrival rate: the workload replays with every request at
    once (its maximum throughput, requests per second), then in closed loops of 1, 2, 4, ...
    (`loop_requests` each, below the workload's size) until one reaches the highest load's rate
    or gains less than 5% on the loop before (`SATURATED`); a load's loop is the
    concurrency where the throughput, interpolated linearly between the measured loops (and from
    0 at 0), reaches its rate, at least 1. A rate above every loop's throughput replays every
    request at once. Closed-loop loads keep their own concurrency. The engine runs as it is
    loaded; the tuple and every request's bits stay the same, only the admission changes.

    `max_throughput` (requests/s), when given, is the maximum the loads are fractions of, and the
    replay of every request at once is skipped: the served stock maximum where it is known. The
    tune's own maximum is the default tuple's, offline: on W-B (lease 30) 3.35 requests/s against
    stock's 3.005 served over HTTP, which put the highest load in a loop of 13 where the served
    rate needs about 7.

    Returns (loops, {"max_throughput": requests/s, "max_throughput_from": "measured" or "given",
    "throughput": {cap: requests/s}}), the dict empty when no load is a Poisson load."""
    poisson = [ld for ld in workload.loads if ld.fraction]
    if not poisson:
        return closed_loops(workload), {}
    n = len(workload.requests)
    if max_throughput is None:
        seconds, _ = run_offline(llm, workload, caps=[None])
        top = n / seconds
        progress(f"  {workload.name}'s maximum throughput: {top:.3f} requests/s ({n} at once, {seconds:.1f} s)")
    else:
        top = max_throughput
        progress(f"  {workload.name}'s maximum throughput: {top:.3f} requests/s (given)")
    rungs: list[tuple[int, float]] = []
    cap, highest = 1, max(ld.fraction for ld in poisson) * top
    while cap < n:
        w = loop_requests(workload, cap)
        seconds, _ = run_offline(llm, w, caps=[cap])
        rungs.append((cap, len(w.requests) / seconds))
        progress(f"  closed loop of {cap}: {rungs[-1][1]:.3f} requests/s ({len(w.requests)} requests)")
        if rungs[-1][1] >= highest or (len(rungs) > 1 and rungs[-1][1] < SATURATED * rungs[-2][1]):
            break  # the highest rate reached, or more in flight no longer adds throughput
        cap *= 2
    caps = {ld.name: ld.concurrency if ld.concurrency else concurrency_at(rungs, ld.fraction * top)
            for ld in workload.loads}
    out = _grouped(workload, caps)
    progress("  loads as closed loops: " + ", ".join(
        f"{ld.name} ({f'{ld.fraction:g} of the maximum' if ld.fraction else 'closed'}) "
        f"{'every request at once' if caps[ld.name] is None else f'{caps[ld.name]} in flight'}"
        for ld in workload.loads))
    return out, {"max_throughput": top, "max_throughput_from": "measured" if max_throughput is None else "given",
                 "throughput": {str(c): x for c, x in rungs}}


def concurrency_at(rungs: list[tuple[int, float]], rate: float) -> int | None:
    """The concurrency at which the closed loops' throughput (`rungs`: (concurrency, requests/s),
    rising concurrency) reaches `rate`, linear between rungs and from (0, 0), rounded, at least 1;
    None above every rung."""
    c0, x0 = 0, 0.0
    for c, x in rungs:
        if x >= rate:
            return max(1, min(c, round(c0 + (rate - x0) / (x - x0) * (c - c0) if x > x0 else c)))
        c0, x0 = c, x
    return None


def run_offline(llm, workload, max_tokens_cap: int | None = None,
                caps: list[int | None] | None = None) -> tuple[float, int]:
    """Replay `workload` through the engine (each round of chat turns after the
    one before, so later turns hit the prefix cache); (wall seconds, output tokens).

    The whole workload replays once per cap in `caps` (default: its closed loops', `closed_loops`:
    W-C's 1 and 8; one batch for a workload without one), the engine running at most that many
    requests at a time: with every request queued, that is the closed loop (a request starts
    when one ends), so the profile holds the batches the load decodes in, not one batch of all
    of them."""
    from detent.engine import SamplingParams

    caps = [loop.cap for loop in closed_loops(workload)] if caps is None else caps
    t0, tokens = time.perf_counter(), 0
    for cap in caps:
        llm.reset_prefix_cache()
        with running_at_most(llm, cap):
            for idx in workload.rounds():
                reqs = [workload.requests[i] for i in idx]
                params = [SamplingParams(temperature=0, ignore_eos=True,
                                         max_tokens=min(r.max_tokens, max_tokens_cap or r.max_tokens)) for r in reqs]
                outs = llm.generate([{"prompt_token_ids": list(r.prompt_token_ids)} for r in reqs], params,
                                    use_tqdm=False)
                tokens += sum(len(o.outputs[0].token_ids) for o in outs)
    return time.perf_counter() - t0, tokens


@contextlib.contextmanager
def running_at_most(llm, n: int | None):
    """The engine's scheduler runs at most `n` requests at a time inside (None: its own limit).
    Only the admission changes: the deployment's facts, its tuple and its graphs stay as they are,
    and a request's bits do not depend on its batch."""
    sched = llm.llm_engine.scheduler
    limits = sched.limits
    if n is not None and n < limits.max_num_seqs:
        sched.limits = dataclasses.replace(limits, max_num_seqs=n)
    try:
        yield
    finally:
        sched.limits = limits
