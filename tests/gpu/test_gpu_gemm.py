import pytest
import torch
import torch.nn.functional as F

from detent.kernels.gemm_triton import gemm_reference, gemm_triton_persistent

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
CFG = dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)
MS = (1, 2, 3, 7, 16, 31, 64, 100, 128, 200, 255, 256)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("m,n,k", [(1, 512, 1024), (77, 4096, 4096), (300, 1000, 520)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(m, n, k, bias):
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
    b = torch.randn(n, device="cuda", dtype=BF16) if bias else None
    y = gemm_triton_persistent(x, w, b, **CFG)
    assert not y.isnan().any()
    assert _rel(y, gemm_reference(x, w, b)) < 8e-3  # bf16 output rounding


def test_fp32_is_not_tf32():
    x = torch.randn(64, 1024, device="cuda")
    w = torch.randn(256, 1024, device="cuda")
    assert _rel(gemm_triton_persistent(x, w, None, **CFG), gemm_reference(x, w, None)) < 1e-5


@pytest.mark.parametrize("cfg", [CFG, dict(block_m=16, block_n=64, block_k=256, num_warps=4, num_stages=4)])
def test_row_bits_invariant_across_m_and_neighbours(cfg):
    x = torch.randn(256, 4096, device="cuda", dtype=BF16)
    w = torch.randn(4096, 4096, device="cuda", dtype=BF16) * 0.02
    full = gemm_triton_persistent(x, w, None, **cfg)
    for m in MS:
        assert torch.equal(gemm_triton_persistent(x[:m], w, None, **cfg), full[:m]), m
    y = torch.randn_like(x)
    y[17] = x[0]
    assert torch.equal(gemm_triton_persistent(y, w, None, **cfg)[17], full[0])


def test_tile_configs_give_identical_bits():
    # measured on the H200: the config (and MMA shape: mma.sync at block_m 16,
    # wgmma at 64+) does not change a row's bits; selection may rely on this
    # only while this test holds on the device
    from detent.selection.programs import gemm_tile_configs
    configs = gemm_tile_configs()
    for n, k in ((6144, 4096), (4096, 14336)):
        w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
        for m in (1, 24, 64, 300):
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            outs = [gemm_triton_persistent(x, w, None, **cfg) for cfg in configs]
            assert all(torch.equal(o, outs[0]) for o in outs[1:]), (n, k, m)


@pytest.mark.parametrize("m", [1, 64, 300, 2048])
@pytest.mark.parametrize("bias", [False, True])
def test_tma_loads_give_identical_bits(m, bias):
    # tma=1 moves the same tiles with TMA; the dot per K step is the same
    from detent.selection.programs import gemm_tile_configs
    configs = gemm_tile_configs()
    w = torch.randn(6144, 4096, device="cuda", dtype=BF16) * 0.02
    b = torch.randn(6144, device="cuda", dtype=BF16) if bias else None
    x = torch.randn(m, 4096, device="cuda", dtype=BF16)
    ref = gemm_triton_persistent(x, w, b, **configs[0])
    for cfg in configs:
        if cfg["block_m"] >= 64:
            assert torch.equal(gemm_triton_persistent(x, w, b, **{**cfg, "tma": 1}), ref), (m, cfg)


def test_stock_cublas_is_not_row_invariant():
    x = torch.randn(256, 4096, device="cuda", dtype=BF16)
    w = torch.randn(4096, 4096, device="cuda", dtype=BF16) * 0.02
    full = F.linear(x, w)
    assert any(not torch.equal(F.linear(x[:m], w), full[:m]) for m in MS)


@pytest.mark.parametrize("n,k", [(4096, 4096), (4096, 14336), (6144, 4096)])
def test_the_wave_cut_gives_the_one_launch_bits(n, k):
    # selection/programs/gemm.py runs the rows past the last whole round of wide tiles in a
    # second launch on the table's small-M tiles; each row's bits must not move
    from detent.selection.programs import GEMM_TILE, gemm_triton_params
    w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
    cuts = 0
    for m in (1090, 1152, 1280, 1536, 2200, 2304):
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        cut = gemm_triton_params(m, n)
        one = {key: cut[key] for key in GEMM_TILE}  # the first launch's tile for every row
        assert torch.equal(gemm_triton_persistent(x, w, None, **cut), gemm_triton_persistent(x, w, None, **one)), m
        cuts += "split_m" in cut
    assert cuts >= 2
