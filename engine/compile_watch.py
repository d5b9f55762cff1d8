"""Kernels compiled after the warm start, named in the log.

The warm start (engine/warmup.py) runs every kernel configuration SelIR finds
reachable, so that no request waits for a compile. A kernel that still
compiles while serving is a configuration or an integer specialization the
warm start missed. It stalls its step for the compile, up to a second on the
H200 (a TTFT tail nobody can explain from the outside). Triton calls
`knobs.runtime.jit_post_compile_hook` after each new specialization it builds
(or loads from its disk cache) in this process. After the warm start the
engine installs one that logs the kernel with its specialization and counts
them.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any

log = logging.getLogger("detent.engine.compile_watch")
_paused = 0  # engines starting up in this process (their compiles are expected)


@contextmanager
def paused():
    """Compiles inside are an engine's startup (graph capture, warm start), not serving:
    the watch neither logs nor counts them (a second engine in a process that serves)."""
    global _paused
    _paused += 1
    try:
        yield
    finally:
        _paused -= 1


class CompileWatch:
    """A `jit_post_compile_hook`: log and count; the hook it replaced still runs."""

    def __init__(self, previous: Any = None):
        self.previous = previous
        self.count = 0
        self.kernels: list[str] = []

    def __call__(self, *, key=None, repr=None, fn=None, compile=None, is_manual_warmup=False,  # noqa: A002
                 already_compiled=False):
        if _paused:
            return self._forward(key, repr, fn, compile, is_manual_warmup, already_compiled)
        self.count += 1
        what = f"{repr}{describe(compile)}"
        self.kernels.append(what)
        log.warning("kernel compiled while serving (the warm start did not reach it): %s", what)
        return self._forward(key, repr, fn, compile, is_manual_warmup, already_compiled)

    def _forward(self, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002
        if self.previous is not None:
            return self.previous(key=key, repr=repr, fn=fn, compile=compile, is_manual_warmup=is_manual_warmup,
                                 already_compiled=already_compiled)
        return None


def describe(compile: dict | None) -> str:
    """The compile's constexpr values and integer specializations by argument name.

    Triton's `repr` names the launch options only (its argument part zips the
    names with the cache-key string); what tells two compiles of one kernel
    apart is in `compile`: `constants` and `configs` keyed by (argument
    index,), `signature` in argument order."""
    if not compile:
        return ""
    try:
        names = list(compile.get("signature") or {})

        def name(k):
            if isinstance(k, tuple) and k and isinstance(k[0], int) and k[0] < len(names):
                return names[k[0]] + (str(k[1:]) if len(k) > 1 else "")
            return str(k)
        consts = {name(k): str(v) for k, v in (compile.get("constants") or {}).items()}
        attrs = {name(k): v for cfg in compile.get("configs") or [] for k, v in cfg.items()}
        return f" constexprs {consts} specialized {attrs}"
    except Exception:  # noqa: BLE001  (another Triton's layout: its own serialization)
        return f" {str(compile.get('specialization_data'))[:1000]}"


def watch_compiles() -> CompileWatch | None:
    """Install the watch (process-wide, as Triton's knob is); None where this Triton has no such hook."""
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return None
    current = runtime.jit_post_compile_hook
    if isinstance(current, CompileWatch):  # a second engine in this process shares the first's
        return current
    watch = CompileWatch(previous=current)
    runtime.jit_post_compile_hook = watch
    return watch
