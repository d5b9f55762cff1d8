"""Kernel selection: SelIR programs, their solver, compiled selectors, the
commitment tuple, and the `ops` façade through which every kernel is called."""
from __future__ import annotations

from typing import Any

from detent.selection.dispatch import Dispatcher, get_dispatcher, set_dispatcher, use_dispatcher

MODES = ("pinned", "stock", "conservative")


def make_dispatcher(facts: dict[str, Any], mode: str = "pinned", tuple_path: str | None = None) -> Dispatcher:
    """The dispatcher the engine installs at startup for a deployment."""
    from detent.selection.interim import InterimProvider
    return Dispatcher(InterimProvider(facts, mode))


__all__ = ["Dispatcher", "MODES", "get_dispatcher", "make_dispatcher", "set_dispatcher", "use_dispatcher"]
