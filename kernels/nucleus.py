"""Top-p (the nucleus), exact, row by row, without reading the device: the
`top_p` family's torch candidate (the reference; kernels/nucleus_triton.py is
the GPU's).

    fn(xk[B, V] float32, top_p[B] float64) -> keep[B, V] bool

A row keeps a token when the probability mass strictly before it, in the order
probability descending / ties to the lower id, is < top_p (the smallest
prefix of that order whose mass reaches top_p).

Masses are integers. Each float32 probability p (the row's softmax) weighs
floor(p * 2**60), so every sum below is exact and the same in any order and
any reduction tree, whatever the batch; a token is kept when its integer mass
before is < ceil(top_p * 2**60). Real arithmetic could decide otherwise only
where the mass before a token is within V * 2**-60 of top_p (1.3e-13 at
V = 152k), and a token below 2**-60 weighs nothing.

Which probability ends the nucleus is found without a sort and without a
sync. A probability's float32 bits (p >= 0, so below 2**30) order like its
value, so a radix select over those bits finds, per row, v: the
smallest probability present whose mass strictly above is < top_p. Every
token above v is kept, every token below is not, and v's own tokens are kept
in id order while their mass before stays < top_p. Each digit (two of 15
bits at a model's vocabulary) is one histogram of masses (an integer
index-add, exact in any order) and one integer suffix sum. The work is the
same for every row and every step, so the host never waits for it: a sort
grown until every nucleus fits would read the device once per round.
"""
from __future__ import annotations

import torch

from detent.kernels.registry import register

SCALE = 2.0 ** 60  # a probability's mass unit: 2**-60
_BITS = 30  # every probability in [0, 1] as float32 bits is below 2**30


def _digit_bits(V: int) -> int:
    """Bits per radix digit: two digits of 15 (32,768 bins) for a model's vocabulary, three of
    10 (1,024 bins) where the bins would outnumber the tokens. The result is the same either way."""
    return 15 if V > 4096 else 10


@register("top_p", "torch_rowwise")
def top_p_keep(xk: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """keep[B, V] for logits xk [B, V] float32 (already top-k filtered: -inf
    drops a token) and top_p [B] float64 in (0, 1]; rows at 1.0 keep everything."""
    probs = torch.softmax(xk, dim=-1)  # [B, V] fp32
    bits = probs.view(torch.int32)  # p >= 0: the bits order like the values
    mass = (probs * SCALE).long()  # floor (p >= 0): scaling by a power of two is exact in float32
    limit = torch.ceil(top_p.double() * SCALE).long()[:, None]  # [B, 1]: mass before < top_p <=> < limit
    value, above = _boundary(bits, mass, limit, _digit_bits(xk.shape[1]))
    ties = bits == value  # [B, V] the tokens at the boundary probability
    rank = torch.cumsum(ties, dim=1, dtype=torch.int32) - ties.int()  # among them, by id (exact)
    one = (value.view(torch.float32) * SCALE).long()  # [B, 1] one tie's mass
    # ties kept: rank * one + above < limit; all of them when they weigh nothing
    room = torch.where(one > 0, (limit - above + one - 1) // one.clamp(min=1), xk.shape[1])
    keep = (bits > value) | (ties & (rank < room))
    return keep | (top_p >= 1.0)[:, None]


def _boundary(bits: torch.Tensor, mass: torch.Tensor, limit: torch.Tensor,
              digit_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row, v's bits [B, 1] int32 and the mass strictly above v [B, 1] int64:
    v the smallest probability present (of positive mass) whose mass above is < limit."""
    B, dev = bits.shape[0], bits.device
    bins = 1 << digit_bits
    prefix = torch.zeros(B, 1, dtype=torch.int32, device=dev)  # v's digits found so far
    above = torch.zeros(B, 1, dtype=torch.int64, device=dev)  # mass above the prefix's range
    digits = torch.arange(bins, device=dev)
    base = torch.arange(B, dtype=torch.int32, device=dev)[:, None] * (bins + 1)  # each row's bins, flat
    flat_mass = mass.view(-1)
    for shift in range(_BITS - digit_bits, -1, -digit_bits):
        # tokens under the prefix, binned by their next digit; the others (and NaN) go to a dropped bin
        own = (bits >> (shift + digit_bits)) == prefix
        slot = torch.where(own, (bits >> shift) & (bins - 1), bins) + base  # [B, V] int32
        hist = mass.new_zeros(B * (bins + 1)).index_add_(0, slot.view(-1), flat_mass)
        hist = hist.view(B, bins + 1)[:, :bins]  # [B, bins]
        higher = hist.flip(1).cumsum(1).flip(1) - hist  # mass of the bins above each bin
        before = above + higher  # mass strictly above each bin's probabilities
        # v's bin: the lowest present bin whose mass above is < limit (the top present bin always is)
        d = torch.where((hist > 0) & (before < limit), digits, bins - 1).min(dim=1, keepdim=True).values
        above = before.gather(1, d)
        prefix = (prefix << digit_bits) | d.int()
    return prefix, above
