"""Which selections a compiled selector can return on this deployment.

A pinned tuple fixes what a selection may read of the batch, but a selector
may still pick among a few launch configurations (GEMM tiles by M, the
attention tile for decode or prefill rows) that give a row the same bits.
That set is finite, and SelIR's value-range analysis already walks the
program's runtime domain (`VRA.points()`: every point when the domain is
small, else the boundaries, powers of two and their neighbours, plus a seeded
sample). Evaluating the selector at those points gives the selections the
deployment can reach, each with a runtime point that reaches it: what a warm
start must compile (engine/warmup.py).
"""
from __future__ import annotations

from typing import Any, Callable

from detent.selection.compiler.lang import SelectionError, SelIRError


def selection_key(sel: dict[str, Any]) -> tuple:
    """A hashable form of a selection dict."""
    return tuple(sorted(sel.items()))


def reachable(sol: Any, selector: Callable[..., dict]) -> dict[tuple, list[dict[str, Any]]]:
    """selection key -> the runtime points (as dicts of the inputs the program
    reads) at which `selector` returns it, over `sol.vra.points()`."""
    vra = sol.vra
    out: dict[tuple, list[dict[str, Any]]] = {}
    for p in vra.points():
        rt = dict(zip(vra.inputs, p))
        try:
            sel = selector(**rt)
        except (SelIRError, SelectionError):  # a point the selector's own checks refuse is not reached
            continue
        out.setdefault(selection_key(sel), []).append(rt)
    return out
