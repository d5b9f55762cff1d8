"""One KV tile's step of the paged attention kernel's online softmax
(kernels/attention_triton.py), as Triton device functions.

A split of a row's KV is walked in BLOCK_N tiles from a fresh state
(`_fresh_split`): each tile gathers its pages from the block table
(`_tile_blocks`), scores them against the q tile (`_tile_scores`), and folds
its probabilities into the running max, row sum and output (`_kv_tile`, in the
deployment's exponent form: `_kv_tile_exp` or FlashAttention's `_kv_tile_exp2`;
`_accumulate`, with the row sum through the MMA or, deferred a tile, `_fold`).
The split's end is kernels/attention_merge.py's.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _tile_blocks(bt_row, j0, kv_hi, cols, PAGE: tl.constexpr):
    """The KV pages of positions [j0, j0 + BLOCK_N) from the block table (int64; 0 for
    positions at or past kv_hi, whose K and V loads are masked)."""
    kpos = j0 + cols
    return tl.load(bt_row + kpos // PAGE, mask=kpos < kv_hi, other=0).to(tl.int64)


@triton.jit
def _tile_scores(q, kc_ptr, vc_ptr, blk, j0, kv_hi, cols, d, sc_blk, sc_off, sc_h, kvh, PAGE: tl.constexpr,
                 IEEE: tl.constexpr):
    """KV positions [j0, j0 + BLOCK_N) on their pages `blk`: (positions, which are below
    kv_hi, the raw scores q @ k^T [BLOCK_M, BLOCK_N], v [BLOCK_N, D]); masked loads."""
    kpos = j0 + cols
    k_ok = kpos < kv_hi
    off = (blk * sc_blk + (kpos % PAGE) * sc_off + kvh * sc_h)
    k = tl.load(kc_ptr + off[None, :] + d[:, None], mask=k_ok[None, :], other=0.0)  # [D, BN]
    v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=k_ok[:, None], other=0.0)  # [BN, D]
    if IEEE:
        sc = tl.dot(q, k, input_precision="ieee")
    else:
        sc = tl.dot(q, k)
    return kpos, k_ok, sc, v


@triton.jit
def _kv_tile_exp2(q, m, l, acc, rs, ra, kc_ptr, vc_ptr, blk, j0, kv_hi, pos, cols, d, ones, c, sc_blk, sc_off, sc_h,
                  kvh, PAGE: tl.constexpr, IEEE: tl.constexpr, ROWSUM_MMA: tl.constexpr, MASKED: tl.constexpr,
                  DEFER: tl.constexpr):
    """One BLOCK_N tile of KV positions [j0, j0 + BLOCK_N) into a split's online softmax
    (m, l, acc) in FlashAttention's form (softmax="exp2"): the running max is over the
    unscaled scores, and p = exp2(fma(s, c, -m c)) with c = scale * log2(e), the fma
    explicit. A tile whose every score the causal and split-end mask would keep
    (MASKED=False, split_mask) was meant to do exactly the arithmetic of a masked one,
    the mask only turning scores into -inf before the max; on the H200 it did not
    (docs/performance.md, "Lease 16"), so no program selects it. (softmax="exp" scales
    the scores first, and without a mask between them the compiler contracts the scale
    into the exponent's subtraction: other bits; "Lease 15".) The loads stay masked."""
    kpos, k_ok, sc, v = _tile_scores(q, kc_ptr, vc_ptr, blk, j0, kv_hi, cols, d, sc_blk, sc_off, sc_h, kvh,
                                     PAGE, IEEE)
    if MASKED:
        sc = tl.where((kpos[None, :] <= pos[:, None]) & k_ok[None, :], sc, float("-inf"))
    m_new = tl.maximum(m, tl.max(sc, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    mc = m_safe * c
    p = tl.exp2(tl.fma(sc, c, -mc[:, None]))
    # the rescale as (m - m_new) * c: exactly 1 when the max did not move, so the tiles a row
    # sees nothing of (past its position, inside its q tile's walk) leave it as it was; the
    # fma form rounds m * c twice and gave exp2(rounding error), moving the bits with the tile
    alpha = tl.exp2((m - m_safe) * c)
    l, acc, rs, ra = _accumulate(p, alpha, l, acc, rs, ra, v, ones, IEEE, ROWSUM_MMA, DEFER)
    return m_new, l, acc, rs, ra


@triton.jit
def _kv_tile_exp(q, m, l, acc, rs, ra, kc_ptr, vc_ptr, blk, j0, kv_hi, pos, cols, d, ones, scale, sc_blk, sc_off,
                 sc_h, kvh, PAGE: tl.constexpr, IEEE: tl.constexpr, ROWSUM_MMA: tl.constexpr, DEFER: tl.constexpr):
    """One BLOCK_N tile of KV positions [j0, j0 + BLOCK_N) into a split's online softmax
    (m, l, acc), softmax="exp": the scores scaled, masked (causal, and inside the split:
    a split size that is not a multiple of BLOCK_N ends inside a tile), then exp(s - m)."""
    kpos, k_ok, sc, v = _tile_scores(q, kc_ptr, vc_ptr, blk, j0, kv_hi, cols, d, sc_blk, sc_off, sc_h, kvh,
                                     PAGE, IEEE)
    sc = sc * scale
    sc = tl.where((kpos[None, :] <= pos[:, None]) & k_ok[None, :], sc, float("-inf"))
    m_new = tl.maximum(m, tl.max(sc, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp(sc - m_safe[:, None])
    alpha = tl.exp(m - m_safe)
    l, acc, rs, ra = _accumulate(p, alpha, l, acc, rs, ra, v, ones, IEEE, ROWSUM_MMA, DEFER)
    return m_new, l, acc, rs, ra


@triton.jit
def _accumulate(p, alpha, l, acc, rs, ra, v, ones, IEEE: tl.constexpr, ROWSUM_MMA: tl.constexpr,
                DEFER: tl.constexpr):
    """A tile's probabilities p into the split's row sum l and output acc, both rescaled by
    alpha. The row sum goes through the MMA (p @ ones, then an exact max over 16 equal
    columns): tl.sum's order follows the register layout, which changes with BLOCK_M /
    num_warps / MMA kind. DEFER (defer_rowsum): the previous tile's row-sum MMA `rs` and
    rescale `ra` are folded into l now, and this tile's are returned to be folded at the
    next tile or the split's end (`_fold`): the same fma on the same values, but the MMA
    need not be waited for before the P.V one is issued (on sm_90 with Triton 3.6 it then
    retires with the next tile's QK^T: one wait per tile instead of two)."""
    if IEEE:
        pb = p
    else:
        pb = p.to(v.dtype)
    if ROWSUM_MMA:
        if IEEE:
            r = tl.dot(pb, ones, input_precision="ieee")
        else:
            r = tl.dot(pb, ones)
        if DEFER:
            l = _fold(l, rs, ra, True)
            rs = r
            ra = alpha
        else:
            l = tl.fma(l, alpha, tl.max(r, axis=1))
    else:
        l = l * alpha + tl.sum(p, axis=1)
    if IEEE:
        acc = tl.dot(pb, v, acc * alpha[:, None], input_precision="ieee")
    else:
        acc = tl.dot(pb, v, acc * alpha[:, None])
    return l, acc, rs, ra


@triton.jit
def _fold(l, rs, ra, DEFER: tl.constexpr):
    """l with a deferred row sum folded in (DEFER), as `_accumulate` would have folded it."""
    if DEFER:
        l = tl.fma(l, ra, tl.max(rs, axis=1))
    return l


@triton.jit
def _kv_tile(q, m, l, acc, rs, ra, kc_ptr, vc_ptr, blk, j0, kv_hi, pos, cols, d, ones, scale, c, sc_blk, sc_off,
             sc_h, kvh, PAGE: tl.constexpr, IEEE: tl.constexpr, ROWSUM_MMA: tl.constexpr, EXP2: tl.constexpr,
             DEFER: tl.constexpr):
    """One masked KV tile into a split's (m, l, acc, deferred row sum) in the deployment's
    exponent form."""
    if EXP2:
        return _kv_tile_exp2(q, m, l, acc, rs, ra, kc_ptr, vc_ptr, blk, j0, kv_hi, pos, cols, d, ones, c, sc_blk,
                             sc_off, sc_h, kvh, PAGE, IEEE, ROWSUM_MMA, True, DEFER)
    else:
        return _kv_tile_exp(q, m, l, acc, rs, ra, kc_ptr, vc_ptr, blk, j0, kv_hi, pos, cols, d, ones, scale, sc_blk,
                            sc_off, sc_h, kvh, PAGE, IEEE, ROWSUM_MMA, DEFER)


@triton.jit
def _fresh_split(BLOCK_M: tl.constexpr, D: tl.constexpr):
    """A split's online-softmax state before its first tile: (m, l, acc, rs, ra), the last
    two a deferred row sum of zeros at a rescale of 1 (folded: fma(0, 1, 0) = 0 exactly)."""
    return (tl.full((BLOCK_M,), float("-inf"), tl.float32), tl.zeros((BLOCK_M,), tl.float32),
            tl.zeros((BLOCK_M, D), tl.float32), tl.zeros((BLOCK_M, 16), tl.float32),
            tl.full((BLOCK_M,), 1.0, tl.float32))
