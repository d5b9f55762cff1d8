"""The tuner's search (docs/tune.md): one family at a time, over the family's
legal assignments only, with successive halving, then a check that the
families' gains add up.

Per family: a spread of the legal assignments (the default, each axis's
other values one axis at a time, then an evenly thinned grid's legal
points; at most `max_candidates`) is measured on a small share of the
workload; the best 1/eta go on to a share eta times larger,
until the whole workload; then the winner's neighbours along each axis are
tried (`refine` rounds of hill climbing). Every candidate is the default
tuple with that one family repinned, checked by the tuple loader before it
is measured (`TupleError` on an illegal one: a bug, never skipped).

Additivity: with T(default) the base and g_f = T(best_f) - T(default) each
family's gain, the combined tuple's predicted cost is T(default) + sum g_f.
It is measured, with `interactions` other mixes of the families' finalists;
delta = max |predicted - measured| / measured is reported. The tuple is the
cheapest measured on the whole workload (`Search._pick`): the combined
one where the gains add up, a mix or one family's repin where they do not,
and the default unless one of them measures cheaper.

With a `deadline` (a `clock()` value) the first rung starts no new
candidate once it has used its share of the time left at its start
(`Search._first_rung`), and no measurement starts after the deadline: a
family cut short takes its best candidate measured on the whole workload
(or keeps its default), the families not reached keep their defaults, and
the additivity check is left out; the tuple returned is then the one
measured family repin that beat the default most, or the default, never an
unmeasured combination. `TuneResult.cut` says where the time ran out.
`TuneResult.pick` names the tuple taken.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from detent.selection import CommitmentTuple
from detent.selection.compiler.tune_space import FamilySpace, family_assignment, with_family


@dataclass
class FamilyResult:
    family: str
    legal: int  # size of the family's legal grid
    default: dict[str, Any]
    chosen: dict[str, Any] | None = None
    # {"assignment", "costs": {fraction: cost}, "same_as": an assignment with the same selections, whose
    # measurement it shares (absent when it was measured itself)}
    tried: list[dict[str, Any]] = field(default_factory=list)
    inert: list[str] = field(default_factory=list)  # axes that change no selection on the profiled calls

    def cost(self, assignment: dict[str, Any], fraction: float = 1.0) -> float | None:
        for t in self.tried:
            if t["assignment"] == assignment:
                return t["costs"].get(fraction)
        return None


@dataclass
class TuneResult:
    base_cost: float
    families: dict[str, FamilyResult]
    checks: list[dict[str, Any]]  # {"label", "assignments", "predicted", "measured"}
    chosen: CommitmentTuple
    kept_default: bool
    base_costs: tuple[float, float] = ()  # the default tuple measured first and last
    # the search's winner against the default on a second cost model (tune(confirm=...)):
    # {"unit", "fraction", "default", "default_first_last", "margin", "tuned", "kept_default"}; None: not confirmed
    confirmed: dict[str, Any] | None = None
    cut: str | None = None  # where the search's deadline stopped it; None: it ran to the end
    # which measured tuple the search took ("default", "combined best", "mix 2", "gemm alone"), its
    # cost on the whole workload and its additive prediction
    pick: str = "default"
    pick_cost: float | None = None
    pick_predicted: float | None = None
    # the other tuples measured on the whole workload under the default's cost, cheapest first, each
    # making selections of its own (no `same_as` entry): the confirmation's runners-up
    alternates: list[CommitmentTuple] = field(default_factory=list)

    @property
    def delta(self) -> float:
        return max((abs(c["predicted"] - c["measured"]) / c["measured"] for c in self.checks), default=0.0)


def spread(space: FamilySpace, max_candidates: int, default: dict[str, Any],
           fixed: tuple[str, ...] = ()) -> list[dict[str, Any]]:
    """The first rung's assignments (at most `max_candidates`, all legal, the `fixed` axes at the
    default's value): the default; then each other axis's values one axis at a time, each at the
    legal point nearest the default (long axes thinned evenly, these sweeps taking at most half);
    then the legal points of an evenly thinned grid. The sweeps come first because a family's legal
    assignments often change one knob at a time, where a grid lands on few legal points."""
    pool = [a for a in space.legal if all(a[n] == default[n] for n in fixed)] or list(space.legal)
    out: dict[str, dict[str, Any]] = {}

    def add(a):
        if len(out) < max(1, max_candidates):
            out.setdefault(space.key(a), a)
    if default in pool:
        add(default)
    free = {n: list(v) for n, v in space.axes.items() if n not in fixed and n in default}
    while sum(len(v) - 1 for v in free.values()) > max(1, max_candidates // 2):
        name = max(free, key=lambda n: len(free[n]))
        if len(free[name]) <= 2:
            break
        free[name] = _thinned(free[name], (len(free[name]) + 1) // 2, default[name])
    off = lambda a: sum(a[m] != default[m] for m in default if m in a)  # noqa: E731
    for name, vals in sorted(free.items(), key=lambda kv: len(kv[1])):  # short axes first: a rung the
        for v in vals:  # deadline shortens (Search._first_rung) keeps every knob's other values
            at = [a for a in pool if a[name] == v and v != default[name]]
            if at:
                add(min(at, key=off))
    axes = {n: [default[n]] if n in fixed else list(v) for n, v in space.axes.items()}
    while math.prod(len(v) for v in axes.values()) > max_candidates:
        name = max(axes, key=lambda n: len(axes[n]))
        axes[name] = _thinned(axes[name], (len(axes[name]) + 1) // 2, default.get(name))
    for a in pool:
        if all(a[n] in axes[n] for n in axes):
            add(a)
    return list(out.values()) or list(space.legal[:1])


def _thinned(vals: list, k: int, keep: Any) -> list:
    """`k` of `vals` evenly spaced, with `keep` (the default's value) among them when it is one."""
    picked = [vals[round(i * (len(vals) - 1) / max(k - 1, 1))] for i in range(max(k, 1))] if k > 1 else [vals[0]]
    if keep in vals and keep not in picked:
        picked[min(range(len(picked)), key=lambda i: abs(vals.index(picked[i]) - vals.index(keep)))] = keep
    return picked


def _rungs(min_fraction: float, eta: int) -> list[float]:
    """The shares of the workload successive halving measures at: min_fraction * eta^i, then the whole."""
    out, f = [], min(max(min_fraction, 1e-6), 1.0)
    while f < 1.0:
        out.append(f)
        f *= eta
    return out + [1.0]


class OutOfTime(Exception):
    """The search's deadline passed before a measurement."""


class Search:
    def __init__(self, base: CommitmentTuple, cost, facts: dict[str, Any], *, max_candidates: int = 32,
                 eta: int = 3, min_fraction: float = 0.25, refine: int = 2, interactions: int = 3, seed: int = 0,
                 signatures: dict[str, Callable[[dict], Any]] | None = None,
                 progress: Callable[[str], None] = lambda s: None, deadline: float | None = None,
                 clock: Callable[[], float] = time.perf_counter):
        self.base, self.cost, self.facts = base, cost, facts
        self.signatures = signatures or {}  # family -> assignment -> what it selects on the profile
        self.max_candidates, self.eta, self.min_fraction = max_candidates, max(2, eta), min_fraction
        self.refine, self.interactions, self.rng = refine, interactions, random.Random(seed)
        self.progress, self.deadline, self.clock = progress, deadline, clock
        self.cut: str | None = None

    def _measure(self, t: CommitmentTuple, fraction: float, label: str, bounded: bool = True) -> float:
        """bounded: refused (`OutOfTime`) once the deadline has passed."""
        CommitmentTuple.from_json(t.to_json(), "candidate").validate(self.facts)  # TupleError if illegal
        if bounded and self.deadline is not None and self.clock() >= self.deadline:
            raise OutOfTime(label)
        c = float(self.cost.measure(t, fraction))
        self.progress(f"  {label} on {fraction:.0%} of the workload: {c:.4g}")
        return c

    def family(self, space: FamilySpace, base_cost: float) -> FamilyResult:
        default = family_assignment(self.base, space.family)
        res = FamilyResult(space.family, len(space.legal), default)
        sig_fn, sigs = self.signatures.get(space.family, space.key), {}

        def sig(a):
            k = space.key(a)
            if k not in sigs:
                sigs[k] = sig_fn(a)
            return sigs[k]
        if space.family in self.signatures and default in space.legal:  # axes that select nothing here
            res.inert = [n for n in space.axes
                         if len({sig(a) for a in space.legal if all(a[m] == default[m] for m in a if m != n)}) == 1]
        cands = spread(space, self.max_candidates, default, tuple(res.inert))
        self.progress(f"family {space.family}: {len(space.legal)} legal assignments, measuring {len(cands)} "
                      f"(successive halving, eta {self.eta})"
                      + (f"; {', '.join(res.inert)} select nothing on this workload" if res.inert else ""))
        entries, by_sig = {}, {}

        def entry(a):
            k = space.key(a)
            if k not in entries:
                entries[k] = {"assignment": a, "costs": {}}
                res.tried.append(entries[k])
            return entries[k]

        def run(a, fraction):
            e = entry(a)
            if fraction not in e["costs"]:
                s = (sig(a), fraction)
                if s in by_sig:  # the same kernels with the same parameters: no new measurement
                    e["costs"][fraction], e["same_as"] = by_sig[s]
                    self.progress(f"  {space.family} {a}: the same selections as {e['same_as']}, not measured")
                else:
                    e["costs"][fraction] = self._measure(with_family(self.base, space, a), fraction,
                                                         f"{space.family} {a}")
                    by_sig[s] = (e["costs"][fraction], a)
            return e["costs"][fraction]

        try:
            alive = cands
            for fraction in _rungs(self.min_fraction, self.eta):
                if alive is cands and fraction < 1.0:
                    alive = self._first_rung(space.family, cands, lambda a: run(a, fraction))
                ranked = sorted(alive, key=lambda a: run(a, fraction))
                alive = ranked if fraction == 1.0 else ranked[:max(1, math.ceil(len(ranked) / self.eta))]
            best = alive[0]
            for _ in range(self.refine):
                nb = [a for a in space.neighbours(best) if entry(a)["costs"].get(1.0) is None
                      and not any(a[n] != default[n] for n in res.inert)]
                if not nb:
                    break
                cand = min(nb, key=lambda a: run(a, 1.0))
                if run(cand, 1.0) >= run(best, 1.0):
                    break
                best = cand
        except OutOfTime as e:
            res.tried = [t for t in res.tried if t["costs"]]  # not the candidate the deadline stopped
            # the best measured on the whole workload, against the default's own cost there
            whole = [(t["costs"][1.0], t["assignment"]) for t in res.tried if 1.0 in t["costs"]]
            cost, best = min(whole + [(base_cost, default)], key=lambda x: x[0])
            best = default if cost >= base_cost else best
            self.cut = f"family {space.family}, before {e}"
            self.progress(f"family {space.family}: the search's time ran out before {e}")
        res.chosen = best
        cost = res.cost(best)  # None only for a default the cut search never measured whole
        cost = base_cost if cost is None else cost
        self.progress(f"family {space.family}: chose {best} ({cost:.4g}; default {base_cost:.4g})")
        return res

    def _first_rung(self, family: str, cands: list[dict[str, Any]], run: Callable[[dict], float]) -> list:
        """The first rung's candidates, measured in order. With a deadline, no new one starts once
        the rung has used its share of the time left at its start: its part of the halving's
        cost, were each measurement's time its share of the workload (0.41 at 0.25 and eta 3),
        less a fifth for the hill climb. Cut inside the first rung, a search would learn nothing
        on the whole workload and keep the default."""
        if self.deadline is None:
            return cands
        rungs = _rungs(self.min_fraction, self.eta)
        share = 0.8 * rungs[0] / sum(f / self.eta ** i for i, f in enumerate(rungs))
        start = self.clock()
        stop = start + share * (self.deadline - start)
        out = []
        for a in cands:
            if len(out) >= 2 and self.clock() >= stop:
                self.progress(f"family {family}: the first rung stops at {len(out)} of {len(cands)} "
                              f"candidates ({share:.0%} of the search's time left at its start)")
                break
            run(a)
            out.append(a)
        return out

    def _unreached(self, space: FamilySpace, base_cost: float) -> FamilyResult:
        """A family the deadline left unsearched: it keeps its default, nothing measured."""
        default = family_assignment(self.base, space.family)
        self.progress(f"family {space.family}: not searched (the search's time ran out), kept {default}")
        return FamilyResult(space.family, len(space.legal), default, default)

    def run(self, spaces: list[FamilySpace]) -> TuneResult:
        self.progress("measuring the default tuple (after one untimed run)")
        # no deadline stops these two: the default's cost is every comparison's
        self._measure(self.base, 1.0, "default tuple, warm-up", bounded=False)
        base_cost = self._measure(self.base, 1.0, "default tuple", bounded=False)
        if not spaces:  # nothing to choose: the default tuple is the tuple
            return TuneResult(base_cost, {}, [], self.base, False, (base_cost, base_cost))
        fams = {s.family: self.family(s, base_cost) if self.cut is None else self._unreached(s, base_cost)
                for s in spaces}
        if self.cut is not None:
            return self._best_single(fams, spaces, base_cost)
        try:
            again = self._measure(self.base, 1.0, "default tuple, again")
        except OutOfTime as e:
            self.cut = f"before {e}"
            return self._best_single(fams, spaces, base_cost)
        self.base_costs = (base_cost, again)  # the spread says how noisy the machine is
        base_cost = (base_cost + again) / 2
        byname = {s.family: s for s in spaces}

        def tuple_of(assign: dict[str, dict]) -> CommitmentTuple:
            return _repinned(self.base, fams, byname, assign)

        def predicted(assign: dict[str, dict]) -> float:
            return base_cost + sum(fams[f].cost(a) - base_cost for f, a in assign.items() if a != fams[f].default)

        combos = [("combined best", {f: r.chosen for f, r in fams.items()})]
        finalists = {f: [t["assignment"] for t in r.tried if 1.0 in t["costs"]] for f, r in fams.items()}
        seen = {repr(combos[0][1])}
        for _ in range(self.interactions * 4):
            if len(combos) > self.interactions or len(fams) < 2:
                break
            mix = {f: self.rng.choice(v) for f, v in finalists.items()}
            if repr(mix) not in seen and sum(mix[f] != fams[f].default for f in mix) >= 2:
                seen.add(repr(mix))
                combos.append((f"mix {len(combos)}", mix))
        checks = []
        self.progress("checking additivity")
        try:
            for label, mix in combos:
                m = self._measure(tuple_of(mix), 1.0, label)
                checks.append({"label": label, "assignments": mix, "predicted": predicted(mix), "measured": m})
        except OutOfTime as e:
            if not checks:  # the combined tuple unmeasured: only a measured repin may be chosen
                self.cut = f"before {e}"
                return self._best_single(fams, spaces, base_cost)
            self.cut = f"before {e} (the combined tuple was measured)"
        return self._pick(fams, spaces, base_cost, checks, self.base_costs)

    def _best_single(self, fams: dict[str, FamilyResult], spaces: list[FamilySpace],
                     base_cost: float) -> TuneResult:
        """After the deadline: no additivity check, so the pick is among the default and the
        family repins measured on the whole workload."""
        res = self._pick(fams, spaces, base_cost, [], (base_cost, base_cost))
        self.progress(f"the search's time ran out ({self.cut}): "
                      + ("kept the default tuple" if res.kept_default else f"took {res.pick} ({res.pick_cost:.4g})"))
        return res

    def _pick(self, fams: dict[str, FamilyResult], spaces: list[FamilySpace], base_cost: float,
              checks: list[dict[str, Any]], base_costs: tuple[float, float]) -> TuneResult:
        """The tuple: the cheapest one measured on the whole workload, of the default, each
        family's repin alone and the checked combinations (a tuple measured twice counts by its
        check). Where the gains add up that is the combined tuple; where families interact, the
        measurement decides. A tie keeps the default."""
        byname = {s.family: s for s in spaces}

        def moved(assign: dict[str, dict]) -> str:  # a tuple, by the families it repins
            return repr(sorted((f, sorted(a.items())) for f, a in assign.items() if a != fams[f].default))

        options = {moved({}): (base_cost, "default", {}, base_cost)}
        for f, r in fams.items():
            cost = r.cost(r.chosen)
            if r.chosen != r.default and cost is not None:
                options[moved({f: r.chosen})] = (cost, f"{f} alone", {f: r.chosen}, cost)
        for c in checks:  # a check measured its tuple again, after the search: its number stands
            if moved(c["assignments"]) != moved({}):
                options[moved(c["assignments"])] = (c["measured"], c["label"], c["assignments"], c["predicted"])
        # the first of equals is taken, and the default is first
        cost, label, assign, predicted = min(options.values(), key=lambda o: o[0])
        chosen = _repinned(self.base, fams, byname, assign)
        # runners-up: every other measured option and every family's other repins measured whole
        ranked = [(o[0], o[2]) for o in options.values()]
        ranked += [(t["costs"][1.0], {f: t["assignment"]}) for f, r in fams.items() for t in r.tried
                   if 1.0 in t["costs"] and "same_as" not in t and t["assignment"] != r.default]
        alternates, seen = [], {chosen.hash, self.base.hash}
        for c, a in sorted(ranked, key=lambda x: x[0]):
            t = _repinned(self.base, fams, byname, a)
            if c < base_cost and t.hash not in seen:
                seen.add(t.hash)
                alternates.append(t)
        return TuneResult(base_cost, fams, checks, chosen, label == "default", base_costs, cut=self.cut,
                          pick=label, pick_cost=cost, pick_predicted=predicted, alternates=alternates)


def _repinned(base: CommitmentTuple, fams: dict[str, FamilyResult], byname: dict[str, FamilySpace],
              assign: dict[str, dict]) -> CommitmentTuple:
    """`base` with each family of `assign` that moves from its default repinned."""
    t = base
    for f, a in assign.items():
        if a != fams[f].default:
            t = with_family(t, byname[f], a)
    return t
