import pytest
import torch

from detent.kernels.moe_triton import MOE_CONFIGS, align, moe_reference, moe_triton_fused, nearest_row_key


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
    y = moe_triton_fused(x, logits, w13, w2, 2, renormalize, row_key=row_key)
    ref = moe_reference(x, logits, w13, w2, 2, renormalize)
    assert not y.isnan().any()
    assert ((y - ref).norm() / ref.norm()).item() < 1e-5


def test_stock_row_key_follows_token_count():
    keys = [nearest_row_key(n) for n in (1, 16, 17, 500, 700, 100000)]
    assert keys == [16, 16, 16, 128, 1024, max(MOE_CONFIGS)]


def test_explicit_tile_overrides_the_row():
    # a SelIR program with its own table passes row_key and the tile (odd group_m: launch order only)
    x, logits, w13, w2 = _case(21, seed=4)
    y = moe_triton_fused(x, logits, w13, w2, 2, True, row_key=48, block_m=32, block_n=16, block_k=16,
                         group_m=3, num_warps=4, num_stages=2)
    ref = moe_reference(x, logits, w13, w2, 2, True)
    assert ((y - ref).norm() / ref.norm()).item() < 1e-5


def test_errors():
    x, logits, w13, w2 = _case(3)
    with pytest.raises(ValueError, match="row_key=9 is not a row"):
        moe_triton_fused(x, logits, w13, w2, 2, True, row_key=9)
    with pytest.raises(ValueError, match="missing"):
        moe_triton_fused(x, logits, w13, w2, 2, True, block_m=16)
    with pytest.raises(ValueError, match="router_logits"):
        moe_triton_fused(x, logits[:, :5], w13, w2, 2, True)
