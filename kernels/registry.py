"""Kernel candidate registry: the bottom of the house (it imports nothing of ours).

A candidate is a function registered under (family, name). A selection is a
dict ``{"impl": name, **params}``; the dispatcher (selection/dispatch.py)
looks the candidate up by name and calls it with the call's tensors plus the
selection's parameters. Each kernels/ module registers its candidates on
import, and importing this module imports the kernels/ package first, so a
caller that holds the registry sees every candidate that runs here.

A candidate that needs an optional package or device (FlashAttention-4)
records why it is not registered here (`unavailable`), so asking for it by
name says what is missing and how to install it instead of "no candidate".
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Candidate:
    family: str
    name: str
    fn: Callable
    params: tuple[str, ...]  # the selection parameters it accepts
    devices: tuple[str, ...]  # device types it runs on ("cpu", "cuda")
    # the compiles a step needs beyond what its selection fixes (the warm start covers them):
    # variants(selection, *, query_lens, kv_lens, num_sms, **site) -> set, where site is the
    # call site's values (attention's num_heads and num_kv_heads, the MoE's num_experts and top_k)
    variants: Callable | None = None


_REGISTRY: dict[str, dict[str, Candidate]] = {}
_UNAVAILABLE: dict[tuple[str, str], str] = {}  # (family, name) -> why it is not registered here


def register(family: str, name: str, *, params: tuple[str, ...] = (),
             devices: tuple[str, ...] = ("cpu", "cuda"), variants: Callable | None = None
             ) -> Callable[[Callable], Callable]:
    def deco(fn: Callable) -> Callable:
        fam = _REGISTRY.setdefault(family, {})
        if name in fam and fam[name].fn is not fn:
            raise ValueError(f"candidate {family}/{name} registered twice")
        fam[name] = Candidate(family, name, fn, tuple(params), tuple(devices), variants)
        return fn
    return deco


def unavailable(family: str, name: str, why: str) -> None:
    """Record why candidate family/name is not registered in this process."""
    _UNAVAILABLE[(family, name)] = why


def why_unavailable(family: str, name: str) -> str | None:
    return _UNAVAILABLE.get((family, name))


def get(family: str, name: str) -> Candidate:
    try:
        return _REGISTRY[family][name]
    except KeyError:
        why = _UNAVAILABLE.get((family, name))
        if why is not None:
            raise KeyError(f"kernel candidate {family}/{name} is not available here: {why}") from None
        known = sorted(_REGISTRY.get(family, {}))
        raise KeyError(f"no kernel candidate {name!r} in family {family!r}; registered: {known}") from None


def candidates(family: str) -> dict[str, Candidate]:
    return dict(_REGISTRY.get(family, {}))


def families() -> list[str]:
    return sorted(_REGISTRY)

