"""A kernel family's search space for the tuner (docs/tune.md): the legal
family-wide assignments, and repinning a tuple to one of them.

The tuner gives a family one assignment for all its call sites, so the
family's space is the assignments legal at every site (the VRA's legal sets,
intersected). Its axes are the family's pins and knobs. A candidate tuple is
the base tuple with one family's entry replaced: a repin, with no re-solve
(the solutions come from the JIT cache and the process's memory).
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass
from typing import Any

from detent.selection import programs
from detent.selection.compiler.commitment import CommitmentTuple
from detent.selection.compiler.jitcache import canonical
from detent.selection.compiler.lang import SelIRError
from detent.selection.compiler.solver import solve
from detent.selection.compiler.vra import MAX_ASSIGNMENTS, sort_key
from detent.selection.facts import site_key, sites_for


@dataclass(frozen=True)
class FamilySpace:
    family: str
    pins: tuple[str, ...]
    knobs: tuple[str, ...]
    axes: dict[str, tuple]  # name -> the values it takes in the legal assignments, sorted
    legal: tuple[dict[str, Any], ...]  # legal at every site, in axis order
    sites: tuple[str, ...]  # the site keys judged

    def key(self, assignment: dict[str, Any]) -> str:
        return canonical(assignment)

    def neighbours(self, assignment: dict[str, Any]) -> list[dict[str, Any]]:
        """The legal assignments one step away along one axis (the next smaller or larger value)."""
        legal = {self.key(a): a for a in self.legal}
        out = []
        for name, vals in self.axes.items():
            i = next((j for j, v in enumerate(vals) if v == assignment[name] and type(v) is type(assignment[name])),
                     None)
            if i is None:
                continue
            for j in (i - 1, i + 1):
                if 0 <= j < len(vals):
                    b = legal.get(self.key({**assignment, name: vals[j]}))
                    if b is not None:
                        out.append(b)
        return out


def _legal_at(sol) -> list[dict[str, Any]]:
    """Every legal assignment of one site's solution; past the VRA's enumeration
    limit, the product of candidates and knob choices judged one by one."""
    try:
        return sol.legal
    except SelIRError:
        axes = [sol.candidates[p] for p in sol.pins] + [sol.knobs[k][0] for k in sol.knobs]
        names = list(sol.pins) + list(sol.knobs)
        out = []
        for combo in itertools.islice(itertools.product(*axes), MAX_ASSIGNMENTS):
            a = dict(zip(names, combo))
            if sol.is_legal(a):
                out.append(a)
        return out


def family_space(facts: dict[str, Any], family: str) -> FamilySpace | None:
    """The family's legal family-wide assignments on this deployment, or None when
    it has no call site or nothing to choose (no pin, no knob)."""
    sites = sites_for(facts, family)
    if not sites:
        return None
    prog = programs.load(family)
    sols = [solve(prog, {**facts, **s}) for s in sites]
    pins, knobs = tuple(sols[0].pins), tuple(sols[0].knobs)
    if not pins and not knobs:
        return None
    for s, sol in zip(sites, sols):
        if tuple(sol.pins) != pins or tuple(sol.knobs) != knobs:
            raise SelIRError(f"family {family!r}: site {site_key(s)} has pins {list(sol.pins)} and knobs "
                             f"{list(sol.knobs)}, site {site_key(sites[0])} {list(pins)} and {list(knobs)}: "
                             "one family-wide assignment cannot fit both")
    per_site = [{canonical(a): a for a in _legal_at(sol)} for sol in sols]
    common = set(per_site[0]).intersection(*per_site[1:])
    names = pins + knobs
    legal = sorted((per_site[0][k] for k in common), key=lambda a: [sort_key(a[n]) for n in names])
    axes = {n: tuple(sorted({a[n] for a in legal}, key=sort_key)) for n in names}
    return FamilySpace(family, pins, knobs, axes, tuple(legal), tuple(site_key(s) for s in sites))


def signature(space: FamilySpace, facts: dict[str, Any], assignment: dict[str, Any],
              inputs: dict[tuple, list[dict[str, Any]]]) -> tuple:
    """What the family selects under `assignment` on `inputs` (call site items -> runtime inputs):
    two assignments with one signature run the same kernels with the same parameters there, so
    one measurement stands for both (a pin or knob that only shapes the legal values, e.g.
    attention's `split_stride`, changes nothing here). Legality is `space.legal`'s, not re-judged."""
    prog = programs.load(space.family)
    out = []
    for site, runtimes in sorted(inputs.items()):
        sel = solve(prog, {**facts, **dict(site)}).compile(assignment, check_legal=False)
        out.append(tuple(canonical(sel(**rt)) for rt in runtimes))
    return tuple(out)


def with_family(t: CommitmentTuple, space: FamilySpace, assignment: dict[str, Any]) -> CommitmentTuple:
    """`t` with `space.family` repinned to `assignment` at every site (its site overrides dropped)."""
    families = copy.deepcopy(t.families)
    families[space.family] = {"pins": {p: assignment[p] for p in space.pins},
                              "knobs": {k: assignment[k] for k in space.knobs}, "sites": {}}
    return CommitmentTuple(dict(t.facts), families, "tuned tuple")


def family_assignment(t: CommitmentTuple, family: str) -> dict[str, Any]:
    """The family's tuple entry as one flat assignment (its site overrides ignored)."""
    ent = t.families.get(family, {})
    return {**ent.get("pins", {}), **ent.get("knobs", {})}
