"""The tuple hash and deployment hash a response carries (DESIGN §1, §8).

With both, anyone running the same deployment and tuple can re-execute a
request and compare bits. The engine (SelIR's commitment tuple) is the
authority: its `tuple_hash` / `deployment_hash` are used when it exposes
them. Otherwise they are computed here from what defines them: the
deployment facts (plus engine version and model identity) and the tuple
file's canonical JSON, or the default tuple's (mode, facts) when none was
given.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any


def _h(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()).hexdigest()


def _first(objs: list[Any], name: str) -> str | None:
    for o in objs:
        v = getattr(o, name, None)
        v = v() if callable(v) else v
        if isinstance(v, str) and v:
            return v
    return None


def fingerprint(engine: Any, *, model: str | None, tuple_path: str | None, selection: str) -> tuple[str, str]:
    """(tuple_hash, deployment_hash) for a built engine."""
    from detent import __version__

    dispatcher = getattr(engine, "dispatcher", None)
    sources = [engine, dispatcher, getattr(dispatcher, "provider", None),
               getattr(getattr(dispatcher, "provider", None), "tuple", None)]
    sources = [s for s in sources if s is not None]
    facts = getattr(engine, "facts", None) or {}
    deployment = _first(sources, "deployment_hash") or _first(sources, "facts_hash") or \
        _h({"detent": __version__, "model": model or "embedded:SmolLM2-135M-Instruct", "facts": facts})
    tuple_hash = _first(sources, "tuple_hash")
    if tuple_hash is None:
        if tuple_path is not None:
            try:
                with open(tuple_path) as f:
                    tuple_hash = _h(json.load(f))
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"commitment tuple {tuple_path}: {e}") from None
        else:
            tuple_hash = _h({"default_tuple": selection, "facts": facts})
    return tuple_hash, deployment
