"""On-disk JIT cache of solves (docs/selir.md section 3), keyed by a hash of everything
that can change the answer: SelIR version, program source, facts, options.

Default location ``~/.cache/detent/selir/``; ``DETENT_SELIR_CACHE=/path``
moves it and ``DETENT_SELIR_CACHE=off`` disables it. Entries are data, never
code: JSON holding the solve's results (pin node ids, graph statistics, VRA
results) and a fingerprint of the lowered graph they refer to. A hit lowers
the program again (cheap) and checks the fingerprint, so nothing read from
the cache is executed or unpickled. An entry that is unreadable, not ours or
does not match is ignored with a warning, and the solve runs again and
rewrites it. Writes are atomic.
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
import warnings
from typing import Any

from detent.selection.compiler.lang import ABSENT, SELIR_VERSION

FORMAT = "detent-selir-cache/2"


class CacheWarning(UserWarning):
    """A JIT cache entry was ignored (it is solved again)."""


def cache_dir() -> str | None:
    env = os.environ.get("DETENT_SELIR_CACHE")
    if env is not None:
        return None if env.strip().lower() in ("", "off", "0", "none") else os.path.expanduser(env)
    return os.path.join(os.path.expanduser("~"), ".cache", "detent", "selir")


def canonical(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=repr)


def key(source: str, facts: dict, **options: Any) -> str:
    h = hashlib.sha256()
    h.update(canonical({"selir": SELIR_VERSION, "facts": facts, "options": options}).encode())
    h.update(b"\0")
    h.update(source.encode())
    return h.hexdigest()


# ---- a JSON encoding of the values a solve produces (tuples, sets, ABSENT)
def encode(v: Any) -> Any:
    if v is ABSENT:
        return {"$absent": True}
    if isinstance(v, bool) or v is None or isinstance(v, (int, float, str)):
        return v
    if isinstance(v, tuple):
        return {"$tuple": [encode(x) for x in v]}
    if isinstance(v, list):
        return [encode(x) for x in v]
    if isinstance(v, (set, frozenset)):
        return {"$set": sorted((encode(x) for x in v), key=canonical)}
    if isinstance(v, dict) and all(isinstance(k, str) for k in v):
        return {"$dict": {k: encode(x) for k, x in v.items()}}
    raise TypeError(f"the SelIR cache stores data only; cannot store a {type(v).__name__}")


def decode(v: Any) -> Any:
    if isinstance(v, list):
        return [decode(x) for x in v]
    if isinstance(v, dict):
        if set(v) == {"$absent"}:
            return ABSENT
        if set(v) == {"$tuple"}:
            return tuple(decode(x) for x in v["$tuple"])
        if set(v) == {"$set"}:
            return {decode(x) for x in v["$set"]}
        if set(v) == {"$dict"} and isinstance(v["$dict"], dict):
            return {k: decode(x) for k, x in v["$dict"].items()}
        raise ValueError(f"unknown cache record {sorted(v)[:3]}")
    return v


def _path(d: str, k: str) -> str:
    return os.path.join(d, k[:2], k + ".json")


def load(k: str) -> dict | None:
    """The entry's data, or None (absent, disabled, or ignored with a warning)."""
    d = cache_dir()
    if d is None:
        return None
    path = _path(d, k)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("key") != k:
            raise ValueError(f"not a {FORMAT} entry for this key")
        out = decode(doc["data"])
        if not isinstance(out, dict):
            raise ValueError("its data is not an object")
        return out
    except (ValueError, KeyError, TypeError, RecursionError, UnicodeDecodeError) as e:
        ignore(path, str(e))
        return None


def ignore(path: str, why: str) -> None:
    warnings.warn(f"SelIR cache entry {path} ignored ({why}); solving again", CacheWarning, stacklevel=3)


def store(k: str, payload: dict) -> None:
    d = cache_dir()
    if d is None:
        return
    try:
        text = json.dumps({"format": FORMAT, "key": k, "data": encode(payload)}, sort_keys=True)
    except (TypeError, ValueError):
        return  # a value the cache cannot hold as data: that solve is not cached
    sub = os.path.join(d, k[:2])
    try:
        os.makedirs(sub, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=sub, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, _path(d, k))
    except OSError:
        pass  # a read-only or full cache only costs a re-solve next time
