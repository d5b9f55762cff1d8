"""On-disk JIT cache of solves (docs/selir.md section 3), keyed by a hash of everything
that can change the answer: SelIR version, program source, facts, options.

Default location ``~/.cache/detent/selir/``; ``DETENT_SELIR_CACHE=/path``
moves it and ``DETENT_SELIR_CACHE=off`` disables it. Entries are pickles of
our own lowered graphs, written atomically; a corrupt entry is ignored and
rewritten.
"""
from __future__ import annotations

import hashlib
import json
import os
import pickle
import tempfile
from typing import Any

from detent.selection.compiler.lang import SELIR_VERSION


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


def load(k: str) -> Any | None:
    d = cache_dir()
    if d is None:
        return None
    path = os.path.join(d, k[:2], k + ".pkl")
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError, TypeError, ValueError):
        return None


def store(k: str, payload: Any) -> None:
    d = cache_dir()
    if d is None:
        return
    sub = os.path.join(d, k[:2])
    try:
        os.makedirs(sub, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=sub, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(payload, f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(tmp, os.path.join(sub, k + ".pkl"))
    except OSError:
        pass  # a read-only or full cache only costs a re-solve next time
