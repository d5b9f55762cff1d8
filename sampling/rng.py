"""Host-to-device helpers of the sampler, and the RNG's roles.

The keyed Philox RNG itself is a kernel (kernels/philox.py); the sampler
draws through the `gumbel` family (`ops.gumbel_argmax`), whose candidates
are that torch Philox and a fused Triton kernel."""
from __future__ import annotations

import torch

ROLE_SAMPLE = 0  # the fresh sample of a token (other roles reserved: speculative decoding)


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Copy host tensor `t` to `device` without waiting for the device's queue.

    torch.tensor(..., device="cuda") and .to("cuda") synchronize the stream, so
    the host would wait for every kernel already queued: on CUDA the copy goes
    through pinned memory (torch's caching host allocator keeps the block until
    the copy is done) and is asynchronous."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def list_to_device(vals: list, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A host list as a tensor on `device`, through `to_device` (no wait for the device's queue)."""
    return to_device(torch.tensor(vals, dtype=dtype), device)
