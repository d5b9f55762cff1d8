"""Keyed counter-based RNG: Philox-4x32-10 in exact torch int64 arithmetic.

A draw is a pure function of (seed, absolute position, sample index, role,
token id): never a shared stream, never the batch slot (docs/architecture.md, "Sampling"). The sampler
reaches it through the `gumbel` kernel family (kernels/gumbel.py).

Key   = (seed & 0xffffffff, seed >> 32)                 (seed as unsigned 64-bit)
Counter = (token_id // 4, position, sample_index, role)   -> 4 words: token ids 4b..4b+3

All arithmetic is on int64 tensors holding values < 2**49 (the 32x32-bit
products are split into 16-bit halves), so there is no overflow and no
device-specific rounding: CPU and GPU compute the same integers. The test
suite checks the Random123 known-answer vectors against this code.
"""
from __future__ import annotations

from typing import Sequence

import torch

_M0, _M1 = 0xD2511F53, 0xCD9E8D57  # Philox 4x32 multipliers
_W0, _W1 = 0x9E3779B9, 0xBB67AE85  # Weyl key increments
_MASK32 = 0xFFFFFFFF
ROUNDS = 10


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(lo, hi) 32-bit halves of a * m for uint32 values a (int64 tensor) and a 32-bit constant m."""
    x = a * (m >> 16)  # < 2**48
    y = a * (m & 0xFFFF)  # < 2**48
    hi = (x + (y >> 16)) >> 16
    lo = (((x & 0xFFFF) << 16) + y) & _MASK32
    return lo, hi


def philox4x32(ctr: Sequence[torch.Tensor], key: Sequence[torch.Tensor],
               rounds: int = ROUNDS) -> list[torch.Tensor]:
    """Philox-4x32 on broadcastable int64 tensors holding uint32 values; returns 4 words."""
    c0, c1, c2, c3 = ctr
    k0, k1 = key
    for r in range(rounds):
        if r:
            k0 = (k0 + _W0) & _MASK32
            k1 = (k1 + _W1) & _MASK32
        lo0, hi0 = _mulhilo(c0, _M0)
        lo1, hi1 = _mulhilo(c2, _M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return [c0, c1, c2, c3]


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Host tensor `t` on `device`, copied without waiting for the device's queue
    (through pinned memory on CUDA). sampling/rng.py has the sampler's own: the
    floors keep sampling/ from importing kernels/."""
    if torch.device(device).type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def host_column(vals: Sequence[int], device: torch.device | str) -> torch.Tensor:
    """[R, 1] int64 on `device` from host ints (`to_device`)."""
    return to_device(torch.tensor(vals, dtype=torch.int64)[:, None], device)


def check_positions(positions: Sequence[int]) -> None:
    """Positions are a counter word: each must fit 32 bits."""
    for p in positions:
        if not 0 <= int(p) < 2**32:
            raise ValueError(f"position {p} outside [0, 2**32) for the keyed RNG")


def random_bits(seeds: Sequence[int], positions: Sequence[int], sample_indices: Sequence[int],
                vocab: int, role: int = 0, device: torch.device | str = "cpu") -> torch.Tensor:
    """uint32 values (in int64) [R, vocab]: row i, column t is the draw for token t of key i."""
    def col(vals):
        return host_column([int(v) & _MASK32 for v in vals], device)
    check_positions(positions)
    seeds64 = [int(s) % 2**64 for s in seeds]
    k0 = col(seeds64)
    k1 = col([s >> 32 for s in seeds64])
    nblk = (vocab + 3) // 4
    c0 = torch.arange(nblk, dtype=torch.int64, device=device)[None, :]
    c1, c2 = col(positions), col(sample_indices)
    c3 = torch.full_like(c1, role & _MASK32)
    words = philox4x32((c0, c1, c2, c3), (k0, k1))
    out = torch.stack(torch.broadcast_tensors(*words), dim=-1)  # [R, nblk, 4]
    return out.reshape(out.shape[0], nblk * 4)[:, :vocab]


def random_bits_at(seeds: Sequence[int], positions: Sequence[int], sample_indices: Sequence[int],
                   token_ids: torch.Tensor, role: int = 0) -> torch.Tensor:
    """The draws of `random_bits` at the given token ids only: [R, C] for token_ids [R, C] (long, >= 0).

    Element (i, j) equals random_bits(...)[i, token_ids[i, j]] exactly (same key, same counter)."""
    check_positions(positions)
    dev = token_ids.device

    def col(vals):
        return host_column([int(v) & _MASK32 for v in vals], dev)
    seeds64 = [int(s) % 2**64 for s in seeds]
    c1, c2 = col(positions), col(sample_indices)
    words = philox4x32((token_ids // 4, c1, c2, torch.full_like(c1, role & _MASK32)),
                       (col(seeds64), col([s >> 32 for s in seeds64])))
    words = torch.stack(torch.broadcast_tensors(*words), dim=-1)  # [R, C, 4]
    return words.gather(2, (token_ids % 4)[..., None])[..., 0]


def uniform_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """float64 uniforms in the open interval (0, 1): (w + 0.5) / 2**32."""
    return (bits.double() + 0.5) * (1.0 / 4294967296.0)


def gumbel_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """Standard Gumbel noise -log(-log(u)) in float64, elementwise."""
    return -torch.log(-torch.log(uniform_from_bits(bits)))
