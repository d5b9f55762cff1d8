"""`tune(llm, workload)`: the tuner as a function (docs/tune.md); `detent tune`
(detent/tune_cli.py) wraps it. Profile the workload under the default tuple,
search the families the workload calls that have a choice, and return the
result with the profile.

    from detent.tune import tune
    out = tune(llm, make("W-A", num_requests=32), progress=print)
    out.result.chosen.save("t.json")

`objective` (docs/tune.md, "Objective"): "tpot" (default) weighs each step
by its decode rows, the time a generated token waits for; "time" counts
every step alike, prefill included. `cost`: "engine" (default: `EngineCost`,
the workload's steps timed on this engine), "kernels" (`KernelCost`, the
profiled kernel calls timed one by one), or a function (installer, profiled
calls) -> cost model; tests pass a fake one. `confirm`: None, "engine" or
such a function: the search's winner and the default measured again on that
model (the default before and after), and the default kept unless the winner
is cheaper there; `detent tune --cost kernels` confirms on the engine, so a
fast search still answers to the workload's own steps. `deadline` (a
`time.perf_counter()` value; `detent tune --time-budget`): the search starts
no measurement after its share of the time (all of it without a
confirmation, else `SEARCH_SHARE` of what the profile left; `Search`), and
the confirmation runs on the share of the workload that fits before the
deadline, and is skipped, the default kept, when too little does.
"""
from __future__ import annotations

import math
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable

from detent.selection import default_tuple
from detent.selection.compiler.tune_space import family_space, signature
from detent.tune_cost import Calls, EngineCost, Profile, group_calls, profile_workload
from detent.tune_kernels import KernelCost
from detent.tune_engine import (OBJECTIVES, Loop, TupleInstaller, check_objective, engine_facts, load_loops,
                                loop_requests)
from detent.tune_search import Search, TuneResult


@dataclass
class Tuned:
    result: TuneResult
    profile: Profile
    facts: dict[str, Any]
    calls: Calls
    unit: str
    phases: dict[str, float]  # seconds per phase: profile, search, confirm
    objective: str = OBJECTIVES[0]
    # with the kernel cost: the most weighed buckets, the default's and the search's pick's times
    # (`KernelCost.buckets`), to see where the two part
    kernel_buckets: list[dict[str, Any]] | None = None
    # under "tpot": the loops the workload was profiled and measured in ([{cap, loads, requests}],
    # cap None: every request at once) and, for Poisson loads, how they were found
    # (`tune_engine.load_loops`: the maximum throughput and each closed loop's, requests/s)
    loops: list[dict[str, Any]] | None = None
    throughput: dict[str, Any] | None = None


PROFILE_EVERY = 8  # decode-only steps per recorded one in the profile (detent/tune_engine.py SampledProfile)
SIGNATURE_INPUTS = 512  # per call site: the most called runtime inputs a repin's selections are compared on
CONFIRM_PROBE = 0.25  # with a deadline: the untimed run's share of the workload, timed to size the others
MIN_CONFIRM = 0.1  # with a deadline: the smallest share the confirmation runs on; below it, it is skipped
SEARCH_SHARE = 0.5  # with a deadline and a confirmation: the search's share of the time left after the profile
CONFIRM_CANDIDATES = 2  # the search's winner and its cheapest runner-up making other selections


def tune(llm, workload, *, cost: str | Callable[[TupleInstaller, Calls], Any] = "engine",
         families: list[str] | None = None, repeats: int = 1, dedupe: bool = True,
         confirm: str | Callable[[TupleInstaller, Calls], Any] | None = None,
         profile_every: int = PROFILE_EVERY, deadline: float | None = None, objective: str = OBJECTIVES[0],
         confirm_candidates: int = CONFIRM_CANDIDATES, loops: list[Loop] | None = None,
         max_throughput: float | None = None, progress: Callable[[str], None] = lambda s: None,
         **search: Any) -> Tuned:
    """dedupe: measure once for every set of assignments that select the same kernels and
    parameters on the profiled calls (`tune_space.signature`), and hold the axes that select
    nothing at the default's value. profile_every: the profile records every step with prompt
    rows and one decode-only step in this many, counted as many (1: every step, eagerly).
    confirm_candidates: how many of the search's tuples cheaper than the default, cheapest first,
    the confirmation measures (the winner, then its runners-up: `confirmed`). loops: under "tpot",
    the closed loops that stand for the workload's loads (`tune_engine.Loop`); None: measured on
    the engine (`load_loops`), each Poisson load as the closed loop of its arrival rate, a fraction
    of `max_throughput` (requests/s; None: measured, every request at once)."""
    check_objective(objective)
    facts = engine_facts(llm)
    base = default_tuple(facts)
    phases, mark = {}, [time.perf_counter()]

    def phase(name: str) -> None:
        now = time.perf_counter()
        phases[name], mark[0] = now - mark[0], now
    with tempfile.TemporaryDirectory(prefix="detent-tune-") as tmp:
        inst = TupleInstaller(llm, tmp, profile_every, objective)
        throughput = None
        if objective != "tpot":
            loops = None
        elif loops is None:  # the batches each load decodes in (docs/tune.md, "Every load replays as a closed loop")
            progress(f"measuring the closed loops {workload.name}'s loads run in (under the engine's tuple)")
            loops, throughput = load_loops(llm, workload, progress, max_throughput)
            phase("loops")
        sample = "every step" if profile_every == 1 else \
            f"steps with prompt rows and one decode-only step in {profile_every}"
        weigh = "each step's calls weighted by its decode rows" if objective == "tpot" else "every step alike"
        progress(f"profiling {workload.name} ({len(workload.requests)} requests) under the default tuple ({sample}; "
                 f"objective {objective}: {weigh})")
        calls = profile_workload(inst, base, workload, loops)
        prof = group_calls(calls)
        phase("profile")
        stats = inst.profile_stats
        if stats:
            progress(f"  {stats['decode_steps']} decode-only steps, {stats['replayed']} of them replayed "
                     f"unrecorded; {stats['decode_rows']} decode rows")
        if objective == "tpot" and not stats.get("decode_rows"):
            raise ValueError(f"detent tune: the profile of {workload.name} has no decode rows (every output one "
                             "token long?): there is no time per output token to tune for; use the 'time' "
                             "objective (--objective time)")
        for fam, sites in sorted(prof.items()):
            progress(f"  {fam}: {sum(len(c) for c in sites.values())} distinct runtime inputs over {len(sites)} "
                     f"site(s), {sum(sum(c.values()) for c in sites.values())} "
                     + ("decode-row-weighted step-calls" if objective == "tpot" else "step-calls"))
        wanted = families if families is not None else list(prof)
        spaces = [s for s in (family_space(facts, f) for f in wanted if f in prof) if s and len(s.legal) > 1]
        progress(f"searching {', '.join(s.family for s in spaces) or 'no family (nothing to choose)'}")
        if cost == "engine":
            model = EngineCost(inst, workload, repeats, objective, loops)
        elif cost == "kernels":
            tpot = objective == "tpot"
            model = KernelCost(calls, facts, tmp, families=[s.family for s in spaces], reps=max(3, repeats),
                               decode_rows=stats["decode_rows"] if tpot else None,
                               loops=inst.profile_loops if tpot else None)
            progress(f"timing {len(model.inputs)} bucketed kernel calls per candidate")
        elif callable(cost):
            model = cost(inst, calls)
        else:
            raise ValueError(f"cost model must be 'engine', 'kernels' or a function, got {cost!r}")
        sigs = {s.family: _signature_fn(s, facts, calls) for s in spaces} if dedupe else None
        until = None
        if deadline is not None:
            now = time.perf_counter()
            until = deadline if confirm is None else now + SEARCH_SHARE * max(deadline - now, 0.0)
            progress(f"the search may start measurements for {max(until - now, 0.0):.0f} s"
                     + (" (the rest is the confirmation's)" if confirm is not None else ""))
        res = Search(base, model, facts, signatures=sigs, progress=progress, deadline=until, **search).run(spaces)
        if getattr(model, "graph_timed", 0) or getattr(model, "host_timed", 0):
            progress(f"kernel calls timed inside CUDA graphs: {model.graph_timed}; "
                     f"on the host clock: {model.host_timed}")
        buckets = model.buckets(base, res.chosen) if isinstance(model, KernelCost) else None
        phase("search")
        if confirm is not None and res.chosen.hash != base.hash:
            check = (EngineCost(inst, workload, repeats, objective, loops) if confirm == "engine"
                     else confirm(inst, calls))
            res = confirmed(res, base, check, progress, deadline, candidates=confirm_candidates)
            phase("confirm")
    described = None if loops is None else [
        {"cap": loop.cap, "loads": list(loop.loads), "requests": len(loop_requests(workload, loop.cap).requests)}
        for loop in loops]
    return Tuned(res, prof, facts, calls, getattr(model, "unit", "cost"), phases, objective, buckets, described,
                 throughput or None)


def confirmed(res: TuneResult, base, model, progress: Callable[[str], None], deadline: float | None = None,
              clock: Callable[[], float] = time.perf_counter, candidates: int = 1) -> TuneResult:
    """The winner, and up to `candidates` - 1 of the search's runners-up (`res.alternates`),
    against the default on `model`: the default before and after them, after one untimed run. The
    cheapest of them is taken if it is cheaper than the default's cheaper run by more than the
    default's two runs differ; else the default stays. A runner-up is there for where the search's
    cost model and `model` disagree about the winner (lease 28's W-C: FlashAttention-4's attention
    kernels measured 25% cheaper per decode row, its engine steps 4.5% dearer). Without a deadline,
    on the whole workload. With one, the untimed run covers `CONFIRM_PROBE` of it and is timed;
    the timed runs (two of the default's and one a candidate) take the largest share that fits
    before the deadline with a tuple switch per candidate and one back (`model.max_install_s`,
    when the model knows it), with fewer runners-up where that share would be under
    `MIN_CONFIRM`; when even the winner alone falls under it, the confirmation is skipped and the
    default kept: an unconfirmed winner is not written. Each runner-up is measured only if it and
    the default's last run still fit, at the longest install and run seen so far."""
    unit = getattr(model, "unit", "cost")
    cands = [res.chosen] + [t for t in res.alternates if t.hash != res.chosen.hash][:max(candidates, 1) - 1]
    fraction = 1.0
    if deadline is None:
        progress(f"confirming {_confirming(len(cands))} against the default ({unit}; after one untimed run)")
        model.measure(base, 1.0)
    else:
        progress(f"confirming {_confirming(len(cands))} against the default ({unit}; {deadline - clock():.0f} s "
                 f"left; after one untimed run on {CONFIRM_PROBE:.0%} of the workload, timed to size the others)")
        t0 = clock()
        model.measure(base, CONFIRM_PROBE)
        run = max(clock() - t0 - getattr(model, "last_install_s", 0.0), 0.0) / CONFIRM_PROBE
        switch = getattr(model, "max_install_s", 0.0)

        def share(n: int) -> float:  # of the workload, for n candidates' runs and the default's two
            left = deadline - clock() - (n + 1) * switch
            return 1.0 if (n + 2) * run <= left else math.floor(100 * max(left, 0.0) / ((n + 2) * run)) / 100
        asked = len(cands)
        while len(cands) > 1 and share(len(cands)) < MIN_CONFIRM:
            cands.pop()
        fraction = share(len(cands))
        if fraction < MIN_CONFIRM:
            why = (f"{max(deadline - clock(), 0.0):.0f} s left before the time budget's end; three runs of "
                   f"{MIN_CONFIRM:.0%} of the workload and two tuple switches need about "
                   f"{3 * MIN_CONFIRM * run + 2 * switch:.0f}")
            progress(f"  not confirmed ({why}): kept the default")
            res.confirmed = {"unit": unit, "fraction": 0.0, "skipped": why, "kept_default": True}
            res.chosen, res.kept_default = base, True
            return res
        if fraction < 1.0:
            progress(f"  on the first {fraction:.0%} of the workload (a whole run takes about {run:.0f} s)"
                     + (f", {_confirming(len(cands))}" if len(cands) < asked else ""))
    slowest = 0.0  # the longest timed run so far, its install aside, per whole workload

    def timed(t, label: str) -> float:
        nonlocal slowest
        t0 = clock()
        cost = float(model.measure(t, fraction))
        install = getattr(model, "last_install_s", 0.0)
        measuring = clock() - t0 - install
        slowest = max(slowest, measuring / fraction)
        progress(f"    {label} {cost:.4g} ({install:.0f} s installing, {measuring:.0f} s measuring)")
        return cost

    first = timed(base, "default")
    costs: list[float] = []
    for i, t in enumerate(cands):
        if i and deadline is not None:
            # the installs and runs so far include the candidates' own (a tuple whose kernels are
            # new may install slower than the default, by which the share was sized; lease 33's
            # tune ended 12 s past this deadline): a runner-up is measured only if it and the
            # default's last run still fit
            need = 2 * (fraction * max(run, slowest) + getattr(model, "max_install_s", 0.0))
            if deadline - clock() < need:
                progress(f"  {max(deadline - clock(), 0.0):.0f} s left, a runner-up and the default's last run "
                         f"need about {need:.0f}: measured {_confirming(i)}")
                cands = cands[:i]
                break
        costs.append(timed(t, "tuned" if i == 0 else f"runner-up {i}"))
    last = timed(base, "default again")
    default = (first + last) / 2
    # the default's drift between its two runs is this measurement's noise: a candidate must beat
    # the default's cheaper run by more than it
    margin = abs(first - last)
    best = min(range(len(cands)), key=lambda i: costs[i])
    keep = costs[best] >= min(first, last) - margin
    others = "".join(f", runner-up {i} {c:.4g}" for i, c in enumerate(costs[1:], 1))
    progress(f"  default {first:.4g} / {last:.4g}, tuned {costs[0]:.4g}{others}: "
             + (f"kept the default (a candidate must be under {min(first, last) - margin:.4g})" if keep
                else f"{'tuned' if best == 0 else f'runner-up {best}'} is {100 * (1 - costs[best] / default):.1f}% "
                     "cheaper"))
    res.confirmed = {"unit": unit, "fraction": fraction, "default": default, "default_first_last": [first, last],
                     "margin": margin, "tuned": costs[best], "kept_default": keep}
    if len(cands) > 1:  # which was taken: 0 the search's winner, i its i-th runner-up
        res.confirmed.update(candidates=[{"tuple_hash": t.hash, "cost": c} for t, c in zip(cands, costs)],
                             taken=None if keep else best)
    if keep:
        res.chosen, res.kept_default = base, True
    else:  # the search's own pick stays in `res.pick` (the report's search_pick)
        res.chosen, res.kept_default = cands[best], False
    return res


def _confirming(n: int) -> str:
    return "the tuned tuple" if n == 1 else f"the tuned tuple and {n - 1} runner{'s' if n > 2 else ''}-up"


def _signature_fn(space, facts: dict[str, Any], calls: Calls) -> Callable[[dict], Any]:
    per_site: dict[tuple, list[tuple[int, tuple]]] = {}
    for (family, site, runtime), n in calls.items():
        if family == space.family:
            per_site.setdefault(site, []).append((n, runtime))
    inputs = {site: [dict(rt) for _, rt in sorted(v, key=lambda x: (-x[0], x[1]))[:SIGNATURE_INPUTS]]
              for site, v in per_site.items()}
    return lambda a: signature(space, facts, a, inputs)
