"""The SelIR selector provider the dispatcher asks for one selector per
(family, call site): the family's program specialised to the deployment
facts plus the site facts, compiled in the deployment's selection mode."""
from __future__ import annotations

from typing import Any, Callable

from detent.selection import programs
from detent.selection.compiler.commitment import CommitmentTuple, resolve
from detent.selection.compiler.solver import solve


class SelIRProvider:
    def __init__(self, facts: dict[str, Any], mode: str = "pinned", tuple_: CommitmentTuple | None = None):
        self.facts, self.mode, self.tuple = dict(facts), mode, tuple_
        self.assignments: dict[tuple[str, str], dict] = {}  # what each site runs with (pinned mode)

    def selector(self, family: str, site: dict[str, Any]) -> Callable[..., dict]:
        try:
            prog = programs.load(family)
        except KeyError as e:
            raise KeyError(str(e.args[0])) from None
        if self.mode == "pinned":
            sol, assignment = resolve(family, self.facts, site, self.tuple)
            from detent.selection.facts import site_key
            self.assignments[(family, site_key(site))] = assignment
            return sol.compile(assignment, mode="pinned", check_legal=False)
        sol = solve(prog, {**self.facts, **site})
        return sol.compile(mode=self.mode)


class FamilyOverride:
    """A provider answering one family with a fixed selection (or with
    `base`'s selection updated by `extra` parameters) and every other family
    as `base` does: for experiments that vary one candidate (e.g. the
    all-reduce algorithm) or one parameter, with everything else selected as
    deployed."""

    def __init__(self, base, family: str, selection: dict[str, Any] | None = None, *,
                 extra: dict[str, Any] | None = None):
        if (selection is None) == (extra is None):
            raise ValueError("FamilyOverride: give exactly one of a selection and extra parameters")
        self.base, self.family, self.mode = base, family, base.mode
        self.selection, self.extra = selection and dict(selection), extra and dict(extra)

    def selector(self, family: str, site: dict[str, Any]) -> Callable[..., dict]:
        if family != self.family:
            return self.base.selector(family, site)
        if self.selection is not None:
            return lambda **runtime: dict(self.selection)
        inner = self.base.selector(family, site)
        return lambda **runtime: {**inner(**runtime), **self.extra}
