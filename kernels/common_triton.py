"""Shared plumbing for the Triton candidates (`*_triton.py`).

`lazy_jit` defers `triton.jit` to the first launch, so the same kernel runs
compiled on CUDA or under Triton's interpreter on CPU
(``TRITON_INTERPRET=1``, read at launch, not at import): the CPU tests set
the variable per test, after `detent.kernels` was imported.
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch
import triton


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


class LazyKernel:
    """A kernel's Python source, jitted on first use per interpreter state."""

    def __init__(self, fn: Callable, **jit_kw):
        self.fn = fn
        self.jit_kw = jit_kw
        self._jitted: dict[bool, object] = {}
        functools.update_wrapper(self, fn)

    def _get(self):
        mode = interpreting()
        k = self._jitted.get(mode)
        if k is None:
            k = self._jitted[mode] = triton.jit(self.fn, **self.jit_kw)
        return k

    def __getitem__(self, grid):
        return self._get()[grid]


def lazy_jit(fn: Callable | None = None, **jit_kw):
    """Decorator: ``@lazy_jit`` or ``@lazy_jit(do_not_specialize=[...])``."""
    if fn is None:
        return lambda f: LazyKernel(f, **jit_kw)
    return LazyKernel(fn)


def check_device(name: str, *tensors: torch.Tensor) -> None:
    """Triton candidates run on CUDA, or on CPU under TRITON_INTERPRET=1."""
    devs = {t.device for t in tensors if t is not None}
    if len(devs) != 1:
        raise ValueError(f"{name}: tensors on different devices {sorted(map(str, devs))}")
    dev = devs.pop()
    if dev.type != "cuda" and not (dev.type == "cpu" and interpreting()):
        raise ValueError(f"{name}: Triton candidate needs CUDA tensors (or CPU tensors with "
                         f"TRITON_INTERPRET=1), got {dev}")


def check_dtype(name: str, field: str, t: torch.Tensor, allowed=(torch.float16, torch.bfloat16,
                                                                  torch.float32)) -> None:
    if t.dtype not in allowed:
        raise TypeError(f"{name}: {field} has dtype {t.dtype}, expected one of "
                        f"{[str(a) for a in allowed]}")


def check_last_contiguous(name: str, field: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: {field} must have a contiguous last dimension "
                         f"(stride {t.stride(-1)}, shape {tuple(t.shape)})")


# Tests set this: every output buffer a launcher allocates is then filled
# with NaN first, so an element the kernel fails to write shows up.
POISON = False


def empty(shape, dtype: torch.dtype, device) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype, device=device)
    if POISON and t.is_floating_point():
        t.fill_(float("nan"))
    return t


def empty_like(x: torch.Tensor) -> torch.Tensor:
    return empty(x.shape, x.dtype, x.device)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int | None) -> int:
    if device_index is None:  # interpreter on CPU: a small persistent grid
        return 4
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sms_for(t: torch.Tensor) -> int:
    if not t.is_cuda:
        return num_sms(None)
    idx = t.device.index
    return num_sms(torch.cuda.current_device() if idx is None else idx)
