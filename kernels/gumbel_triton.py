"""Gumbel-max in Triton (the `gumbel` family's GPU candidate).

The torch reference (kernels/gumbel.py) emulates Philox's 32-bit products in
int64 and materializes [B, V] noise: some 250 kernel launches and, at batch
128 over a 128k vocabulary, ~30 MB of traffic per op every decode step that
samples. Here the first kernel gives each (row, vocabulary chunk) one program
that walks its chunk in blocks: Philox (`tl.philox`, the standard
Philox-4x32-10, same key and counter layout as kernels/philox.py: key = the
seed's two 32-bit halves, counter = (token // 4, position, sample index,
role)), the uniform, the Gumbel noise and the chunk's running first maximum
stay in registers; only the logits are read, once. The second kernel takes,
per row, the first maximum over the chunks' maxima.

Same arithmetic as the reference, in the same order, in float64: u = (w +
0.5) * 2**-32, g = -log(-log(u)), s = z + g; launched without FMA
contraction. The token is the lowest id holding the row's maximum, an exact
function of the row's own logits and key: the chunking (a function of the
vocabulary size alone) decides where the work runs, never the answer.

One program per row (the first version) walked all 128,256 tokens of a
Llama-3 row alone: ~0.29 ms per step at any batch on the H200
(docs/performance.md, "Sampling at large batch"); chunks spread a row over
the SMs.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from detent.kernels.common_triton import check_device, check_dtype, check_last_contiguous, lazy_jit
from detent.kernels.gumbel import gumbel_argmax_torch
from detent.kernels.philox import check_positions, to_device
from detent.kernels.registry import register

BLOCK = 1024
CHUNK_BLOCKS = 4  # blocks per (row, chunk) program: 32 chunks for a 128k vocabulary


@lazy_jit
def _gumbel_argmax_kernel(z_ptr, key_ptr, val_ptr, idx_ptr, V, sz, NCH, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    """Chunk `c` of row `row`: its first maximum of z + g and where it is."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1).to(tl.int64)
    seed = tl.load(key_ptr + row * 4)  # int64 holding the seed's 64 bits
    pos = tl.load(key_ptr + row * 4 + 1).to(tl.uint32)
    sidx = tl.load(key_ptr + row * 4 + 2).to(tl.uint32)
    role = tl.load(key_ptr + row * 4 + 3).to(tl.uint32)
    cols = tl.arange(0, BLOCK)
    zero = tl.zeros((BLOCK,), tl.uint32)
    best = tl.full((), float("-inf"), tl.float64)
    best_i = tl.full((), 0, tl.int64)
    for b0 in range(0, CHUNK, BLOCK):
        v0 = c * CHUNK + b0
        t = v0 + cols
        m = t < V
        z = tl.load(z_ptr + row * sz + t, mask=m, other=float("-inf")).to(tl.float64)
        w0, w1, w2, w3 = tl.philox(seed, (t // 4).to(tl.uint32), zero + pos, zero + sidx, zero + role)
        q = t % 4
        w = tl.where(q == 0, w0, tl.where(q == 1, w1, tl.where(q == 2, w2, w3)))
        u = (w.to(tl.float64) + 0.5) * (1.0 / 4294967296.0)
        s = tl.where(m, z + -tl.log(-tl.log(u)), float("-inf"))
        bmax = tl.max(s, axis=0)
        bidx = tl.argmax(s, axis=0).to(tl.int64)  # first maximum in the block
        better = bmax > best  # strictly: an earlier block keeps a tie
        best_i = tl.where(better, v0 + bidx, best_i)
        best = tl.where(better, bmax, best)
    tl.store(val_ptr + row * NCH + c, best)
    tl.store(idx_ptr + row * NCH + c, best_i)


@lazy_jit
def _first_max_kernel(val_ptr, idx_ptr, out_ptr, NCH, NCH_PAD: tl.constexpr):
    """Per row: the first chunk holding the largest chunk maximum; a row with no
    finite score takes token 0, as argmax over all -inf does."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, NCH_PAD)
    m = c < NCH
    vals = tl.load(val_ptr + row * NCH + c, mask=m, other=float("-inf"))
    best = tl.max(vals, axis=0)
    first = tl.argmax(vals, axis=0)  # the first chunk: lower ids win a tie
    i = tl.load(idx_ptr + row * NCH + first)
    tl.store(out_ptr + row, tl.where(best > float("-inf"), i, 0))


def key_rows(seeds: Sequence[int], positions: Sequence[int], sample_indices: Sequence[int], role: int,
             device) -> torch.Tensor:
    """[B, 4] int64: seed (its 64 bits, two's complement), position, sample index, role.
    Built column by column in numpy: a tensor from B Python tuples cost ~180 us
    at batch 128, on the host of every step that samples."""
    try:
        pos = np.asarray(positions, dtype=np.int64)
        ok = not pos.size or (0 <= int(pos.min()) and int(pos.max()) < 2**32)
    except OverflowError:
        ok = False
    if not ok:
        check_positions(positions)  # raises, naming the offending position
    rows = np.empty((len(pos), 4), dtype=np.int64)
    rows[:, 0] = np.array([int(s) % 2**64 for s in seeds], dtype=np.uint64).view(np.int64)
    rows[:, 1] = pos
    rows[:, 2] = np.asarray(sample_indices, dtype=np.int64) & 0xFFFFFFFF
    rows[:, 3] = role & 0xFFFFFFFF
    return to_device(torch.from_numpy(rows), device)


@register("gumbel", "triton_rowwise", devices=("cuda",))
def gumbel_argmax_triton(z: torch.Tensor, seeds: Sequence[int], positions: Sequence[int],
                         sample_indices: Sequence[int], role: int, ids: torch.Tensor | None = None) -> torch.Tensor:
    if ids is not None:  # truncated rows: a few candidates each, the reference is cheap
        return gumbel_argmax_torch(z, seeds, positions, sample_indices, role, ids)
    name = "gumbel/triton_rowwise"
    check_device(name, z)
    check_dtype(name, "z", z, (torch.float32, torch.float64))
    if z.dim() != 2:
        raise ValueError(f"{name}: z must be [B, V], got {tuple(z.shape)}")
    check_last_contiguous(name, "z", z)
    b, v = z.shape
    out = torch.empty(b, dtype=torch.int64, device=z.device)
    if b:
        keys = key_rows(seeds, positions, sample_indices, role, z.device)
        block = min(BLOCK, triton.next_power_of_2(v))
        chunk = block * CHUNK_BLOCKS
        nch = triton.cdiv(v, chunk)
        vals = torch.empty(b, nch, dtype=torch.float64, device=z.device)
        idx = torch.empty(b, nch, dtype=torch.int64, device=z.device)
        _gumbel_argmax_kernel[(b, nch)](z, keys, vals, idx, v, z.stride(0), nch, CHUNK=chunk, BLOCK=block,
                                        num_warps=8, enable_fp_fusion=False)
        _first_max_kernel[(b,)](vals, idx, out, nch, NCH_PAD=triton.next_power_of_2(nch), num_warps=1)
    return out
