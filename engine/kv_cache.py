"""KV cache sizing and allocation.

The pool is ``num_blocks`` pages of ``block_size`` tokens; each layer holds
one tensor ``[2, num_blocks, block_size, num_kv_heads, head_dim]`` (K, V).
The number of blocks is discovered at startup from a memory budget:

- GPU: ``gpu_memory_utilization`` of the device's memory, minus what the
  process already uses (weights) and an activation reserve for a step of
  ``max_num_batched_tokens`` tokens;
- CPU: ``kv_cache_memory_bytes`` (default: enough for ``max_num_seqs``
  requests of ``max_model_len``, capped at 1 GiB);
- anywhere: ``num_gpu_blocks`` overrides the budget with a block count.

Startup fails with a clear message when one request of ``max_model_len``
tokens cannot fit.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

CPU_DEFAULT_KV_BYTES = 1 << 30


@dataclass(frozen=True)
class KVCacheSpec:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int

    @property
    def bytes_per_block(self) -> int:
        elem = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * elem


def _gpu_budget(device: torch.device, utilization: float, reserve_bytes: int) -> int:
    free, total = torch.cuda.mem_get_info(device)
    used = total - free  # weights and anything else already on the device
    return int(total * utilization) - used - reserve_bytes


def num_blocks_for(spec: KVCacheSpec, device: torch.device, *, max_model_len: int, max_num_seqs: int,
                   kv_cache_memory_bytes: int | None = None, num_gpu_blocks: int | None = None,
                   gpu_memory_utilization: float = 0.9, activation_reserve_bytes: int = 0) -> int:
    """Number of KV blocks (block 0, the reserved null block, included)."""
    bpb = spec.bytes_per_block
    per_request = -(-max_model_len // spec.block_size)
    if num_gpu_blocks is not None:
        num_blocks, source = int(num_gpu_blocks), f"num_gpu_blocks={num_gpu_blocks}"
    elif kv_cache_memory_bytes is not None:
        num_blocks, source = int(kv_cache_memory_bytes) // bpb, f"kv_cache_memory_bytes={kv_cache_memory_bytes}"
    elif device.type == "cuda":
        budget = _gpu_budget(device, gpu_memory_utilization, activation_reserve_bytes)
        num_blocks, source = max(budget, 0) // bpb, f"gpu_memory_utilization={gpu_memory_utilization}"
    else:
        want = (max_num_seqs * per_request + 1) * bpb
        num_blocks = min(want, CPU_DEFAULT_KV_BYTES) // bpb
        source = f"the CPU default budget ({CPU_DEFAULT_KV_BYTES >> 20} MiB; set kv_cache_memory_bytes)"
    if num_blocks - 1 < per_request:
        raise ValueError(
            f"KV cache too small: {source} gives {max(num_blocks - 1, 0)} usable blocks of "
            f"{spec.block_size} tokens ({bpb} bytes each), but one request of max_model_len="
            f"{max_model_len} needs {per_request} blocks ({per_request * bpb / 2**20:.1f} MiB). "
            f"Give the cache more memory or lower max_model_len.")
    return num_blocks


def allocate_kv_caches(spec: KVCacheSpec, num_blocks: int, device: torch.device) -> list[torch.Tensor]:
    # zeros, not empty: kernels may read (and mask) slots that were never written
    return [torch.zeros(2, num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim,
                        dtype=spec.dtype, device=device) for _ in range(spec.num_layers)]
