"""Gumbel-max with keyed noise: the sampler's draw, as a kernel family.

    fn(z[B, C] float, seeds, positions, sample_indices, role, ids[B, C] long | None) -> [B] long

Row b's result is argmax_j(z[b, j] + g(b, t)) in float64, the first maximum
(ties to the lower j), where t = ids[b, j] (t = j when `ids` is None: the
whole vocabulary) and g(b, t) = -log(-log(u)) is the Gumbel noise of the
uniform u = (w + 0.5) / 2**32 of Philox word w for key (seeds[b], positions[b],
sample_indices[b], role) and token t (kernels/philox.py). z = -inf marks a
token that may not be drawn. A row's result reads that row alone. The sampler
always passes the whole vocabulary (`ids` None): a candidate may draw at the
drawable tokens only, which gives the same token.

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
        sparse = _candidates(z)
        if sparse is not None:  # truncation left few tokens: noise at their ids only, same token
            cand, zc = sparse
            return cand.gather(1, gumbel_argmax_torch(zc, seeds, positions, sample_indices, role, cand)[:, None])[:, 0]
        bits = random_bits(seeds, positions, sample_indices, z.shape[1], role=role, device=z.device)
    else:
        bits = random_bits_at(seeds, positions, sample_indices, ids, role=role)
    return torch.argmax(z.double() + gumbel_from_bits(bits), dim=-1)


def _candidates(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(ids [B, C], z at them [B, C], -inf in padding slots) when every row has at most
    V / 8 drawable (finite) tokens; else None.

    Each draw depends on (key, token id) alone and the candidates keep ascending id
    order, so the first maximum over them is the first maximum over the whole row
    (the excluded tokens are -inf either way). Counting reads the device (a sync on
    a GPU): this reference runs where that costs nothing, the fused kernel draws
    densely."""
    B, V = z.shape
    finite = torch.isfinite(z)
    counts = finite.to(torch.int32).sum(dim=-1).tolist()  # exact integer counts
    C = max(max(counts), 1) if counts else 1
    if C > V // 8:
        return None
    r_idx, ids = finite.nonzero(as_tuple=True)  # row-major: ascending ids within each row
    starts = torch.tensor([0] + counts[:-1], device=z.device).cumsum(0)  # [B] (B small ints: exact)
    slot = torch.arange(r_idx.numel(), device=z.device) - starts[r_idx]
    cand = torch.zeros(B, C, dtype=torch.long, device=z.device)
    cand[r_idx, slot] = ids
    valid = torch.zeros(B, C, dtype=torch.bool, device=z.device)
    valid[r_idx, slot] = True
    return cand, torch.where(valid, z.gather(1, cand), float("-inf"))
