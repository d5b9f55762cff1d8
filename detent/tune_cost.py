"""What the tuner measures (docs/tune.md): the workload's profile under the
default tuple, and the cost of a candidate tuple.

A cost model is anything with `measure(t, fraction) -> float` (lower is
better): the cost of running the first `fraction` of the workload under
commitment tuple `t`. `EngineCost` is the real one: it installs `t` on a
loaded engine and times the workload's steps offline, in milliseconds of
wall time per output token. Tests use a fake one with a known optimum.
"""
from __future__ import annotations

import statistics
from collections import Counter, defaultdict
from typing import Any, Protocol

from detent.selection import CommitmentTuple
from detent.selection.facts import site_key
from detent.tune_engine import TupleInstaller, run_offline


class CostModel(Protocol):
    def measure(self, t: CommitmentTuple, fraction: float) -> float: ...


class EngineCost:
    """Milliseconds per output token of `workload.head(fraction)` replayed on the engine under `t`
    (median of `repeats`, after a short untimed warm-up that compiles the new kernels' shapes)."""

    unit = "ms per output token"

    def __init__(self, installer: TupleInstaller, workload, repeats: int = 1):
        self.installer, self.workload, self.repeats = installer, workload, max(1, repeats)

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
        costs = []
        for _ in range(self.repeats):
            seconds, tokens = run_offline(self.installer.llm, w)
            costs.append(1e3 * seconds / max(tokens, 1))
        return statistics.median(costs)


Calls = dict[tuple, int]  # (family, site items, runtime items) -> steps that made the call
Profile = dict[str, dict[str, Counter]]  # family -> site key -> Counter(runtime inputs -> count)


def profile_workload(installer: TupleInstaller, base: CommitmentTuple, workload) -> Calls:
    """Serve the workload under `base` (the default tuple) and return every distinct
    (family, call site, runtime inputs) the dispatcher saw, with how many steps saw it."""
    installer.install(base, record=True)
    run_offline(installer.llm, workload)
    calls = installer.calls()
    installer.profile_stats = installer.end_profile()
    return calls


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
