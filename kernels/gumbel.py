"""Gumbel-max with keyed noise: the sampler's draw, as a kernel family.

    fn(z[B, C] float, seeds, positions, sample_indices, role, ids[B, C] long | None) -> [B] long

Row b's result is argmax_j(z[b, j] + g(b, t)) in float64, the first maximum
(ties to the lower j), where t = ids[b, j] (t = j when `ids` is None: the
whole vocabulary) and g(b, t) = -log(-log(u)) is the Gumbel noise of the
uniform u = (w + 0.5) / 2**32 of Philox word w for key (seeds[b], positions[b],
sample_indices[b], role) and token t (kernels/philox.py). z = -inf marks a
token that may not be drawn. A row's result reads that row alone.

This candidate is the torch reference. In float64 int64 emulation it runs
some 250 elementwise ops over [B, C / 4] (Philox's 10 rounds): at batch 128
and a 128k vocabulary, ~30 MB per op, milliseconds of device time per
step and one kernel launch per op; kernels/gumbel_triton.py fuses it.
"""
from __future__ import annotations

from typing import Sequence

import torch

from detent.kernels.philox import gumbel_from_bits, random_bits, random_bits_at
from detent.kernels.registry import register


@register("gumbel", "torch_rowwise")
def gumbel_argmax_torch(z: torch.Tensor, seeds: Sequence[int], positions: Sequence[int],
                        sample_indices: Sequence[int], role: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    if ids is None:
        bits = random_bits(seeds, positions, sample_indices, z.shape[1], role=role, device=z.device)
    else:
        bits = random_bits_at(seeds, positions, sample_indices, ids, role=role)
    return torch.argmax(z.double() + gumbel_from_bits(bits), dim=-1)
