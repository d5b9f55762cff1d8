"""Top-p's keep mask in Triton (the `top_p` family's GPU candidate).

Same contract and the same answer, bit for bit, as the torch reference
(kernels/nucleus.py): the probabilities are torch's softmax of the row, each
weighs the integer floor(p * 2**60), and the nucleus's last probability v is
found by a radix select over the probabilities' float32 bits; ties at v are
kept in id order. What changes is how the work is spread. The reference's
histograms are integer index-adds into 32,768 bins per row, and most of a
row's tokens share a few bins (similar small probabilities), so the adds
likely contend (not profiled): 0.9 ms at batch 1 and 2.1 ms at batch 64 on an
H100 at a 128k vocabulary (docs/performance.md, lease 24).

Here each (row, chunk of the vocabulary) is one program, and a digit of
DIGIT_BITS bits is one launch: a program sums its chunk's masses into the
digit's few bins (a one-hot sum in registers: no atomics) and writes them.
The next launch's programs each add up their row's chunks (integer sums:
exact, so every program of the row decides the same digit), and the row's
first chunk records the decision. The last launch decides the last digit and
writes the mask; the tie rank of a token at v is the count of v's tokens in
the chunks before its own (recorded by the last digit's launch) plus its
rank in its chunk. Past the first digits few tokens are still under the
prefix, so a block with none skips its sums (and, at the last launch, a block
without a token at v skips its tie ranks). 30 / DIGIT_BITS + 1 launches,
whatever the batch. For large batches one program a row walks the same digits
in a loop instead (`_top_p_row_kernel`), and stops once a single value is left
under the prefix; `launch_for` picks the launch by the batch. A row's answer is
an exact function of its own probabilities, so it is the same alone and in any
batch, for either launch, any DIGIT_BITS and any chunking.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from detent.kernels.common_triton import check_device, lazy_jit
from detent.kernels.nucleus import SCALE, _BITS
from detent.kernels.registry import register

# bits per launch (divides 30): 4 bins, 15 launches and one for the mask. The fastest of 2, 3 and 5
# bits on an H100 at batch 64 and above; 3 bits was 0.15-0.2 ms faster at batch 8-32, 2 bits 0.46 ms
# faster at 64 and 2.2 ms at 256 (benchmarks/top_p_sweep.py; docs/performance.md, lease 25)
DIGIT_BITS = 2
BLOCK = 1024
CHUNK_BLOCKS = 4  # blocks per (row, chunk) program: 32 chunks for a 128k vocabulary
# "levels": a launch a digit, each (row, chunk) one program (above); "row": one program a row walks
# every digit in a loop and stops early once one value is left under the prefix (`_top_p_row_kernel`:
# no launch per digit, but a row's work on one SM); "auto": by the batch (`launch_for`). The same
# mask in every case (tests/kernels/test_nucleus_triton.py), so the choice is speed alone
LAUNCH = "auto"
ROW_BLOCK = 2048
ROW_WARPS = 8
# "auto"'s bounds, from lease 27's two sweeps on an H100 at a 128k vocabulary (ms a call, randn logits
# x 3 / x 8; docs/performance.md): 3-bit levels at batch 1-16 0.23-0.33 against 2-bit 0.31-0.45, and
# at 32 faster in three cells of four; 2-bit levels at 64, faster in all four; at 256 the row launch
# 1.97-1.98 / 1.15-1.16 against 2.41-2.42 / 1.88, at 192 faster for the peaked rows (1.09 against
# 1.43) and within 0.07 ms for the others, and at 128 within 0.02 / 0.1 ms of the levels
AUTO_LEVELS3_MAX = 32  # batches up to this: levels of 3 bits
AUTO_ROW_MIN = 192  # batches from this: the row launch


def launch_for(B: int) -> tuple[str, int]:
    """(launch, bits per digit) for a batch of B rows: LAUNCH and DIGIT_BITS as set, or under
    "auto" the measured fastest."""
    if LAUNCH != "auto":
        return LAUNCH, DIGIT_BITS
    if B <= AUTO_LEVELS3_MAX:
        return "levels", 3
    return ("row", 2) if B >= AUTO_ROW_MIN else ("levels", 2)


_PROB_BITS = tl.constexpr(_BITS)  # a probability's float32 bits are below 2**30


@triton.jit
def _decide(hist, before_all, limit, bins, NB: tl.constexpr):
    """One digit's choice from its bins' masses: the lowest bin present whose mass strictly above
    is < limit (the top present bin always is); returns (digit, mass above that bin)."""
    higher = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)  # mass of the bins above each bin
    before = before_all + higher
    d = tl.min(tl.where((hist > 0) & (before < limit), bins, NB - 1), axis=0)
    return d, tl.sum(tl.where(bins == d, before, 0), axis=0)


@triton.jit
def _room(v_bits, limit, above, V):
    """How many of v's tokens fit, in id order: those whose mass before stays < limit (all of
    them, V, when one weighs nothing)."""
    one = (v_bits.to(tl.float32, bitcast=True) * 1152921504606846976.0).to(tl.int64)  # v's mass
    return tl.where(one > 0, (limit - above + one - 1) // tl.maximum(one, 1), V)


@triton.jit
def _mask_block(p_ptr, keep_ptr, row, sp, sk, offs, m, v_bits, keep_all, rank0, room):
    """One block's keep mask: tokens above v, and v's tokens whose rank (rank0 of them before the
    block) is < room; returns v's tokens in the block."""
    bits = tl.load(p_ptr + row * sp + offs, mask=m, other=0.0).to(tl.int32, bitcast=True)
    tie = ((bits == v_bits) & m).to(tl.int32)
    ties = tl.sum(tie, axis=0)
    keep = (bits > v_bits) | keep_all
    if ties > 0:  # most blocks hold none of v's tokens: no ranks to count
        rank = rank0 + tl.cumsum(tie, axis=0) - tie
        keep = keep | ((tie != 0) & (rank < room))
    tl.store(keep_ptr + row * sk + offs, keep.to(tl.uint8), mask=m)
    return ties


@triton.jit
def _block_hits(p, bits, own, shift, bins, NB: tl.constexpr):
    """The block's tokens under the prefix, one-hot by their next digit ([BLOCK, NB]), and the
    digit's bins' masses from them (floor(p * 2**60): p >= 0, exact scaling; integer sums)."""
    mass = (p * 1152921504606846976.0).to(tl.int64)
    hit = own[:, None] & (((bits >> shift) & (NB - 1))[:, None] == bins[None, :])
    return hit, tl.sum(tl.where(hit, mass[:, None], 0), axis=0)


@lazy_jit(do_not_specialize=["B", "NCH", "level"])  # one compiled kernel per vocabulary, FINAL or not
def _top_p_kernel(p_ptr, top_p_ptr, limit_ptr, part_ptr, state_ptr, cnt_ptr, keep_ptr, V, B, NCH, level,
                  sp, sk, D: tl.constexpr, LEVELS: tl.constexpr, NCH_PAD: tl.constexpr, CHUNK: tl.constexpr,
                  BLOCK: tl.constexpr, FINAL: tl.constexpr):
    NB: tl.constexpr = 1 << D
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    bins = tl.arange(0, NB)
    chunks = tl.arange(0, NCH_PAD)
    limit = tl.load(limit_ptr + row)
    # the state after digit level - 2 (recorded by the previous launch's first chunk), then
    # digit level - 1 decided here from every chunk's bins of the previous launch
    two = tl.arange(0, 2)  # a state slot: (prefix, mass above the prefix's range)
    # (masks on the scalars `level` and `c` are written as vectors: `x * 0 + level`)
    l2 = tl.maximum(level - 2, 0)
    st = tl.load(state_ptr + (l2 * B + row) * 2 + two, mask=two * 0 + level >= 2, other=0)
    prefix = tl.sum(tl.where(two == 0, st, 0), axis=0)
    above = tl.sum(tl.where(two == 1, st, 0), axis=0)
    l1 = tl.maximum(level - 1, 0)
    hp = part_ptr + ((l1 * B + row) * NCH + chunks[:, None]) * NB + bins[None, :]
    hist = tl.sum(tl.load(hp, mask=(chunks[:, None] < NCH) & (chunks[:, None] * 0 + level >= 1), other=0), axis=0)
    d, above_d = _decide(hist, above, limit, bins, NB)
    prefix = tl.where(level >= 1, (prefix << D) | d, prefix)
    above = tl.where(level >= 1, above_d, above)
    tl.store(state_ptr + (l1 * B + row) * 2 + two, tl.where(two == 0, prefix, above),
             mask=(two * 0 + c == 0) & (two * 0 + level >= 1))
    cols = tl.arange(0, BLOCK)
    start = c * CHUNK
    if FINAL:  # prefix is v's bits: write the mask
        v_bits = prefix.to(tl.int32)
        room = _room(v_bits, limit, above, V)
        keep_all = cols * 0 + (tl.load(top_p_ptr + row) >= 1.0).to(tl.int32) != 0  # top_p 1 keeps every token
        # v's tokens in the chunks before this one (its last digit's counts, per chunk)
        cp = cnt_ptr + (row * NCH + chunks) * NB + (prefix & (NB - 1))
        rank0 = tl.sum(tl.load(cp, mask=chunks < c, other=0), axis=0)
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + cols
            rank0 += _mask_block(p_ptr, keep_ptr, row, sp, sk, offs, offs < V, v_bits, keep_all, rank0, room)
    else:  # this digit's bins over the chunk's tokens under the prefix
        shift = _PROB_BITS - D * (level + 1)
        hist = tl.zeros([NB], dtype=tl.int64)
        cnt = tl.zeros([NB], dtype=tl.int32)
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + cols
            m = offs < V
            p = tl.load(p_ptr + row * sp + offs, mask=m, other=0.0)
            bits = p.to(tl.int32, bitcast=True)
            own = ((bits >> (shift + D)) == prefix) & m  # NaN's bits (>= 2**30) are never under it
            # past the first digits few tokens are under the prefix, and most blocks hold none:
            # they add nothing to the bins, so their one-hot sums are skipped (integer sums, so
            # skipping zeros changes no bit)
            if tl.max(own.to(tl.int32), axis=0) > 0:
                hit, masses = _block_hits(p, bits, own, shift, bins, NB)
                hist += masses
                cnt += tl.sum(hit.to(tl.int32), axis=0)
        tl.store(part_ptr + ((level * B + row) * NCH + c) * NB + bins, hist)
        tl.store(cnt_ptr + (row * NCH + c) * NB + bins, cnt, mask=bins * 0 + level == LEVELS - 1)


@lazy_jit(do_not_specialize=["V"])  # one compiled kernel per digit width and block
def _top_p_row_kernel(p_ptr, top_p_ptr, limit_ptr, keep_ptr, V, sp, sk, D: tl.constexpr, LEVELS: tl.constexpr,
                      BLOCK: tl.constexpr):
    """The whole select of one row in one program (the `row` launch): the same digits, bins and
    decisions as `_top_p_kernel`'s launches, walked in a loop, and an early end. When every token
    under the prefix has the same bits and their mass is positive, every later digit would choose
    that value's own digit (its bin is the only one present, and the mass above it is < limit), so
    v is that value and the mass above it is unchanged: the loop stops there."""
    NB: tl.constexpr = 1 << D
    row = tl.program_id(0).to(tl.int64)
    bins = tl.arange(0, NB)
    cols = tl.arange(0, BLOCK)
    limit = tl.load(limit_ptr + row)
    above = limit * 0  # mass above the prefix's range (int64)
    prefix = above.to(tl.int32)  # v's digits decided so far
    level = prefix
    found = prefix
    while (level < LEVELS) & (found == 0):
        shift = _PROB_BITS - D * (level + 1)
        hist = tl.zeros([NB], dtype=tl.int64)
        lo = prefix * 0 + 2147483647  # the least and greatest bits under the prefix
        hi = prefix * 0 - 1
        for i in range(0, V, BLOCK):
            offs = i + cols
            m = offs < V
            p = tl.load(p_ptr + row * sp + offs, mask=m, other=0.0)
            bits = p.to(tl.int32, bitcast=True)
            own = ((bits >> (shift + D)) == prefix) & m  # NaN's bits (>= 2**30) are never under it
            if tl.max(own.to(tl.int32), axis=0) > 0:  # a block with none adds nothing (as in the launches)
                _, masses = _block_hits(p, bits, own, shift, bins, NB)
                hist += masses
                lo = tl.minimum(lo, tl.min(tl.where(own, bits, 2147483647), axis=0))
                hi = tl.maximum(hi, tl.max(tl.where(own, bits, -1), axis=0))
        if (lo == hi) & (tl.sum(hist, axis=0) > 0):  # one value of positive mass left: it is v
            prefix = lo
            found = prefix * 0 + 1
        else:
            d, above_d = _decide(hist, above, limit, bins, NB)
            prefix = (prefix << D) | d
            above = above_d
            level += 1
    v_bits = prefix
    room = _room(v_bits, limit, above, V)
    keep_all = cols * 0 + (tl.load(top_p_ptr + row) >= 1.0).to(tl.int32) != 0  # top_p 1 keeps every token
    rank0 = v_bits * 0  # v's tokens in the blocks before
    for i in range(0, V, BLOCK):
        offs = i + cols
        rank0 += _mask_block(p_ptr, keep_ptr, row, sp, sk, offs, offs < V, v_bits, keep_all, rank0, room)


@register("top_p", "triton_rowwise", devices=("cuda",))
def top_p_keep_triton(xk: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    name = "top_p/triton_rowwise"
    check_device(name, xk, top_p)
    if xk.dim() != 2 or xk.dtype != torch.float32:
        raise ValueError(f"{name}: xk must be float32 [B, V], got {xk.dtype} {tuple(xk.shape)}")
    probs = torch.softmax(xk, dim=-1).contiguous()  # the reference's probabilities, the same bits
    B, V = probs.shape
    keep = torch.empty(B, V, dtype=torch.bool, device=xk.device)
    if B == 0 or V == 0:
        return keep
    launch, bits = launch_for(B)
    if _BITS % bits or launch not in ("levels", "row"):
        raise ValueError(f"{name}: launch {launch!r} at {bits} bits a digit: the launch must be 'levels' or "
                         f"'row', and the bits must divide {_BITS}")
    limit = torch.ceil(top_p.double() * SCALE).long().contiguous()
    tp = top_p.double().contiguous()
    if WARM_ALL_LAUNCHES if WARM_ALL_LAUNCHES is not None else xk.is_cuda:
        _warm_launches(probs, tp, limit, (launch, bits))
    _keep(probs, tp, limit, keep.view(torch.uint8), launch, bits)
    return keep


# "auto" takes another launch when the batch crosses a bound, and each launch is its own Triton
# kernel: so that a batch of 33 or 192 rows meets no compile while serving, the first call for a
# device and vocabulary also runs every other launch on its first row (`_warm_launches`). The warm
# start (engine/warmup.py) makes that first call. None: on CUDA (where kernels compile)
WARM_ALL_LAUNCHES: bool | None = None
_WARMED: set = set()


def _warm_launches(probs, tp, limit, taken: tuple[str, int]) -> None:
    key = (str(probs.device), probs.shape[1])
    if LAUNCH != "auto" or key in _WARMED:
        return
    _WARMED.add(key)
    sink = torch.empty(1, probs.shape[1], dtype=torch.uint8, device=probs.device)
    for launch, bits in (("levels", 3), ("levels", 2), ("row", 2)):
        if (launch, bits) != taken:
            _keep(probs[:1], tp[:1], limit[:1], sink, launch, bits)


def _keep(probs, tp, limit, out, launch: str, bits: int) -> None:
    """The mask of `probs` [B, V] into `out` (uint8), by `launch` at `bits` bits a digit."""
    B, V = probs.shape
    levels, nb = _BITS // bits, 1 << bits
    if launch == "row":
        _top_p_row_kernel[(B,)](probs, tp, limit, out, V, probs.stride(0), out.stride(0), D=bits,
                                LEVELS=levels, BLOCK=min(ROW_BLOCK, triton.next_power_of_2(V)), num_warps=ROW_WARPS)
        return
    block = min(BLOCK, triton.next_power_of_2(V))
    chunk = block * CHUNK_BLOCKS
    nch = triton.cdiv(V, chunk)
    dev = probs.device
    part = torch.empty(levels, B, nch, nb, dtype=torch.int64, device=dev)
    state = torch.empty(levels, B, 2, dtype=torch.int64, device=dev)
    cnt = torch.empty(B, nch, nb, dtype=torch.int32, device=dev)
    for level in range(levels + 1):
        _top_p_kernel[(B, nch)](probs, tp, limit, part, state, cnt, out, V, B, nch, level, probs.stride(0),
                                out.stride(0), D=bits, LEVELS=levels, NCH_PAD=triton.next_power_of_2(nch),
                                CHUNK=chunk, BLOCK=block, FINAL=level == levels, num_warps=8)
