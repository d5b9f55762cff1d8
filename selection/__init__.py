"""Kernel selection: SelIR programs, their solver, compiled selectors, the
commitment tuple, and the `ops` façade through which every kernel is called.

    from detent.selection import parse_program, solve
    sol = solve(parse_program(src), facts)      # sol.pins, sol.candidates, sol.legal, sol.graph
    sel = sol.compile(assignment, mode="pinned")
    sel(num_tokens=..., ...)                    # -> {"impl": ..., **params}
"""
from __future__ import annotations

from typing import Any

from detent.selection.dispatch import Dispatcher, get_dispatcher, use_dispatcher
from detent.selection.compiler.lang import SelectionError, SelIRError, SelIRSyntaxError, parse_program
from detent.selection.compiler.solver import MODES, IllegalAssignment, Solution, solve
from detent.selection.facts import default_facts_for, deployment_hash
from detent.selection.compiler.commitment import (CommitmentTuple, FactMismatch, TupleError, default_tuple,
                                                  tuple_hash)


def make_dispatcher(facts: dict[str, Any], mode: str = "pinned", tuple_path: str | None = None,
                    knobs: dict[str, dict[str, Any]] | None = None) -> Dispatcher:
    """The dispatcher the engine installs at startup for a deployment.

    mode "pinned" runs the commitment tuple at `tuple_path` (refused with a
    TupleError if its facts differ or an assignment is illegal) or, without
    one, the default tuple, with `knobs` ({family: {knob: value}}, e.g. the
    engine's attention_backend) set; "stock" runs the programs as written; and
    "conservative" one fixed candidate per family."""
    from detent.selection.facts import complete
    from detent.selection.provider import SelIRProvider
    if mode not in MODES:
        raise ValueError(f"selection mode must be one of {', '.join(MODES)}; got {mode!r}")
    facts = complete(facts)
    t = None
    if knobs and (tuple_path is not None or mode != "pinned"):
        raise ValueError(f"knobs {knobs} set the default tuple, which selection {mode!r} with tuple "
                         f"{tuple_path} does not run")
    if tuple_path is not None:
        if mode != "pinned":
            raise ValueError(f"a commitment tuple ({tuple_path}) only applies in selection mode 'pinned', "
                             f"not {mode!r}")
        t = CommitmentTuple.load(tuple_path)
        t.validate(facts)
    elif knobs:
        t = default_tuple(facts, knobs=knobs)
    d = Dispatcher(SelIRProvider(facts, mode, t))
    d.facts, d.tuple = facts, t
    return d


def active_tuple_hash(d: Dispatcher) -> str:
    """The hash of the tuple a pinned dispatcher runs (the default tuple's when none was given)."""
    t = getattr(d, "tuple", None) or default_tuple(d.facts)
    return tuple_hash(t)


__all__ = ["CommitmentTuple", "Dispatcher", "FactMismatch", "IllegalAssignment", "MODES", "SelIRError",
           "SelIRSyntaxError", "SelectionError", "Solution", "TupleError", "active_tuple_hash", "default_facts_for",
           "default_tuple",
           "deployment_hash", "get_dispatcher", "make_dispatcher", "parse_program", "solve",
           "tuple_hash", "use_dispatcher"]
