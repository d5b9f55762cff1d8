"""What the tuner measures (docs/tune.md): the workload's profile under the
default tuple, and the cost of a candidate tuple.

A cost model is anything with `measure(t, fraction) -> float` (lower is
better): the cost of running the first `fraction` of the workload under
commitment tuple `t`. `EngineCost` is the real one: it installs `t` on a
loaded engine and times the workload's steps offline, in milliseconds per
output token: under the "tpot" objective the engine's row-weighted step time
(`row_weighted_ms`), under "time" wall time over output tokens. Tests use a
fake one with a known optimum.
"""
from __future__ import annotations

import math
import statistics
from collections import Counter, defaultdict
from typing import Any, Protocol

from detent.engine import STEP_KIND_FIELDS
from detent.selection import CommitmentTuple
from detent.selection.facts import site_key
from detent.tune_engine import (Loop, TupleInstaller, check_objective, closed_loops, loop_requests, loops_unit,
                                run_offline)

# positions in LLMEngine.stats()["steps_by_kind"][kind]
STEPS, LAUNCH, ROWS, ROW_SECONDS = map(STEP_KIND_FIELDS.index,
                                       ("steps", "launch_seconds", "decode_rows", "decode_row_seconds"))


class CostModel(Protocol):
    def measure(self, t: CommitmentTuple, fraction: float) -> float: ...


def row_weighted_ms(before: dict, after: dict, add_launch: bool) -> float:
    """The mean step time a decode row waited for between two `steps_by_kind` snapshots: the
    decode rows' step seconds over the decode rows, in ms (what benchmarks/serve_load.py reads
    from a server as row_weighted_ms; within 0.4 ms of its mean TPOT at 20 req/s).

    The engine times a step from the return of its launch (or the previous step's end, if later)
    to its end (engine/step_stats.py `StepStats.on_collect`). Under async scheduling that is the step's
    whole cycle; on a synchronous step loop (CPU, or CUDA without async scheduling) it leaves
    the launch out, and on CPU the launch is the whole forward. With `add_launch`, each step
    kind's mean launch time is added for each of its decode rows: exact where a kind's steps
    launch in equal times, an estimate otherwise."""
    rows = seconds = 0.0
    for kind, now in after.items():
        d = [a - b for a, b in zip(now, before.get(kind, (0,) * len(now)))]
        rows += d[ROWS]
        seconds += d[ROW_SECONDS] + (d[LAUNCH] / d[STEPS] * d[ROWS] if add_launch and d[STEPS] else 0.0)
    if rows <= 0:
        raise ValueError("the run generated no decode rows (every output one token long?): its time per output "
                         "token after the first is undefined; tune with the 'time' objective (--objective time)")
    return 1e3 * seconds / rows


class EngineCost:
    """Milliseconds per output token of `workload.head(fraction)` replayed on the engine under `t`
    (median of `repeats`, after a short untimed warm-up that compiles the new kernels' shapes):
    the engine's row-weighted step time ("tpot") or wall time over output tokens ("time").

    Under "tpot", a workload of several loops (`loops`, detent/tune_engine.py `load_loops`: W-C's
    closed loops of 1 and 8, or the closed loops that stand for W-B's Poisson loads; default the
    workload's closed loops) costs the geometric mean of each loop's row-weighted step time, one
    weight per load a loop stands for, the way the arms' report sets a tuple against another
    (benchmarks/arms_report.py: the geometric mean over a workload's loads). Pooled over both
    loops, the decode rows of eight 8k documents at a time (26 ms a token) outweigh those of one
    (6.5 ms): lease 27's FA4 tuple, +2.8 ms a token at 1 and -2.6 at 8, was even pooled and 1.14
    times the default in the report. Each loop replays its own head of the workload
    (`loop_requests`)."""

    def __init__(self, installer: TupleInstaller, workload, repeats: int = 1, objective: str = "tpot",
                 loops: list[Loop] | None = None):
        self.installer, self.workload, self.repeats = installer, workload, max(1, repeats)
        self.objective = check_objective(objective)
        self.loops = (loops or closed_loops(workload)) if self.objective == "tpot" else [Loop(None)]
        self.unit = "ms per output token" + (", row-weighted step time" if objective == "tpot" else "") + (
            loops_unit(self.loops) if len(self.loops) > 1 else "")

    @property
    def last_install_s(self) -> float:
        """The last measurement's install (0 when the tuple was in place)."""
        return self.installer.last_install_s

    @property
    def max_install_s(self) -> float:
        """The longest tuple install on this engine so far: what switching tuples costs."""
        return max(self.installer.install_seconds, default=0.0)

    def measure(self, t: CommitmentTuple, fraction: float) -> float:
        self.installer.install(t)
        w = self.workload.head(fraction)
        run_offline(self.installer.llm, w.head(min(1.0, 4 / len(w.requests))), max_tokens_cap=2)
        eng, costs = self.installer.llm.llm_engine, []
        for _ in range(self.repeats):
            if self.objective == "tpot":
                logs = []
                for loop in self.loops:
                    before = eng.stats()["steps_by_kind"]
                    run_offline(self.installer.llm, loop_requests(w, loop.cap), caps=[loop.cap])
                    logs.append(loop.weight * math.log(row_weighted_ms(before, eng.stats()["steps_by_kind"],
                                                                       not eng.async_scheduling)))
                costs.append(math.exp(sum(logs) / sum(loop.weight for loop in self.loops)))
            else:
                seconds, tokens = run_offline(self.installer.llm, w)
                costs.append(1e3 * seconds / max(tokens, 1))
        return statistics.median(costs)


Calls = dict[tuple, int]  # (family, site items, runtime items) -> weight: steps that made the call
#                           ("time"), or those steps' decode rows ("tpot"; detent/tune_engine.py)
Profile = dict[str, dict[str, Counter]]  # family -> site key -> Counter(runtime inputs -> count)


def profile_workload(installer: TupleInstaller, base: CommitmentTuple, workload,
                     loops: list[Loop] | None = None) -> Calls:
    """Serve the workload under `base` (the default tuple), once per loop (`loops`, default its
    closed loops; each its own head, `loop_requests`), and return every distinct (family, call
    site, runtime inputs) the dispatcher saw, with its weight under the installer's objective:
    how many steps saw it, or ("tpot") those steps' decode rows. Each loop's own share, and its
    decode rows, go to `installer.profile_loops`."""
    installer.install(base, record=True)
    out, seen, rows = [], Counter(), 0
    for loop in loops or closed_loops(workload):
        run_offline(installer.llm, loop_requests(workload, loop.cap), caps=[loop.cap])
        now, now_rows = Counter(installer.calls()), installer.profile_rows()
        out.append((loop, dict(now - seen), now_rows - rows))
        seen, rows = now, now_rows
    installer.profile_loops = out
    installer.profile_stats = installer.end_profile()
    return dict(seen)


def group_calls(calls: Calls) -> Profile:
    out: Profile = defaultdict(dict)
    for (family, site, runtime), n in calls.items():
        out[family].setdefault(site_key(dict(site)), Counter())[runtime] += n
    return dict(out)


def profile_summary(profile: Profile, top: int = 20) -> dict[str, Any]:
    """The profile as JSON: per family and site, the number of distinct runtime inputs, the calls,
    and the `top` most frequent inputs with their counts."""
    out: dict[str, Any] = {}
    for family, sites in sorted(profile.items()):
        out[family] = {}
        for sk, counts in sorted(sites.items()):
            out[family][sk] = {"distinct": len(counts), "calls": sum(counts.values()),
                               "top": [[dict(rt), n] for rt, n in counts.most_common(top)]}
    return out
