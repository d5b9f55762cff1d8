"""The tuple hash and deployment hash every response carries (docs/server.md).

With both, anyone running the same deployment and tuple can re-execute a
request and compare bits. Both come from SelIR (`detent.selection`): the
deployment hash is `deployment_hash(facts)` over the engine's completed
deployment facts, the tuple hash is `tuple_hash(t)` of the commitment tuple
in force — the `--tuple` file, or the default tuple for these facts — the
same values `detent tuple default|check` print. `stock` and `conservative`
run no tuple; their "tuple hash" names the mode instead, so it can never
equal a real tuple's. Callers outside the engine use `LLMEngine.fingerprint()`.

The fingerprint also carries what the hashes are made of — the completed
facts, the tuple in force (its JSON form; None for stock and conservative) and
the selection mode — so that a request log can record them and `detent
verify` can name the fact or pin that differs (engine/replay.py).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Fingerprint:
    tuple_hash: str
    deployment_hash: str
    facts: dict[str, Any] = field(default_factory=dict, compare=False)  # the completed deployment facts
    tuple: dict[str, Any] | None = field(default=None, compare=False)  # CommitmentTuple.to_dict(), pinned only
    selection: str = "pinned"


def fingerprint(facts: dict[str, Any], *, selection: str, tuple_path: str | None,
                active_tuple: Any = None, knobs: dict | None = None) -> Fingerprint:
    """The fingerprint of an engine built on `facts` in mode `selection`;
    `active_tuple` is the tuple its dispatcher already loaded, if any (under
    tensor parallelism the ranks hold it: then the tuple at `tuple_path`, or
    the default tuple with `knobs`)."""
    from detent.selection import CommitmentTuple, default_tuple, deployment_hash, tuple_hash
    from detent.selection.facts import complete

    facts = complete(facts)
    dep = deployment_hash(facts)
    if selection != "pinned":
        return Fingerprint(hashlib.sha256(f"detent-selection:{selection}:{dep}".encode()).hexdigest(), dep,
                           facts, None, selection)
    t = active_tuple
    if t is None:
        t = CommitmentTuple.load(tuple_path) if tuple_path else default_tuple(facts, knobs=knobs)
    return Fingerprint(tuple_hash(t), dep, facts, t.to_dict(), selection)
