import pytest
import torch
import torch.nn.functional as F

from detent.kernels.moe import moe_torch_loop
from detent.kernels.moe_triton import moe_reference, moe_triton_fused
from detent.selection.programs import moe_tiles

MOE_TILES = moe_tiles()

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _weights(e=16, h=512, i=256):
    w13 = torch.randn(e, 2 * i, h, device="cuda", dtype=BF16) * 0.05
    w2 = torch.randn(e, h, i, device="cuda", dtype=BF16) * 0.05
    return w13, w2


def test_matches_reference():
    w13, w2 = _weights()
    x = torch.randn(37, 512, device="cuda", dtype=BF16)
    logits = torch.randn(37, 16, device="cuda", dtype=BF16)
    for key in MOE_TILES:
        y = moe_triton_fused(x, logits, w13, w2, 4, True, **MOE_TILES[key])
        ref = moe_reference(x, logits, w13, w2, 4, True)
        assert not y.isnan().any()
        assert ((y.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-2, key


@pytest.mark.parametrize("row_key", sorted(MOE_TILES))
def test_row_bits_invariant_across_m_and_neighbours(row_key):
    w13, w2 = _weights()
    x = torch.randn(256, 512, device="cuda", dtype=BF16)
    logits = torch.randn(256, 16, device="cuda", dtype=BF16)
    full = moe_triton_fused(x, logits, w13, w2, 4, True, **MOE_TILES[row_key])
    for m in (1, 2, 5, 17, 64, 129, 255):
        assert torch.equal(moe_triton_fused(x[:m], logits[:m], w13, w2, 4, True, **MOE_TILES[row_key]), full[:m]), m
    x2, l2 = torch.randn_like(x), torch.randn_like(logits)
    x2[100], l2[100] = x[0], logits[0]
    assert torch.equal(moe_triton_fused(x2, l2, w13, w2, 4, True, **MOE_TILES[row_key])[100], full[0])


def test_stock_torch_loop_is_not_row_invariant():
    # the library GEMM on the real per-expert row count changes a row's bits
    w13, w2 = _weights(e=2, h=4096, i=1024)
    x = torch.randn(256, 4096, device="cuda", dtype=BF16)
    logits = torch.randn(256, 2, device="cuda", dtype=BF16)
    full = moe_torch_loop(x, logits, w13, w2, 1, True)
    assert any(not torch.equal(moe_torch_loop(x[:m], logits[:m], w13, w2, 1, True), full[:m])
               for m in (1, 2, 7, 64))


def test_every_row_key_gives_identical_bits():
    """Why the pinned program may pick the MoE row by token count (selection/programs/moe.py):
    the tile configs change the launch, not a row's arithmetic."""
    w13, w2 = _weights()
    for m in (1, 7, 64, 300):
        x = torch.randn(m, 512, device="cuda", dtype=BF16)
        logits = torch.randn(m, 16, device="cuda", dtype=BF16)
        outs = [moe_triton_fused(x, logits, w13, w2, 4, True, **MOE_TILES[key]) for key in MOE_TILES]
        assert all(torch.equal(o, outs[0]) for o in outs[1:]), m


@pytest.mark.parametrize("m", [1, 8, 64, 130])
def test_fuse_glue_gives_identical_bits(m):
    """fuse_glue=1 (one launch for the alignment, one for the slot combine)
    computes the same integers and rounds the same way: the bits must not
    move, at Qwen3-30B-A3B's expert count and top-k, inside a CUDA graph too."""
    from detent.kernels.moe_triton import align, align_fused
    w13, w2 = _weights(e=128, h=512, i=128)
    x = torch.randn(m, 512, device="cuda", dtype=BF16)
    logits = torch.randn(m, 128, device="cuda", dtype=BF16)
    want = moe_triton_fused(x, logits, w13, w2, 8, True, **MOE_TILES[16])
    assert torch.equal(moe_triton_fused(x, logits, w13, w2, 8, True, **MOE_TILES[16], fuse_glue=1), want)
    topi = torch.topk(logits.float(), 8, dim=-1).indices
    assert all(torch.equal(a.int(), b) for a, b in zip(align(topi, 128, 16), align_fused(topi, 128, 16)))
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = moe_triton_fused(x, logits, w13, w2, 8, True, **MOE_TILES[16], fuse_glue=1)
    g.replay()
    assert torch.equal(out, want)


@pytest.mark.parametrize("m,k,e,block_m", [(1, 8, 128, 16), (64, 8, 128, 16), (128, 8, 128, 64), (13, 2, 6, 32),
                                            (2048, 8, 128, 64), (8192, 8, 128, 128)])
@pytest.mark.parametrize("skew", [False, True])
def test_align_kernel_gives_align_s_integers(m, k, e, block_m, skew):
    """The alignment's programs (one per 64 rows, or 512 for prefill chunks;
    none waiting on another) write the same rows and row-block experts as the
    torch ops; skew: most rows on two experts, the others empty."""
    from detent.kernels.moe_triton import align, align_fused
    g = torch.Generator(device="cuda").manual_seed(m * 7 + k)
    topi = (torch.randint(0, 2, (m, k), device="cuda", generator=g) * (e - 1) if skew
            else torch.rand(m, e, device="cuda", generator=g).topk(k, dim=-1).indices)
    assert all(torch.equal(a.int(), b) for a, b in zip(align(topi, e, block_m), align_fused(topi, e, block_m)))


def test_fuse_glue_2_rows_are_invariant_and_close():
    """fuse_glue=2 also routes in one launch (its own softmax: other low bits):
    rows keep their bits across batch sizes and neighbours, and stay close to
    the torch routing's result."""
    w13, w2 = _weights(e=128, h=512, i=128)
    x = torch.randn(130, 512, device="cuda", dtype=BF16)
    logits = torch.randn(130, 128, device="cuda", dtype=BF16)
    full = moe_triton_fused(x, logits, w13, w2, 8, True, **MOE_TILES[16], fuse_glue=2)
    for m in (1, 8, 64):
        assert torch.equal(moe_triton_fused(x[:m], logits[:m], w13, w2, 8, True, **MOE_TILES[16], fuse_glue=2), full[:m])
    ref = moe_triton_fused(x, logits, w13, w2, 8, True, **MOE_TILES[16])
    assert ((full.double() - ref.double()).norm() / ref.double().norm()).item() < 1e-2


@pytest.mark.parametrize("m", [1, 8, 64])
def test_fewer_row_blocks_give_the_same_bits(m, monkeypatch):
    from detent.kernels import moe_triton
    w13, w2 = _weights(e=128, h=512, i=128)
    x = torch.randn(m, 512, device="cuda", dtype=BF16)
    logits = torch.randn(m, 128, device="cuda", dtype=BF16)
    tight = moe_triton_fused(x, logits, w13, w2, 8, True, **MOE_TILES[16])
    monkeypatch.setattr(moe_triton, "max_row_blocks", lambda r, e, bm: (r + e * (bm - 1)) // bm)
    assert torch.equal(moe_triton_fused(x, logits, w13, w2, 8, True, **MOE_TILES[16]), tight)
