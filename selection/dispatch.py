"""The active dispatcher: turns (family, call site, runtime values) into a
selection dict by running that family's selector, memoized per forward step.

A *provider* builds one selector per (family, site facts); the SelIR
compiler provides them (selection/provider.py). The active dispatcher is
the one the step context carries (selection/context.py): the runner enters
one `forward_context` per step; `use_dispatcher(d)` is a context with a
dispatcher and no attention metadata, for ops called outside a model step.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Protocol

from detent.selection.context import ForwardContext, forward_context, get_forward_context

Site = tuple[tuple[str, Any], ...]
Selector = Callable[..., dict]


class Provider(Protocol):
    mode: str

    def selector(self, family: str, site: dict[str, Any]) -> Selector: ...


class Dispatcher:
    def __init__(self, provider: Provider):
        self.provider = provider
        self._selectors: dict[tuple[str, Site], Selector] = {}
        # every distinct (family, site, runtime) seen, with weights: the tuner's profile (a step's
        # calls add its `record_weight`: the steps it stands for, times its decode rows under the
        # tuner's "tpot" objective, so 0 for a prefill-only step; detent/tune_engine.py)
        self.calls: dict[tuple[str, Site, tuple], int] = {}
        self.record_calls = False
        self.record_weight = 1

    @property
    def mode(self) -> str:
        return self.provider.mode

    def select(self, family: str, site: Site, runtime: dict[str, int]) -> dict:
        ctx = get_forward_context()
        key = (family, site, tuple(sorted(runtime.items())))
        if ctx is not None:
            hit = ctx.memo.get(key)
            if hit is not None:
                return hit
        sel_fn = self._selectors.get((family, site))
        if sel_fn is None:
            sel_fn = self.provider.selector(family, dict(site))
            self._selectors[(family, site)] = sel_fn
        sel = sel_fn(**runtime)
        if self.record_calls:
            self.calls[key] = self.calls.get(key, 0) + self.record_weight
        if ctx is not None:
            ctx.memo[key] = sel
        return sel

    def built(self) -> dict[tuple[str, Site], Selector]:
        """The selectors built so far, by (family, call site): every site a step has reached."""
        return dict(self._selectors)

    def resolve(self, family: str, site: Site, runtime: dict[str, int]) -> tuple[Callable, dict]:
        """The selected candidate's function and its keyword parameters."""
        ctx = get_forward_context()
        rkey = ("resolved", family, site, tuple(sorted(runtime.items())))
        if ctx is not None:
            hit = ctx.memo.get(rkey)
            if hit is not None:
                return hit
        sel = self.select(family, site, runtime)
        from detent.kernels import registry
        cand = registry.get(family, sel["impl"])
        kwargs = {k: v for k, v in sel.items() if k != "impl"}
        unknown = set(kwargs) - set(cand.params)
        if unknown:
            raise TypeError(f"selection for {family}/{sel['impl']} sets {sorted(unknown)}, "
                            f"which the candidate does not accept (accepts {list(cand.params)})")
        out = (cand.fn, kwargs)
        if ctx is not None:
            ctx.memo[rkey] = out
        return out


def get_dispatcher() -> Dispatcher:
    ctx = get_forward_context()
    if ctx is None or ctx.dispatcher is None:
        raise RuntimeError("no kernel dispatcher is active: ops run inside a forward context that carries "
                           "one (detent.selection.context.forward_context(ForwardContext(..., dispatcher=d)) "
                           "or detent.selection.use_dispatcher(d))")
    return ctx.dispatcher


def use_dispatcher(d: Dispatcher) -> contextlib.AbstractContextManager[ForwardContext]:
    """A step context with dispatcher `d` and no attention metadata (ops outside a model step)."""
    return forward_context(ForwardContext(attn=None, dispatcher=d))
