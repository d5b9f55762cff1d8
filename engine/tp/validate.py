"""Can this model be sharded over N ranks? One clear message if not.

Rules (vLLM's): query heads, vocabulary and the MLP / expert intermediate
dims divide by N; KV heads divide by N, or, when there are fewer KV heads
than ranks, N is a multiple of them and each KV head is replicated on
N / num_kv_heads ranks. Checked before any worker process starts.
"""
from __future__ import annotations

from typing import Any

import torch


class TPConfigError(ValueError):
    """The model or the machine cannot run at the requested tensor_parallel_size."""


def check_tp_compatible(mc: Any, tp: int, device: torch.device | None = None) -> None:
    """Raise TPConfigError naming every field that does not shard over `tp` ranks."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise TPConfigError(f"tensor_parallel_size must be a positive int, got {tp!r}")
    if tp == 1:
        return
    name = getattr(mc, "architecture", type(mc).__name__)
    problems = []

    def divides(field: str, what: str) -> None:
        v = int(getattr(mc, field, 0) or 0)
        if v and v % tp:
            problems.append(f"{what} ({field}={v}) is not divisible by tensor_parallel_size={tp}")

    divides("num_heads", "the number of attention heads")
    kv = int(mc.num_kv_heads)
    if kv >= tp and kv % tp:
        problems.append(f"the number of KV heads (num_kv_heads={kv}) is not divisible by "
                        f"tensor_parallel_size={tp}")
    elif kv < tp and tp % kv:
        problems.append(f"tensor_parallel_size={tp} exceeds the number of KV heads (num_kv_heads={kv}) "
                        "and is not a multiple of it, so KV heads cannot be replicated evenly")
    divides("vocab_size", "the vocabulary size")
    divides("intermediate_size", "the MLP width")
    if getattr(mc, "num_experts", 0):
        divides("moe_intermediate_size", "the experts' intermediate size")
    if problems:
        raise TPConfigError(f"cannot shard {name} over tensor_parallel_size={tp}: " + "; ".join(problems))
    if device is not None and device.type == "cuda":
        n = torch.cuda.device_count()
        if n < tp:
            raise TPConfigError(f"tensor_parallel_size={tp} needs {tp} CUDA devices (one per rank), "
                                f"but {n} are visible (CUDA_VISIBLE_DEVICES={_visible()})")


def _visible() -> str:
    import os
    return os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>")
