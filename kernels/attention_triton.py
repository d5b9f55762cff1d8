"""Paged attention in Triton: one kernel for prefill, chunked prefill and decode.

Queries are varlen (`query_start_loc`), KV is paged
(`kv_cache [2, num_blocks, block_size, KVH, D]`, `block_tables`,
`seq_lens`); causal by absolute position. GQA packing: a tile's BLOCK_M rows
are BLOCK_M // G query tokens of one sequence times the G query heads that
share one KV head.

Split-KV with a FIXED split size in KV tokens: split s covers absolute KV
positions [s*S, (s+1)*S), walked in BLOCK_N tiles from s*S upwards with an
online softmax from a fresh state. Splits merge in ascending s with one
formula (explicit fma, so the compiler cannot contract it differently in
different kernels):
    M' = max(M, m_s);  a = exp(M - M');  b = exp(m_s - M')
    L' = fma(L, a, l_s * b);  ACC' = fma(ACC, a, acc_s * b);  out = ACC / L
The merge runs either inside the attention program (`sequential`: one
program walks its splits in order) or in a second small kernel over fp32
partials (`parallel`: one program per split, for batches too small to fill
the GPU); both are in kernels/attention_merge.py, and one KV tile's step of
the online softmax in kernels/attention_tiles.py. Both perform the same
operations on the same values, so the choice is a launch detail (tests/gpu
checks the bits agree). So is the decode launch (`DECODE`: every sequence
has one query, program b serves sequence b without searching
`query_start_loc`).

Why a row's bits do not depend on the batch: a row's dot products reduce
inside one MMA per tile, its row max is exact, its row sum is either a
tl.sum along its own tile row (rowsum="sum": the order follows the register
layout, so the tile shape must be fixed) or p @ ones through the MMA
(rowsum="mma": bits independent of BLOCK_M and num_warps, measured on the
H200 for 16-128 rows and 4/8 warps), and the
KV positions it visits are fixed by S and BLOCK_N. Rows sharing its tile may
make the program visit later KV tiles that are fully masked for this row:
those add exact zeros (p = 0, alpha = 1). Splits with no visible key merge
with weight exactly 0.

Stock attention on GPU is this same kernel with `split_tokens` derived from
an FA3-style split count (the SelIR program computes it from the batch).
"""
from __future__ import annotations

import contextlib

import torch
import triton.language as tl

from detent.kernels.attention_merge import _combine_kernel, _owning_seq, _split_end
from detent.kernels.attention_plan import LaunchPlan, kernel_variants, launch_plan, step_variants  # noqa: F401
from detent.kernels.attention_tiles import _fold, _fresh_split, _kv_tile, _kv_tile_exp2, _tile_blocks
from detent.kernels.common_triton import (check_device, check_dtype, check_last_contiguous, empty,
                                          empty_like, lazy_jit, sms_for)
from detent.kernels.rowwise_triton import store_kv_triton
from detent.kernels.registry import register


# not specialized: the block table's row stride follows the step's longest sequence, and a
# compile per divisibility class would meet its second class while serving (engine/warmup.py)
@lazy_jit(do_not_specialize=["num_seqs", "sbt"])
def _paged_attn_kernel(
        q_ptr, kc_ptr, vc_ptr, o_ptr, pm_ptr, pl_ptr, pacc_ptr,
        qsl_ptr, seqlen_ptr, bt_ptr, scale, num_seqs,
        sq_t, sq_h, sc_blk, sc_off, sc_h, so_t, so_h, sbt,
        sp_s, sp_t, sp_h, spa_s, spa_t, spa_h,
        G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_Q: tl.constexpr, SPLIT: tl.constexpr, PAGE: tl.constexpr,
        PARALLEL: tl.constexpr, IEEE: tl.constexpr, ROWSUM_MMA: tl.constexpr, DECODE: tl.constexpr,
        SHORT: tl.constexpr, SKIP_Q: tl.constexpr, EXP2: tl.constexpr = False,
        SPLIT_MASK: tl.constexpr = False, HEAVY_FIRST: tl.constexpr = False, FLAT: tl.constexpr = False,
        PREFETCH: tl.constexpr = False, DEFER: tl.constexpr = False):
    qtile = tl.program_id(0)
    if HEAVY_FIRST:  # the blocks start in program order: the longest causal walks first
        qtile = tl.num_programs(0) - 1 - qtile
    kvh = tl.program_id(1)
    if DECODE:  # one query per sequence: q tile b is sequence b (no search, no idle tiles)
        b = qtile
        q_start = qtile
        q_len = 1
        q_blk = 0
    elif SHORT:  # program b serves sequence b if its queries fit one tile (the short launch)
        b = qtile
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
        q_blk = 0
        q_len = tl.where(q_len <= BLOCK_Q, q_len, 0)  # longer ones are the long launch's
    else:
        b = _owning_seq(qsl_ptr, num_seqs, qtile, BLOCK_Q)  # the sequence owning this q tile
        q_start = tl.load(qsl_ptr + b)
        q_len = tl.load(qsl_ptr + b + 1) - q_start
        q_blk = qtile - (q_start // BLOCK_Q + b)
        if SKIP_Q > 0:  # sequences of at most SKIP_Q queries are the short launch's
            q_len = tl.where(q_len <= SKIP_Q, 0, q_len)
    if q_blk * BLOCK_Q < q_len:
        ctx = tl.load(seqlen_ptr + b) - q_len  # absolute position of the first query
        rows = tl.arange(0, BLOCK_M)
        qi = q_blk * BLOCK_Q + rows // G
        head = kvh * G + rows % G
        row_ok = (qi < q_len) & (rows < BLOCK_Q * G)
        pos = ctx + qi  # [BLOCK_M] absolute positions
        d = tl.arange(0, D)
        tok = (q_start + qi).to(tl.int64)
        # the split partials' row: the token's, or in the short launch the sequence's slot of
        # BLOCK_Q rows (its buffer holds the short sequences' rows only)
        prow = tok
        if SHORT:
            prow = (b * BLOCK_Q + qi).to(tl.int64)
        q = tl.load(q_ptr + tok[:, None] * sq_t + head[:, None] * sq_h + d[None, :],
                    mask=row_ok[:, None], other=0.0)  # [BLOCK_M, D]
        max_pos = ctx + tl.minimum(q_blk * BLOCK_Q + BLOCK_Q, q_len) - 1
        n_split = max_pos // SPLIT + 1
        cols = tl.arange(0, BLOCK_N)
        ones = tl.full((BLOCK_N, 16), 1.0, dtype=q.dtype)
        bt_row = bt_ptr + b.to(tl.int64) * sbt
        if PARALLEL:
            s_first = tl.program_id(2)
            s_last = tl.minimum(s_first + 1, n_split)
        else:
            s_first = 0
            s_last = n_split
        M = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        L = tl.zeros((BLOCK_M,), tl.float32)
        ACC = tl.zeros((BLOCK_M, D), tl.float32)
        c = scale * 1.4426950408889634  # scale * log2(e), for softmax="exp2"
        sp = (pm_ptr, pl_ptr, pacc_ptr, prow, head, d, row_ok, sp_s, sp_t, sp_h, spa_s, spa_t, spa_h, scale)
        if FLAT:
            # the same tiles, splits and merges in one loop over the KV tiles (SPLIT a multiple
            # of BLOCK_N): the compiler's pipeline prefetches across split ends, which a loop
            # per split (4 tiles at 256 / 64) restarts
            m, l, acc, rs, ra = _fresh_split(BLOCK_M, D)
            j_lo = s_first * SPLIT
            j_hi = tl.minimum(s_last * SPLIT, max_pos + 1)
            if PREFETCH:  # the first tile's pages; each tile then reads the next one's
                blk = _tile_blocks(bt_row, j_lo, j_hi, cols, PAGE)
            for j0 in range(j_lo, j_hi, BLOCK_N):
                kv_hi = tl.minimum((j0 // SPLIT + 1) * SPLIT, max_pos + 1)  # this tile's split's end
                if PREFETCH:
                    # the next tile's pages, read a tile ahead and carried: this tile's K and V
                    # addresses then need no load of this iteration, so the compiler's pipeline
                    # can have the next tile's copies in flight during this tile's MMAs (at 3
                    # stages; docs/performance.md "Lease 17"). Pages past kv_hi are masked either
                    # way, so every loaded K and V value is the same
                    blk_next = _tile_blocks(bt_row, j0 + BLOCK_N, j_hi, cols, PAGE)
                else:
                    blk = _tile_blocks(bt_row, j0, kv_hi, cols, PAGE)
                m, l, acc, rs, ra = _kv_tile(q, m, l, acc, rs, ra, kc_ptr, vc_ptr, blk, j0, kv_hi, pos, cols, d, ones,
                                             scale, c, sc_blk, sc_off, sc_h, kvh, PAGE, IEEE, ROWSUM_MMA, EXP2, DEFER)
                if PREFETCH:
                    blk = blk_next
                if j0 + BLOCK_N >= kv_hi:  # the split's last tile
                    M, L, ACC = _split_end(j0 // SPLIT, m, _fold(l, rs, ra, DEFER), acc, M, L, ACC, *sp, PARALLEL,
                                           EXP2)
                    m, l, acc, rs, ra = _fresh_split(BLOCK_M, D)
        else:
            for s in range(s_first, s_last):
                m, l, acc, rs, ra = _fresh_split(BLOCK_M, D)
                kv_hi = tl.minimum((s + 1) * SPLIT, max_pos + 1)
                # the split's tiles in order: with SPLIT_MASK (softmax="exp2" only) first those
                # every row of the q tile sees whole (no mask), then the rest masked; the same
                # arithmetic either way
                j_full = s * SPLIT
                if SPLIT_MASK:
                    j_full += tl.maximum(tl.minimum(kv_hi, ctx + q_blk * BLOCK_Q + 1) - s * SPLIT, 0) \
                        // BLOCK_N * BLOCK_N
                    for j0 in range(s * SPLIT, j_full, BLOCK_N):
                        blk = _tile_blocks(bt_row, j0, kv_hi, cols, PAGE)
                        m, l, acc, rs, ra = _kv_tile_exp2(q, m, l, acc, rs, ra, kc_ptr, vc_ptr, blk, j0, kv_hi, pos,
                                                          cols, d, ones, c, sc_blk, sc_off, sc_h, kvh, PAGE, IEEE,
                                                          ROWSUM_MMA, False, DEFER)
                for j0 in range(j_full, kv_hi, BLOCK_N):
                    blk = _tile_blocks(bt_row, j0, kv_hi, cols, PAGE)
                    m, l, acc, rs, ra = _kv_tile(q, m, l, acc, rs, ra, kc_ptr, vc_ptr, blk, j0, kv_hi, pos, cols, d,
                                                 ones, scale, c, sc_blk, sc_off, sc_h, kvh, PAGE, IEEE, ROWSUM_MMA,
                                                 EXP2, DEFER)
                M, L, ACC = _split_end(s, m, _fold(l, rs, ra, DEFER), acc, M, L, ACC, *sp, PARALLEL, EXP2)
        if not PARALLEL:
            out = ACC / L[:, None]
            tl.store(o_ptr + tok[:, None] * so_t + head[:, None] * so_h + d[None, :],
                     out.to(o_ptr.dtype.element_ty), mask=row_ok[:, None])


def _check(name, q, k, v, kv_cache, meta, split_tokens, block_m, block_n):
    check_device(name, q, k, v, kv_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables,
                 meta.slot_mapping)
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"{name}: q must be [T, H, D], k and v [T, KVH, D]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    t, h, d = q.shape
    kvh = k.shape[1]
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2 or kv_cache.shape[3:] != (kvh, d):
        raise ValueError(f"{name}: kv_cache must be [2, num_blocks, block_size, {kvh}, {d}], "
                         f"got {tuple(kv_cache.shape)}")
    if kv_cache.shape[2] != meta.block_size:
        raise ValueError(f"{name}: kv_cache block_size {kv_cache.shape[2]} != meta.block_size {meta.block_size}")
    if h % kvh:
        raise ValueError(f"{name}: num_heads {h} is not a multiple of num_kv_heads {kvh}")
    if d not in (64, 128, 256) and not (d >= 16 and d & (d - 1) == 0):
        raise ValueError(f"{name}: head_dim {d} must be a power of two >= 16 (64 and 128 are tested)")
    check_dtype(name, "q", q)
    if kv_cache.dtype != q.dtype:
        raise TypeError(f"{name}: kv_cache dtype {kv_cache.dtype} != q dtype {q.dtype}")
    for f, x in (("q", q), ("kv_cache", kv_cache)):
        check_last_contiguous(name, f, x)
    g = h // kvh
    if block_m < 16 or block_m & (block_m - 1) or block_m < g:
        raise ValueError(f"{name}: block_m={block_m} must be a power of two >= 16 and >= "
                         f"heads per KV head ({g})")
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"{name}: block_n={block_n} must be a power of two >= 16")
    if not isinstance(split_tokens, int) or split_tokens <= 0:
        raise ValueError(f"{name}: split_tokens={split_tokens!r} must be a positive int")
    if meta.query_start_loc.dtype != torch.int32 or meta.seq_lens.dtype != torch.int32 or \
            meta.block_tables.dtype != torch.int32:
        raise TypeError(f"{name}: query_start_loc, seq_lens and block_tables must be int32")


@register("attention", "triton_paged",
          params=("split_tokens", "block_m", "block_n", "num_warps", "num_stages", "combine", "rowsum",
                  "short_launch", "overlap_short", "softmax", "split_mask", "tile_loop", "defer_rowsum"),
          devices=("cuda",), variants=step_variants)
def attention_triton_paged(q, k, v, kv_cache, meta, scale: float, split_tokens: int = 256,
                           block_m: int = 64, block_n: int = 64, num_warps: int = 4,
                           num_stages: int = 2, combine: str = "auto", rowsum: str = "mma",
                           short_launch: bool = True, overlap_short: bool = False, softmax: str = "exp",
                           split_mask: bool = False, tile_order: str = "heavy_first",
                           tile_loop: str = "nested", short_combine: str = "auto",
                           defer_rowsum: bool = False) -> torch.Tensor:
    """combine: "sequential" | "parallel" | "auto" (parallel when the
    sequential grid would leave most SMs idle). Same bits either way.
    short_launch: in a step whose tile is taller than 16 rows (a long chunk's
    step), the sequences with few queries (decodes) run in a second launch on
    16-row tiles (rowsum="mma" only, where the tile is numerics-neutral); False
    keeps every sequence in the one launch (benchmarks compare the two; same bits).
    rowsum: "mma" (p @ ones: bits independent of block_m / num_warps) or
    "sum" (tl.sum: bits tied to the tile shape, 19% faster decode at a
    16-row tile on the H200); the two give different bits, so rowsum is part
    of the pinned choice. split_tokens need not be a multiple of block_n.
    overlap_short: run the short launch on a second CUDA stream beside the long
    one, so the decode rows' programs (memory-bound) can fill the SMs the prompt
    tiles' causal walks leave idle. The launches write disjoint rows and the
    step's stream waits for both: the same bits (tests/gpu). The attention
    program's default since lease 18 (docs/performance.md).
    softmax: "exp" (scores scaled, then exp(s - m)) or "exp2" (FlashAttention's
    form: p = exp2(fma(s, scale log2 e, -m scale log2 e)) on unscaled scores, and
    the rescales as exp2((m_old - m_new) scale log2 e), exactly 1 when the max
    does not move); the two give different bits, so it is part of the pinned
    choice, like rowsum. Rows invariant on the H200 (lease 16). split_mask
    (softmax="exp2" only): walk the tiles every row of a q tile sees whole
    without the mask. Meant to change no bit, but on the H200 it moved rows'
    bits with the chunking and the decode launch (lease 16, not traced): no
    program selects it. The program's default softmax is "exp2" since lease 18.
    tile_order: "heavy_first" (the long launch's programs take their q tiles
    last to first, so a sequence's longest causal walks start in the first wave
    and the last wave holds short ones, as FlashAttention orders them) or
    "ascending" (kept for benchmarks/attn_mixed.py's comparison). Each program's
    arithmetic follows its q tile alone: the same bits (tests/gpu).
    tile_loop: "nested" (a loop per KV split; the default), "flat" (one loop
    over a program's KV tiles, merging at each split's last tile, so the
    compiler's software pipeline runs across split ends), "prefetch" (flat,
    and each tile reads the next tile's block-table entries, so that its K and
    V addresses need no load of the same iteration: with 3 stages the compiler
    then keeps the next tile's copies in flight during this tile's MMAs, which
    it does not otherwise; not timed yet), or "auto": flat for the short
    launch and the decode launch's in-program splits, nested for the long
    launch and for one program per split (H200, lease 17, us per layer: 105
    decodes at 1,100 context 128.9 flat against 140.1 nested at 2 warps and 3
    stages; a 2,048-token prompt 261.1 flat against 243.5; one program per
    split 138.2 flat against 133.7). Not the default until measured under
    load in one hold (docs/performance.md "Lease 17"). With any one loop the
    short launch from 512 programs runs 3 stages (`short_launch_config`). The
    same operations on the same values in every form (tests/gpu); a split
    size that is not a multiple of block_n, or split_mask, walks the nested
    loops.
    short_combine: the short launch's splits walked in one program per (sequence,
    KV head) ("sequential"), or one program per split and then the combine kernel
    for its rows ("parallel"), the decode launch's two forms; "auto" splits up to
    512 programs (`attention_plan.short_launch_config`). Same bits (tests/gpu).
    defer_rowsum (rowsum="mma" only): each KV tile's row-sum MMA is folded into the
    row sum at the next tile (or the split's end) instead of right away: the same
    fma on the same values, so the same bits; compiled for sm_90 with Triton 3.6, the
    long launch then waits for its MMAs once per KV tile instead of twice
    (tests/kernels/test_sm90_compile.py). Timed on the H200 in lease 19: 3-11 % slower
    (docs/performance.md), so no program selects it by default."""
    name = "attention/triton_paged"
    _check(name, q, k, v, kv_cache, meta, split_tokens, block_m, block_n)
    if rowsum not in ("mma", "sum"):
        raise ValueError(f"{name}: rowsum={rowsum!r} must be 'mma' or 'sum'")
    if softmax not in ("exp", "exp2"):
        raise ValueError(f"{name}: softmax={softmax!r} must be 'exp' or 'exp2'")
    if split_mask and softmax != "exp2":
        raise ValueError(f"{name}: split_mask needs softmax='exp2' (with 'exp' an unmasked tile rounds "
                         f"otherwise than a masked one)")
    if tile_order not in ("heavy_first", "ascending"):
        raise ValueError(f"{name}: tile_order={tile_order!r} must be 'heavy_first' or 'ascending'")
    if tile_loop not in ("auto", "flat", "nested", "prefetch"):
        raise ValueError(f"{name}: tile_loop={tile_loop!r} must be 'auto', 'flat', 'nested' or 'prefetch'")
    store_kv_triton(k, v, kv_cache, meta.slot_mapping)
    t, h, d = q.shape
    kvh = k.shape[1]
    g = h // kvh
    out = empty_like(q)
    if t == 0 or meta.num_seqs == 0:
        return out
    lp = launch_plan(t, meta.num_seqs, meta.max_seqlen_q, meta.max_seqlen_k,
                     meta.query_lens_cpu if block_m > 16 and short_launch else None, kvh, g, sms_for(q),
                     block_m=block_m, split_tokens=split_tokens, combine=combine, rowsum=rowsum,
                     short_launch=short_launch, tile_loop=tile_loop, short_combine=short_combine)
    block_q, decode, split, has_short, parallel = lp.block_q, lp.decode, lp.split, lp.has_short, lp.parallel
    short_m, short_q, max_splits, n_qtiles = lp.short_m, lp.short_q, lp.max_splits, lp.n_qtiles
    kc, vc = kv_cache[0], kv_cache[1]
    ieee = q.dtype == torch.float32
    common = (q, kc, vc, out)
    tail = (meta.query_start_loc, meta.seq_lens, meta.block_tables, float(scale), meta.num_seqs,
            q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2), out.stride(0), out.stride(1),
            meta.block_tables.stride(0))
    flags = dict(G=g, D=d, BLOCK_N=block_n, SPLIT=split_tokens, PAGE=meta.block_size, IEEE=ieee,
                 ROWSUM_MMA=rowsum == "mma", EXP2=softmax == "exp2", SPLIT_MASK=split_mask,
                 DEFER=bool(defer_rowsum) and rowsum == "mma")
    can_flat = split_tokens % block_n == 0 and not split_mask
    if tile_loop == "auto":  # flat for the short launch's and the decode launch's in-program splits
        flat_long, flat_short, flat_split = False, can_flat, False
    else:
        flat_long = flat_short = flat_split = can_flat and tile_loop != "nested"
    flags["PREFETCH"] = can_flat and tile_loop == "prefetch"
    skip_q = short_q if split else 0
    side = _side_stream(q.device) if overlap_short and split and has_short and q.is_cuda else None
    if side is not None:  # forks here, after the KV store and the step's inputs: beside the long launch
        side.wait_stream(torch.cuda.current_stream(q.device))
    combine_kw = dict(D=d, SPLIT=split_tokens, EXP2=softmax == "exp2", num_warps=1 if d <= 64 else 2)
    parts = _partials(parallel, max_splits, t, h, d, out)
    _paged_attn_kernel[(n_qtiles, kvh, max_splits if parallel else 1)](
        *common, *parts[:3], *tail, *parts[3:], BLOCK_M=block_m, BLOCK_Q=block_q, PARALLEL=parallel,
        DECODE=decode, SHORT=False, SKIP_Q=skip_q, HEAVY_FIRST=tile_order == "heavy_first" and not decode,
        FLAT=flat_split if parallel else flat_short if decode else flat_long, **flags, num_warps=num_warps,
        num_stages=num_stages)
    if parallel:
        _combine_kernel[(t, h)](out, *parts[:3], meta.query_start_loc, meta.seq_lens, meta.num_seqs, skip_q,
                                out.stride(0), out.stride(1), *parts[3:], float(scale), DECODE=decode, **combine_kw)
    if split and has_short:
        # one program per (sequence, KV head), splits walked in order, or one per split and the
        # combine of the short rows (tests/gpu: the 16-row tile gives the 128-row tile's bits)
        with torch.cuda.stream(side) if side is not None else contextlib.nullcontext():
            # partials in slots of short_q rows per sequence
            sparts = _partials(lp.short_parallel, max_splits, meta.num_seqs * short_q, h, d, out)
            _paged_attn_kernel[(meta.num_seqs, kvh, max_splits if lp.short_parallel else 1)](
                *common, *sparts[:3], *tail, *sparts[3:], BLOCK_M=short_m, BLOCK_Q=short_q,
                PARALLEL=lp.short_parallel, DECODE=False, SHORT=True, SKIP_Q=0,
                FLAT=flat_split if lp.short_parallel else flat_short, **flags, num_warps=lp.short_warps,
                num_stages=lp.short_stages)
            if lp.short_parallel:
                _combine_kernel[(meta.num_seqs * short_q, h)](
                    out, *sparts[:3], meta.query_start_loc, meta.seq_lens, meta.num_seqs, 0, out.stride(0),
                    out.stride(1), *sparts[3:], float(scale), DECODE=False, SHORT_Q=short_q, **combine_kw)
        if side is not None:  # every later use of `out` (and of the inputs) waits for it
            torch.cuda.current_stream(q.device).wait_stream(side)
    return out


def _partials(parallel: bool, splits: int, rows: int, h: int, d: int, out: torch.Tensor) -> tuple:
    """The fp32 split partials of a launch that writes them (parallel): (m, l, acc) buffers of
    `splits` x `rows` x `h` (x `d`), then their six strides, as the kernels take them; else `out`
    three times and zero strides (unused)."""
    if not parallel:
        return (out, out, out) + (0,) * 6
    pm = empty((splits, rows, h), torch.float32, out.device)
    pacc = empty((splits, rows, h, d), torch.float32, out.device)
    return (pm, empty_like(pm), pacc, *pm.stride(), *pacc.stride()[:3])


_SIDE_STREAMS: dict[int, "torch.cuda.Stream"] = {}


def _side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One stream per GPU for the short launch beside the long one (`overlap_short`)."""
    i = device.index if device.index is not None else torch.cuda.current_device()
    if i not in _SIDE_STREAMS:
        _SIDE_STREAMS[i] = torch.cuda.Stream(device=device)
    return _SIDE_STREAMS[i]


def attention_reference(q, k, v, kv_cache, meta, scale: float) -> torch.Tensor:
    """Pure-torch reference in float64: write k, v to the cache, then causal
    attention of each query over its sequence's paged KV."""
    store_kv_reference_ = __import__("detent.kernels.rowwise_triton", fromlist=["x"]).store_kv_reference
    store_kv_reference_(k, v, kv_cache, meta.slot_mapping)
    t, h, d = q.shape
    kvh = k.shape[1]
    out = empty_like(q)
    qsl = meta.query_start_loc.tolist()
    lens = meta.seq_lens.tolist()
    bs = meta.block_size
    for b in range(meta.num_seqs):
        qs, qe, L = qsl[b], qsl[b + 1], lens[b]
        if qe == qs:
            continue
        nblk = -(-L // bs)
        blocks = meta.block_tables[b, :nblk].long()
        K = kv_cache[0].index_select(0, blocks).reshape(nblk * bs, kvh, d)[:L].double()
        V = kv_cache[1].index_select(0, blocks).reshape(nblk * bs, kvh, d)[:L].double()
        K = K.repeat_interleave(h // kvh, dim=1).transpose(0, 1)  # [H, L, D]
        V = V.repeat_interleave(h // kvh, dim=1).transpose(0, 1)
        qb = q[qs:qe].double().transpose(0, 1)  # [H, lq, D]
        sc = qb @ K.transpose(1, 2) * scale  # [H, lq, L]
        pos = torch.arange(L - (qe - qs), L, device=q.device)
        sc = sc.masked_fill(torch.arange(L, device=q.device)[None, :] > pos[:, None], float("-inf"))
        out[qs:qe] = (torch.softmax(sc, -1) @ V).transpose(0, 1).to(q.dtype)
    return out


__all__ = ["attention_triton_paged", "attention_reference", "launch_plan", "kernel_variants", "step_variants"]
