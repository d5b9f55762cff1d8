import pytest
import torch

from detent.kernels.moe_triton import align, moe_reference, moe_triton_fused
from detent.selection.programs import moe as moe_program
from detent.selection.programs import moe_tiles

TILES = moe_tiles()


def _case(m, e=6, h=32, i=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g)
    logits = torch.randn(m, e, generator=g)
    w13 = torch.randn(e, 2 * i, h, generator=g) * 0.2
    w2 = torch.randn(e, h, i, generator=g) * 0.2
    return x, logits, w13, w2


def test_align_groups_rows_by_expert():
    topi = torch.tensor([[2, 0], [2, 1], [0, 2]])
    rows, blk_expert = align(topi, num_experts=4, block_m=2)
    r = topi.numel()
    # expert 0: rows 1, 4; expert 1: row 3 (+pad); expert 2: rows 0, 2, 5 (+pad)
    assert rows.tolist()[:8] == [1, 4, 3, r, 0, 2, 5, r]
    assert blk_expert.tolist()[:4] == [0, 1, 2, 2]
    assert all(b == -1 for b in blk_expert.tolist()[4:])


@pytest.mark.parametrize("row_key", [16, 1024])
@pytest.mark.parametrize("renormalize", [True, False])
def test_matches_reference(row_key, renormalize):
    x, logits, w13, w2 = _case(9, seed=row_key)
    y = moe_triton_fused(x, logits, w13, w2, 2, renormalize, **TILES[row_key])
    ref = moe_reference(x, logits, w13, w2, 2, renormalize)
    assert not y.isnan().any()
    assert ((y - ref).norm() / ref.norm()).item() < 1e-5


def test_stock_row_key_follows_token_count():
    keys = [moe_program.nearest_row(n, moe_program.GPU_KEYS) for n in (1, 16, 17, 500, 700, 100000)]
    assert keys == [16, 16, 16, 128, 1024, max(TILES)]
    assert moe_program.GPU_KEYS == tuple(TILES)


def test_explicit_tile_overrides_the_row():
    # a tile outside the tuned table (odd group_m: launch order only)
    x, logits, w13, w2 = _case(21, seed=4)
    y = moe_triton_fused(x, logits, w13, w2, 2, True, block_m=32, block_n=16, block_k=16,
                         group_m=3, num_warps=4, num_stages=2)
    ref = moe_reference(x, logits, w13, w2, 2, True)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-5


def test_errors():
    x, logits, w13, w2 = _case(3)
    with pytest.raises(ValueError, match="missing"):
        moe_triton_fused(x, logits, w13, w2, 2, True)
    with pytest.raises(ValueError, match="missing"):
        moe_triton_fused(x, logits, w13, w2, 2, True, block_m=16)
    with pytest.raises(ValueError, match="router_logits"):
        moe_triton_fused(x, logits[:, :5], w13, w2, 2, True)


@pytest.mark.parametrize("m,k,e,block_m,skew", [(1, 8, 128, 16, False), (3, 2, 6, 16, False), (64, 8, 128, 16, True),
                                                 (9, 2, 4, 32, True), (100, 8, 128, 64, False),
                                                 (700, 8, 128, 64, False), (1100, 8, 128, 128, True),
                                                 (2048, 8, 128, 64, False), (4000, 2, 6, 16, True)])
def test_align_kernel_gives_align_s_integers(m, k, e, block_m, skew):
    # one launch instead of ~25 torch ops; the grouped GEMMs must see exactly the same rows.
    # m * k up to 800 rows: several 64-row programs that count every row; 5,600 to 16,384 rows: 512-row
    # programs after a launch that counts each one's rows (32 at 16,384: two 16-program pieces of the counts);
    # skew: most rows on two experts, many experts empty
    from detent.kernels.moe_triton import align_fused
    g = torch.Generator().manual_seed(m * 31 + e)
    topi = (torch.randint(0, 2, (m, k), generator=g) * (e - 1) if skew
            else torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(m)]))
    want, got = align(topi, e, block_m), align_fused(topi, e, block_m)
    assert torch.equal(got[0], want[0].to(torch.int32)) and torch.equal(got[1], want[1].to(torch.int32))


@pytest.mark.parametrize("k", [1, 2, 8])
def test_combine_kernel_rounds_like_the_torch_expression(k):
    from detent.kernels.moe_triton import combine, combine_fused
    g = torch.Generator().manual_seed(k)
    y, w = torch.randn(5, k, 40, generator=g), torch.rand(5, k, generator=g)
    assert torch.equal(combine_fused(y, w), combine(y, w))


@pytest.mark.parametrize("m", [1, 7, 70])
def test_fuse_glue_gives_the_same_bits(m):
    x, logits, w13, w2 = _case(m, e=6, seed=m)
    plain = moe_triton_fused(x, logits, w13, w2, 2, True, **TILES[16])
    assert torch.equal(moe_triton_fused(x, logits, w13, w2, 2, True, **TILES[16], fuse_glue=1), plain)


@pytest.mark.parametrize("e,k,renormalize", [(6, 2, True), (128, 8, True), (60, 4, False)])
def test_route_kernel_matches_route_and_keeps_rows_apart(e, k, renormalize):
    # fuse_glue=2's routing: its own softmax (other low bits than torch's), the same experts
    from detent.kernels.moe_triton import route, route_fused
    g = torch.Generator().manual_seed(e + k)
    logits = torch.randn(33, e, generator=g)
    w, i = route_fused(logits, k, renormalize, torch.float32)
    w_ref, i_ref = route(logits.double(), k, renormalize, torch.float64)
    assert torch.equal(i, i_ref)  # no near-ties in these logits
    assert torch.allclose(w.double(), w_ref, rtol=1e-5, atol=0)
    for m in (1, 5, 32):  # a row's weights do not depend on the other rows
        wm, im = route_fused(logits[:m], k, renormalize, torch.float32)
        assert torch.equal(wm, w[:m]) and torch.equal(im, i[:m])
    tied = torch.zeros(1, e)  # all equal: the lowest expert ids, in order
    assert route_fused(tied, k, renormalize, torch.float32)[1].tolist() == [list(range(k))]


def test_fuse_glue_2_routes_the_same_experts(monkeypatch):
    x, logits, w13, w2 = _case(40, e=6, seed=5)
    plain = moe_triton_fused(x, logits, w13, w2, 2, True, **TILES[16])
    y = moe_triton_fused(x, logits, w13, w2, 2, True, **TILES[16], fuse_glue=2)
    assert ((y.double() - plain.double()).norm() / plain.double().norm()).item() < 1e-5
    assert torch.equal(moe_triton_fused(x[:7], logits[:7], w13, w2, 2, True, **TILES[16], fuse_glue=2), y[:7])


@pytest.mark.parametrize("m,fuse_glue", [(1, 0), (3, 0), (50, 0), (1, 1), (3, 1)])
def test_fewer_row_blocks_give_the_same_bits(m, fuse_glue, monkeypatch):
    # the grid's row blocks are bounded by min(rows, (rows + E (block_m - 1)) / block_m); the old,
    # looser bound only added empty blocks, so the result must not move
    from detent.kernels import moe_triton
    x, logits, w13, w2 = _case(m, e=6, seed=11 + m)
    tight = moe_triton_fused(x, logits, w13, w2, 2, True, **TILES[16], fuse_glue=fuse_glue)
    assert moe_triton.max_row_blocks(2 * m, 6, 16) == min(2 * m, (2 * m + 90) // 16)
    monkeypatch.setattr(moe_triton, "max_row_blocks", lambda r, e, bm: (r + e * (bm - 1)) // bm)
    assert torch.equal(moe_triton_fused(x, logits, w13, w2, 2, True, **TILES[16], fuse_glue=fuse_glue), tight)


def test_row_block_bound_holds_for_every_routing():
    # no routing of r rows over E experts needs more blocks than max_row_blocks(r, E, block_m)
    from detent.kernels.moe_triton import max_row_blocks
    g = torch.Generator().manual_seed(0)
    for r, e, bm in [(8, 128, 16), (16, 4, 16), (512, 128, 16), (40, 6, 32), (1, 3, 64)]:
        for skew in (1, 2, e):
            flat = torch.randint(0, skew, (r,), generator=g)
            counts = torch.bincount(flat, minlength=e)
            assert int(((counts + bm - 1) // bm).sum()) <= max_row_blocks(r, e, bm)
