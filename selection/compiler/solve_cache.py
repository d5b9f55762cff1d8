"""A JIT cache hit (selection/compiler/jitcache.py holds the data): the program is
lowered again and the entry's pin node ids, graph statistics and VRA results
are taken only if the entry's fingerprint matches that lowering. Lowering
numbers the graph the same way in every process, so a hit written by one
process is a hit in the next.
"""
from __future__ import annotations

import hashlib
from typing import Any

from detent.selection.compiler import jitcache, lang
from detent.selection.compiler.cut import GraphStats
from detent.selection.compiler.lower import Lowered


def fingerprint(lw: Lowered) -> str:
    """A hash of a lowered graph's structure: a cache entry's pin node ids refer to it."""
    g = lw.graph
    h = hashlib.sha256()
    for op, args, val in zip(g.ops, g.args, g.vals):
        h.update(f"{op}|{args}|{val!r}\n".encode())
    h.update(repr(sorted(lw.outputs.items())).encode())
    return h.hexdigest()


def from_cache(prog: lang.Program, f: dict[str, Any], level: str, key: str, hit: dict, lw: Lowered,
               solution: Any) -> Any:
    """The cached solve, if its data matches `lw`, the program lowered again (else None, with a
    warning). `solution` is the solver's Solution class (passed in: this module is below the solver)."""
    try:
        if hit.get("graph") != fingerprint(lw):
            raise ValueError("it was solved from another lowering")
        pins = hit["pins"]
        if not (isinstance(pins, dict) and all(isinstance(n, int) and 0 <= n < len(lw.graph) for n in pins.values())):
            raise ValueError("malformed pins")
        vra = hit.get("vra", {})
        if not (isinstance(vra, dict) and isinstance(vra.get("candidates", {}), dict)
                and all(isinstance(v, tuple) for v in vra.get("candidates", {}).values())
                and isinstance(vra.get("default", {}), dict) and isinstance(vra.get("legal", []), list)
                and all(isinstance(a, tuple) and len(a) == 2 for a in vra.get("legal", []))):
            raise ValueError("malformed VRA results")
        st = dict(hit["stats"])
        st["batch_dependent_points"] = tuple(st["batch_dependent_points"])
        sol = solution(prog, f, lw, dict(pins), GraphStats(**st), level, float(hit["seconds"]), key,
                       {k: v for k, v in vra.items() if k in ("candidates", "default", "legal")})
    except (ValueError, KeyError, TypeError) as e:
        jitcache.ignore(f"for program {prog.name!r}", str(e))
        return None
    sol.from_cache = True
    return sol
