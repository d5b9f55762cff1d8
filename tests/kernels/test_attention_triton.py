"""Paged attention (Triton, under the interpreter, fp32).

Numpy's matmul, which the interpreter uses for tl.dot, gives a row different
bits at different row offsets inside a tile (BLAS micro-kernel edges), which
the GPU's MMA does not (tests/gpu checks arbitrary chunking there). So the
invariance cells here keep a token's row offset fixed: one token per tile
(G = BLOCK_M) with arbitrary chunking, or chunk starts on BLOCK_Q multiples.
"""
import pytest
import torch

from detent.kernels import attention_triton
from detent.kernels.attention_triton import attention_reference, attention_triton_paged
from detent.selection.context import AttentionMetadata
from paged_cases import PagedCase

SCALE = 0.3


def _run(case, chunks_upto, order=None, **kw):
    """Cache positions [0, start_b), then run the step for [start_b, end_b)."""
    cache = case.fresh_cache()
    case.prefill_prefix(cache, [s for s, _ in chunks_upto])
    q, k, v, meta = case.step(cache, chunks_upto, order)
    return attention_triton_paged(q, k, v, cache, meta, SCALE, **kw), (q, k, v, meta)


class _LaunchSpy:
    """Records each launch's tile height and mapping flags."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append((kw["BLOCK_M"], kw["SHORT"], kw["SKIP_Q"]))
            return self.kernel[grid](*args, **kw)
        return launch


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("combine", ["sequential", "parallel"])
def test_matches_reference_mixed_batch(combine):
    # prefill from 0, chunked prefill from 20, decode at 44; G = 2, head_dim 64
    case = PagedCase([20, 23, 35], h=4, kvh=2, d=64, block_size=8, seed=1)
    chunks = [(0, 20), (12, 23), (34, 35)]
    y, (q, k, v, meta) = _run(case, chunks, split_tokens=16, block_m=16, block_n=16, combine=combine)
    assert not y.isnan().any()  # outputs and split partials are NaN-poisoned
    ref_cache = case.fresh_cache()
    case.prefill_prefix(ref_cache, [s for s, _ in chunks])
    assert _rel(y, attention_reference(q, k, v, ref_cache, meta, SCALE)) < 1e-5


def test_split_not_a_multiple_of_block_n():
    # FA3-style split sizes round to a page, not to BLOCK_N: the split ends inside a tile
    case = PagedCase([45, 7], h=4, kvh=2, d=16, block_size=8, seed=5)
    chunks = [(0, 45), (6, 7)]
    y, (q, k, v, meta) = _run(case, chunks, split_tokens=24, block_m=16, block_n=16, combine="sequential")
    ref_cache = case.fresh_cache()
    case.prefill_prefix(ref_cache, [s for s, _ in chunks])
    assert _rel(y, attention_reference(q, k, v, ref_cache, meta, SCALE)) < 1e-5


@pytest.mark.parametrize("rowsum", ["mma", "sum"])
def test_parallel_and_sequential_combine_agree_bitwise(rowsum):
    case = PagedCase([36, 9], h=2, kvh=1, d=16, block_size=8, seed=2)
    kw = dict(split_tokens=16, block_m=16, block_n=16, rowsum=rowsum)
    a, _ = _run(case, [(20, 36), (8, 9)], combine="sequential", **kw)
    b, _ = _run(case, [(20, 36), (8, 9)], combine="parallel", **kw)
    assert torch.equal(a, b)


def test_one_token_per_tile_any_chunking_and_neighbours():
    # G = 16 = BLOCK_M: each tile holds one token, so chunking cannot move its row
    case = PagedCase([36, 9], h=16, kvh=1, d=16, block_size=16, seed=3)
    kw = dict(split_tokens=16, block_m=16, block_n=16, combine="sequential")
    full, _ = _run(case, [(0, 36), (0, 9)], **kw)
    alone, _ = _run(case, [(0, 36), (0, 0)], order=[0], **kw)
    assert torch.equal(alone, full[:36])
    for start in (35, 17):  # decode at 35, a chunked prefill of the rest
        y, _ = _run(case, [(start, 36), (0, 9)], order=[1, 0], **kw)
        assert torch.equal(y[9:], full[start:36]), start
    # a different split size (what stock attention does as the batch changes) moves bits
    other, _ = _run(case, [(0, 36), (0, 9)], split_tokens=32, block_m=16, block_n=16)
    assert not torch.equal(other, full)


def test_packed_tiles_chunk_on_block_q():
    # G = 2, BLOCK_Q = 8: rows of a chunked prefill visit masked KV tiles their
    # neighbours need; those must add exact zeros
    case = PagedCase([45], h=4, kvh=2, d=16, block_size=8, seed=4)
    kw = dict(split_tokens=32, block_m=16, block_n=16, combine="sequential")
    full, _ = _run(case, [(0, 45)], **kw)
    for start in (40, 24, 8):
        y, _ = _run(case, [(start, 45)], **kw)
        assert torch.equal(y, full[start:]), start


@pytest.mark.parametrize("combine", ["sequential", "parallel"])
def test_exp2_softmax_matches_the_reference_and_unmasked_tiles_move_no_bit(combine):
    # softmax="exp2" (FlashAttention's form, unscaled maxima, an explicit fma) with and without
    # split_mask: the same bits, and the float64 reference's values. Chunks from 0 and after a
    # prefix, a decode, a split end inside a tile, packed tiles (G = 2)
    case = PagedCase([77, 40, 12], h=4, kvh=2, d=16, block_size=8, seed=8)
    chunks = [(0, 77), (39, 40), (5, 12)]
    kw = dict(split_tokens=24, block_m=16, block_n=16, combine=combine, softmax="exp2")
    y, (q, k, v, meta) = _run(case, chunks, **kw)
    assert not y.isnan().any()
    ref_cache = case.fresh_cache()
    case.prefill_prefix(ref_cache, [s for s, _ in chunks])
    assert _rel(y, attention_reference(q, k, v, ref_cache, meta, SCALE)) < 1e-5
    z, _ = _run(case, chunks, split_mask=True, **kw)
    assert torch.equal(z, y)


def test_exp2_rows_keep_their_bits_under_any_chunking():
    # the invariance cell of test_one_token_per_tile_any_chunking_and_neighbours under softmax="exp2"
    # with unmasked tiles: which tiles skip the mask depends on where a row's tile starts, so this
    # fails if skipping it changed a row's arithmetic
    case = PagedCase([36, 9], h=16, kvh=1, d=16, block_size=16, seed=3)
    kw = dict(split_tokens=16, block_m=16, block_n=16, combine="sequential", softmax="exp2", split_mask=True)
    full, _ = _run(case, [(0, 36), (0, 9)], **kw)
    for start in (35, 17, 5):
        y, _ = _run(case, [(start, 36), (0, 9)], order=[1, 0], **kw)
        assert torch.equal(y[9:], full[start:36]), start
    masked, _ = _run(case, [(0, 36), (0, 9)], **{**kw, "split_mask": False})
    assert torch.equal(masked, full)
    # a different split size (what stock attention does as the batch changes) moves bits
    other, _ = _run(case, [(0, 36), (0, 9)], **{**kw, "split_tokens": 32})
    assert not torch.equal(other, full)


def test_errors():
    case = PagedCase([8], h=4, kvh=2, d=16, block_size=8)
    cache = case.fresh_cache()
    q, k, v, meta = case.step(cache, [(0, 8)])
    with pytest.raises(ValueError, match="split_tokens=0"):
        attention_triton_paged(q, k, v, cache, meta, SCALE, split_tokens=0, block_n=16)
    with pytest.raises(ValueError, match="block_m=24"):
        attention_triton_paged(q, k, v, cache, meta, SCALE, split_tokens=16, block_m=24, block_n=16)
    with pytest.raises(ValueError, match="kv_cache"):
        attention_triton_paged(q, k, v, cache[:, :, :, :1], meta, SCALE)
    with pytest.raises(ValueError, match="combine"):
        attention_triton_paged(q, k, v, cache, meta, SCALE, split_tokens=16, block_n=16, combine="x")
    with pytest.raises(ValueError, match="softmax='x'"):
        attention_triton_paged(q, k, v, cache, meta, SCALE, split_tokens=16, block_n=16, softmax="x")
    with pytest.raises(ValueError, match="split_mask needs softmax='exp2'"):
        attention_triton_paged(q, k, v, cache, meta, SCALE, split_tokens=16, block_n=16, split_mask=True)


@pytest.mark.parametrize("combine", ["sequential", "parallel"])
def test_short_queries_of_a_mixed_step_get_their_own_launch(combine, monkeypatch):
    # a long chunk makes the step's tile 64 rows; the decode and the 3-token chunk fit a
    # 16-row tile (G = 2: 8 queries) and run in the short launch. Each row must equal the
    # same row computed with its own tile height alone: the long rows a 64-row launch of
    # the long sequence, the short rows a 16-row launch of the same step
    case = PagedCase([45, 30, 12], h=4, kvh=2, d=16, block_size=8, seed=6)
    chunks = [(0, 45), (29, 30), (9, 12)]
    kw = dict(split_tokens=16, block_n=16, combine=combine)
    spy = _LaunchSpy(attention_triton._paged_attn_kernel)
    monkeypatch.setattr(attention_triton, "_paged_attn_kernel", spy)
    y, (q, k, v, meta) = _run(case, chunks, block_m=64, **kw)
    # (BLOCK_M, SHORT, SKIP_Q): the long launch skips sequences of <= 8 queries, the short takes them
    assert spy.launches == [(64, False, 8), (16, True, 0)]
    assert not y.isnan().any()  # every row written exactly by one of the two launches
    ref_cache = case.fresh_cache()
    case.prefill_prefix(ref_cache, [s for s, _ in chunks])
    assert _rel(y, attention_reference(q, k, v, ref_cache, meta, SCALE)) < 1e-5
    alone, _ = _run(case, [(0, 45), (29, 29), (12, 12)], order=[0], block_m=64, **kw)
    assert torch.equal(y[:45], alone)
    short16, _ = _run(case, chunks, block_m=16, **kw)
    assert torch.equal(y[45:], short16[45:])


@pytest.mark.parametrize("block_m,combine", [(16, "sequential"), (16, "parallel"), (64, "auto"),
                                             (64, "parallel")])
def test_a_padded_launch_keeps_every_real_row(block_m, combine):
    # what a CUDA graph of a mixed step would bake in (docs/performance.md, "whole-step graphs"):
    # more tokens than the step has (rows past the last sequence, slots -1: not stored), empty
    # sequences after the real ones, the longest KV of the deployment, no host query lengths
    # (the short launch always runs). The real rows must keep their bits, and the cache too
    case = PagedCase([45, 30, 12], h=4, kvh=2, d=16, block_size=8, seed=7)
    chunks = [(0, 45), (29, 30), (9, 12)]
    kw = dict(split_tokens=16, block_m=block_m, block_n=16, combine=combine)
    y, (q, k, v, meta) = _run(case, chunks, **kw)
    cache = case.fresh_cache()
    case.prefill_prefix(cache, [s for s, _ in chunks])
    t, n, extra_t, extra_s = meta.num_tokens, meta.num_seqs, 11, 3
    g = torch.Generator().manual_seed(0)
    pad = lambda x: torch.cat([x, torch.randn((extra_t,) + x.shape[1:], generator=g)])  # noqa: E731
    qsl = torch.cat([meta.query_start_loc, torch.full((extra_s,), t, dtype=torch.int32)])
    padded = AttentionMetadata(
        query_start_loc=qsl, seq_lens=torch.cat([meta.seq_lens, torch.ones(extra_s, dtype=torch.int32)]),
        block_tables=torch.cat([meta.block_tables, torch.zeros((extra_s, meta.block_tables.shape[1]),
                                                               dtype=torch.int32)]),
        slot_mapping=torch.cat([meta.slot_mapping, torch.full((extra_t,), -1, dtype=torch.long)]),
        num_seqs=n + extra_s, num_tokens=t + extra_t, max_seqlen_q=meta.max_seqlen_q, max_seqlen_k=96,
        block_size=meta.block_size)
    yp = attention_triton_paged(pad(q), pad(k), pad(v), cache, padded, SCALE, **kw)
    assert torch.equal(yp[:t], y)
    ref = case.fresh_cache()
    case.prefill_prefix(ref, [s for s, _ in chunks])
    attention_triton_paged(q, k, v, ref, meta, SCALE, **kw)
    assert torch.equal(cache.nan_to_num(7.0), ref.nan_to_num(7.0))  # padded tokens wrote nothing


def test_the_short_launch_splits_up_to_512_programs_and_walks_past_them():
    # host-side plan only (the interpreter ignores warps and stages): a mixed step's short
    # launch is one program per (sequence, KV head) and split up to 512 of them (the whole-step
    # graphs' 64 padded sequences at 8 KV heads), with the decode launch's 2 warps and 4 stages
    # from 128; past 512 it walks the splits in one program, without a prefetch stage for a
    # loop per split and with 3 for one loop over the splits; each form is its own compile
    plan = lambda n, loop="nested", comb="auto", kv=2048: attention_triton.launch_plan(  # noqa: E731
        1024 + n - 1, n, 1024, kv, (1024,) + (1,) * (n - 1), 8, 4, 132, block_m=128, split_tokens=256,
        tile_loop=loop, short_combine=comb)
    form = lambda p: (p.short_warps, p.short_stages, p.short_parallel)  # noqa: E731
    assert form(plan(15)) == (4, 2, True) and form(plan(16)) == (2, 4, True) and form(plan(64)) == (2, 4, True)
    assert form(plan(65)) == (2, 1, False) and form(plan(65, "auto")) == (2, 3, False)
    assert form(plan(64, comb="sequential")) == (2, 1, False) and form(plan(63, comb="sequential")) == (4, 2, False)
    assert form(plan(65, comb="parallel")) == (2, 4, True)
    assert not plan(16, kv=256).short_parallel  # one split: nothing to combine
    # the partials stay within 2^17 rows: 64 sequences x 4 rows x 32 heads x 16 splits (4,096 tokens)
    assert plan(64, kv=4096).short_parallel and not plan(64, kv=4097).short_parallel
    assert plan(32, kv=8192).short_parallel and form(plan(64, kv=8192)) == (2, 1, False)
    short = lambda p: {v for v in attention_triton.kernel_variants(p, block_m=128, num_warps=8)  # noqa: E731
                       if v[0] == "combine_short" or v[4]}
    assert short(plan(16)) == {("paged", 16, True, False, True, 0, 2, 4), ("combine_short", 4)}
    assert short(plan(65)) == {("paged", 16, False, False, True, 0, 2, 1)}
    assert short(plan(65, "prefetch")) == {("paged", 16, False, False, True, 0, 2, 3)}
    with pytest.raises(ValueError, match="short_combine"):
        plan(16, comb="split")


class _CombineSpy:
    """Records the combine launches' grid and SHORT_Q."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kw):
            self.launches.append((grid, kw.get("SHORT_Q", 0)))
            return self.kernel[grid](*args, **kw)
        return launch


@pytest.mark.parametrize("loop", ["nested", "auto"])
def test_the_short_launch_split_into_programs_gives_the_walks_bits(loop, monkeypatch):
    # the short launch's splits walked in one program per (sequence, KV head), or one program
    # per split whose partials sit in slots of BLOCK_Q rows per sequence and a combine over the
    # slots: every row written once (outputs and partials are NaN-poisoned), the same bits, and
    # the same as the whole step in one launch. A chunk of 8 queries fills its slot (and crosses
    # a split's end: its first rows need one split less than its last), one of 3 and a decode
    # leave slots empty, and the 45-token chunk is the long launch's
    case = PagedCase([45, 30, 12, 34], h=4, kvh=2, d=16, block_size=8, seed=31)
    chunks = [(0, 45), (29, 30), (9, 12), (26, 34)]
    kw = dict(split_tokens=16, block_m=64, block_n=16, tile_loop=loop)
    spy = _CombineSpy(attention_triton._combine_kernel)
    monkeypatch.setattr(attention_triton, "_combine_kernel", spy)
    split, (q, k, v, meta) = _run(case, chunks, short_combine="parallel", **kw)
    assert spy.launches == [((4 * 8, 4), 8)]  # 4 sequences x 8 slots, 4 heads
    walked, _ = _run(case, chunks, short_combine="sequential", **kw)
    one, _ = _run(case, chunks, short_launch=False, **kw)
    assert not split.isnan().any() and torch.equal(split, walked) and torch.equal(split[45:], one[45:])
    ref_cache = case.fresh_cache()
    case.prefill_prefix(ref_cache, [s for s, _ in chunks])
    assert _rel(split, attention_reference(q, k, v, ref_cache, meta, SCALE)) < 1e-5
    other, _ = _run(case, chunks, short_combine="parallel", **{**kw, "split_tokens": 8})
    assert not torch.equal(other[45:], walked[45:])  # the comparator can fail: another split size


@pytest.mark.parametrize("combine,softmax", [("sequential", "exp"), ("sequential", "exp2"), ("parallel", "exp")])
def test_launch_order_and_tile_loop_give_the_same_bits(combine, softmax):
    # the long launch's programs take their q tiles last to first, and one loop walks a
    # program's KV tiles across its splits (reading the block table a tile ahead with
    # "prefetch"), and the row sums may be folded a tile late: the same rows, same bits as
    # ascending q tiles and a loop per split; a split size that is not a multiple of block_n
    # walks the nested loops
    case = PagedCase([70, 23, 9], h=4, kvh=2, d=16, block_size=8, seed=29)
    chunks = [(0, 70), (8, 23), (8, 9)]
    # a 32-row tile (G = 2) leaves the 1-query sequence to the short launch, which "auto" runs flat
    kw = dict(split_tokens=32, block_m=32, block_n=16, combine=combine, softmax=softmax)
    flat, (q, k, v, meta) = _run(case, chunks, tile_loop="flat", **kw)
    nested, _ = _run(case, chunks, tile_order="ascending", tile_loop="nested", **kw)
    auto, _ = _run(case, chunks, **kw)  # flat for the short launch, nested for the long one
    ahead, _ = _run(case, chunks, tile_loop="prefetch", **kw)  # the block table read a tile ahead
    assert not flat.isnan().any() and torch.equal(flat, nested) and torch.equal(auto, nested)
    assert torch.equal(ahead, nested)
    # each tile's row sum folded at the next tile or the split's end (defer_rowsum): the same fma
    # on the same values, in every loop form
    for loop in ("nested", "auto", "prefetch"):
        deferred, _ = _run(case, chunks, tile_loop=loop, defer_rowsum=True, **kw)
        assert torch.equal(deferred, nested), loop
    ref_cache = case.fresh_cache()
    case.prefill_prefix(ref_cache, [s for s, _ in chunks])
    assert _rel(flat, attention_reference(q, k, v, ref_cache, meta, SCALE)) < 1e-5
    odd, _ = _run(case, chunks, **{**kw, "split_tokens": 24})  # 24 % 16: the nested loops
    assert _rel(odd, attention_reference(q, k, v, ref_cache, meta, SCALE)) < 1e-5
    for bad in (dict(tile_order="random"), dict(tile_loop="unrolled")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            _run(case, chunks, **kw, **bad)
