"""`tune(llm, workload)`: the tuner as a function (docs/tune.md); `detent tune`
(detent/tune_cli.py) wraps it. Profile the workload under the default tuple,
search the families the workload calls that have a choice, and return the
result with the profile.

    from detent.tune import tune
    out = tune(llm, make("W-A", num_requests=32), progress=print)
    out.result.chosen.save("t.json")

`cost`: "engine" (default: `EngineCost`, the workload's steps timed on this
engine), "kernels" (`KernelCost`, the profiled kernel calls timed one by
one), or a function (installer, profiled calls) -> cost model; tests pass a
fake one. `confirm`: None, "engine" or such a function: the search's winner
and the default measured again on that model (the default before and after),
and the default kept unless the winner is cheaper there; `detent tune --cost
kernels` confirms on the engine, so a fast search still answers to the
workload's own steps.
"""
from __future__ import annotations

import tempfile
from dataclasses import dataclass
from typing import Any, Callable

from detent.selection import default_tuple
from detent.selection.compiler.tune_space import family_space, signature
from detent.tune_cost import Calls, EngineCost, Profile, group_calls, profile_workload
from detent.tune_kernels import KernelCost
from detent.tune_engine import TupleInstaller, engine_facts
from detent.tune_search import Search, TuneResult


@dataclass
class Tuned:
    result: TuneResult
    profile: Profile
    facts: dict[str, Any]
    calls: Calls
    unit: str


PROFILE_EVERY = 8  # decode-only steps per recorded one in the profile (detent/tune_engine.py SampledProfile)
SIGNATURE_INPUTS = 512  # per call site: the most called runtime inputs a repin's selections are compared on


def tune(llm, workload, *, cost: str | Callable[[TupleInstaller, Calls], Any] = "engine",
         families: list[str] | None = None, repeats: int = 1, dedupe: bool = True,
         confirm: str | Callable[[TupleInstaller, Calls], Any] | None = None,
         profile_every: int = PROFILE_EVERY,
         progress: Callable[[str], None] = lambda s: None, **search: Any) -> Tuned:
    """dedupe: measure once for every set of assignments that select the same kernels and
    parameters on the profiled calls (`tune_space.signature`), and hold the axes that select
    nothing at the default's value. profile_every: the profile records every step with prompt
    rows and one decode-only step in this many, counted as many (1: every step, eagerly)."""
    facts = engine_facts(llm)
    base = default_tuple(facts)
    with tempfile.TemporaryDirectory(prefix="detent-tune-") as tmp:
        inst = TupleInstaller(llm, tmp, profile_every)
        sample = "every step" if profile_every == 1 else \
            f"steps with prompt rows and one decode-only step in {profile_every}"
        progress(f"profiling {workload.name} ({len(workload.requests)} requests) under the default tuple ({sample})")
        calls = profile_workload(inst, base, workload)
        prof = group_calls(calls)
        if inst.profile_stats:
            progress(f"  {inst.profile_stats['decode_steps']} decode-only steps, "
                     f"{inst.profile_stats['replayed']} of them replayed unrecorded")
        for fam, sites in sorted(prof.items()):
            progress(f"  {fam}: {sum(len(c) for c in sites.values())} distinct runtime inputs over {len(sites)} "
                     f"site(s), {sum(sum(c.values()) for c in sites.values())} step-calls")
        wanted = families if families is not None else list(prof)
        spaces = [s for s in (family_space(facts, f) for f in wanted if f in prof) if s and len(s.legal) > 1]
        progress(f"searching {', '.join(s.family for s in spaces) or 'no family (nothing to choose)'}")
        if cost == "engine":
            model = EngineCost(inst, workload, repeats)
        elif cost == "kernels":
            model = KernelCost(calls, facts, tmp, families=[s.family for s in spaces], reps=max(3, repeats))
            progress(f"timing {len(model.inputs)} bucketed kernel calls per candidate")
        elif callable(cost):
            model = cost(inst, calls)
        else:
            raise ValueError(f"cost model must be 'engine', 'kernels' or a function, got {cost!r}")
        sigs = {s.family: _signature_fn(s, facts, calls) for s in spaces} if dedupe else None
        res = Search(base, model, facts, signatures=sigs, progress=progress, **search).run(spaces)
        if getattr(model, "graph_timed", 0) or getattr(model, "host_timed", 0):
            progress(f"kernel calls timed inside CUDA graphs: {model.graph_timed}; "
                     f"on the host clock: {model.host_timed}")
        if confirm is not None and res.chosen.hash != base.hash:
            check = EngineCost(inst, workload, repeats) if confirm == "engine" else confirm(inst, calls)
            res = confirmed(res, base, check, progress)
    return Tuned(res, prof, facts, calls, getattr(model, "unit", "cost"))


def confirmed(res: TuneResult, base, model, progress: Callable[[str], None]) -> TuneResult:
    """The winner against the default on `model` (the whole workload; the default before and
    after it, after one untimed run): the default stays unless the winner is cheaper."""
    unit = getattr(model, "unit", "cost")
    progress(f"confirming the tuned tuple against the default ({unit}; after one untimed run)")
    model.measure(base, 1.0)
    first = float(model.measure(base, 1.0))
    tuned = float(model.measure(res.chosen, 1.0))
    last = float(model.measure(base, 1.0))
    default = (first + last) / 2
    keep = tuned >= default
    progress(f"  default {first:.4g} / {last:.4g}, tuned {tuned:.4g}: "
             + ("kept the default" if keep else f"tuned is {100 * (1 - tuned / default):.1f}% cheaper"))
    res.confirmed = {"unit": unit, "default": default, "default_first_last": [first, last], "tuned": tuned,
                     "kept_default": keep}
    if keep:
        res.chosen, res.kept_default = base, True
    return res


def _signature_fn(space, facts: dict[str, Any], calls: Calls) -> Callable[[dict], Any]:
    per_site: dict[tuple, list[tuple[int, tuple]]] = {}
    for (family, site, runtime), n in calls.items():
        if family == space.family:
            per_site.setdefault(site, []).append((n, runtime))
    inputs = {site: [dict(rt) for _, rt in sorted(v, key=lambda x: (-x[0], x[1]))[:SIGNATURE_INPUTS]]
              for site, v in per_site.items()}
    return lambda a: signature(space, facts, a, inputs)
