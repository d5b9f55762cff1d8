"""The split merge of the paged attention kernel (kernels/attention_triton.py).

A row's KV is walked in splits of a fixed size; each split leaves a partial
(m, l, acc) from a fresh online softmax. `_merge` folds a split's partial into
the running (M, L, ACC) in ascending split order, with explicit fma. The
attention program calls it when one program walks its splits (`sequential`);
`_combine_kernel` calls it over the fp32 partials that one program per split
wrote (`parallel`, and the short launch's split form). Both are the same
operations on the same values, so the launch choice does not move a bit.
`_split_end` ends a split in the attention program: its partial stored for
the combine kernel, or merged at once. `_owning_seq` is the search both
kernels use to find the sequence of a row or a q tile.
"""

from __future__ import annotations

import triton
import triton.language as tl

from detent.kernels.common_triton import lazy_jit


@triton.jit
def _merge(M, L, ACC, m, l, acc, scale, EXP2: tl.constexpr):
    """Split (m, l, acc) into the running (M, L, ACC), in ascending split order, with
    explicit fma (so the compiler cannot contract it differently in the attention program
    and in the combine kernel); with EXP2 the maxima are of unscaled scores."""
    M_new = tl.maximum(M, m)
    M_safe = tl.where(M_new == float("-inf"), 0.0, M_new)
    if EXP2:
        # (x - max) * c, not fma(x, c, -max * c): exactly 1 where x is the max (an empty
        # split merged into the running one changes nothing, whichever q tile walked it)
        c = scale * 1.4426950408889634  # scale * log2(e), as the tiles use it
        a = tl.exp2((M - M_safe) * c)
        bw = tl.exp2((m - M_safe) * c)
    else:
        a = tl.exp(M - M_safe)
        bw = tl.exp(m - M_safe)
    L = tl.fma(L, a, l * bw)
    ACC = tl.fma(ACC, a[:, None], acc * bw[:, None])
    return M_new, L, ACC


@triton.jit
def _split_end(s, m, l, acc, M, L, ACC, pm_ptr, pl_ptr, pacc_ptr, tok, head, d, row_ok, sp_s, sp_t, sp_h, spa_s,
               spa_t, spa_h, scale, PARALLEL: tl.constexpr, EXP2: tl.constexpr):
    """Split s's (m, l, acc): its fp32 partials for the combine kernel (PARALLEL), or merged
    into the running (M, L, ACC) in ascending split order; the running state."""
    if PARALLEL:
        ps = tl.cast(s, tl.int64)
        tl.store(pm_ptr + ps * sp_s + tok * sp_t + head * sp_h, m, mask=row_ok)
        tl.store(pl_ptr + ps * sp_s + tok * sp_t + head * sp_h, l, mask=row_ok)
        tl.store(pacc_ptr + ps * spa_s + tok[:, None] * spa_t + head[:, None] * spa_h + d[None, :], acc,
                 mask=row_ok[:, None])
    else:
        M, L, ACC = _merge(M, L, ACC, m, l, acc, scale, EXP2)
    return M, L, ACC


@triton.jit
def _owning_seq(qsl_ptr, num_seqs, key, BLOCK_Q: tl.constexpr):
    """The sequence that owns row `key` (BLOCK_Q = 0: a query token) or q tile `key`
    (sequence b's tiles start at qsl[b] // BLOCK_Q + b): a binary search over
    query_start_loc for the last b whose first row or tile is at most `key`."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first = tl.load(qsl_ptr + mid)
        if BLOCK_Q > 0:
            first = first // BLOCK_Q + mid
        if first <= key:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# skip_q (0, or the short launch's query count) is a value, not a constant: one compile
# serves steps with and without a short launch
@lazy_jit(do_not_specialize=["num_seqs", "skip_q"])
def _combine_kernel(o_ptr, pm_ptr, pl_ptr, pacc_ptr, qsl_ptr, seqlen_ptr, num_seqs, skip_q,
                    so_t, so_h, sp_s, sp_t, sp_h, spa_s, spa_t, spa_h, scale,
                    D: tl.constexpr, SPLIT: tl.constexpr, DECODE: tl.constexpr, EXP2: tl.constexpr = False,
                    SHORT_Q: tl.constexpr = 0):
    t = tl.program_id(0)  # the partials' row (and the output's, but for SHORT_Q)
    h = tl.program_id(1)
    row = t
    if DECODE:  # token t is sequence t's only query
        b = t
        q_start = t
        q_len = 1
    elif SHORT_Q > 0:  # the short launch's rows: query t % SHORT_Q of sequence t // SHORT_Q
        b = t // SHORT_Q
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
        row = q_start + t % SHORT_Q
    else:
        b = _owning_seq(qsl_ptr, num_seqs, t, 0)
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
    pos = tl.load(seqlen_ptr + b) - q_len + (row - q_start)
    n_split = pos // SPLIT + 1
    if SHORT_Q > 0:  # a slot past the sequence's queries, or a sequence the long launch wrote
        n_split = tl.where((row - q_start < q_len) & (q_len <= SHORT_Q), n_split, 0)
    else:
        n_split = tl.where(q_len <= skip_q, 0, n_split)  # the short launch writes this row
    d = tl.arange(0, D)
    t64 = t.to(tl.int64)
    M = tl.full((1,), float("-inf"), tl.float32)
    L = tl.zeros((1,), tl.float32)
    ACC = tl.zeros((1, D), tl.float32)
    one = tl.arange(0, 1)
    for s in range(0, n_split):
        ps = tl.cast(s, tl.int64)
        m = tl.load(pm_ptr + ps * sp_s + t64 * sp_t + h * sp_h + one)
        l = tl.load(pl_ptr + ps * sp_s + t64 * sp_t + h * sp_h + one)
        acc = tl.load(pacc_ptr + ps * spa_s + t64 * spa_t + h * spa_h + d[None, :])
        M, L, ACC = _merge(M, L, ACC, m, l, acc, scale, EXP2)  # the program's merge, the same operations
    if n_split > 0:
        out = ACC / L[:, None]
        tl.store(o_ptr + row.to(tl.int64) * so_t + h * so_h + d[None, :], out.to(o_ptr.dtype.element_ty))
