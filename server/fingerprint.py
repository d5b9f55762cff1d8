"""The tuple hash and deployment hash a response carries (DESIGN §1, §8).

With both, anyone running the same deployment and tuple can re-execute a
request and compare bits. Both come from SelIR (`detent.selection`): the
deployment hash is `deployment_hash(facts)` over the engine's completed
deployment facts, the tuple hash is `tuple_hash(t)` of the commitment tuple
in force — the `--tuple` file, or the default tuple for these facts — the
same values `detent tuple default|check` print. `stock` and `conservative`
run no tuple; their "tuple hash" names the mode instead, so it can never
equal a real tuple's.
"""
from __future__ import annotations

import hashlib
from typing import Any


def fingerprint(engine: Any, *, tuple_path: str | None, selection: str) -> tuple[str, str]:
    """(tuple_hash, deployment_hash) for a built engine."""
    from detent.selection import CommitmentTuple, default_tuple, deployment_hash, tuple_hash
    from detent.selection.facts import complete

    d = getattr(engine, "dispatcher", None)  # None at tp > 1: the ranks hold theirs
    facts = getattr(d, "facts", None) or complete(engine.facts)
    dep = deployment_hash(facts)
    if selection != "pinned":
        return hashlib.sha256(f"detent-selection:{selection}:{dep}".encode()).hexdigest(), dep
    t = getattr(d, "tuple", None)
    if t is None:
        t = CommitmentTuple.load(tuple_path) if tuple_path else default_tuple(facts)
    return tuple_hash(t), dep


def core_info(engine: Any, *, tuple_path: str | None, selection: str) -> dict[str, str]:
    """`fingerprint` as a dict, computed where the engine lives (the engine core's process)."""
    th, dh = fingerprint(engine, tuple_path=tuple_path, selection=selection)
    return {"tuple_hash": th, "deployment_hash": dh}
