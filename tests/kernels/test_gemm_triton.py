import pytest
import torch
import torch.nn.functional as F

from detent.kernels.gemm_triton import gemm_reference, gemm_triton_persistent

CFG = dict(block_m=16, block_n=16, block_k=16, num_warps=4, num_stages=2)


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize("m,n,k,bias", [(1, 24, 40, True), (19, 33, 17, False), (40, 16, 64, True)])
def test_matches_reference(m, n, k, bias):
    g = torch.Generator().manual_seed(m * 1000 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = gemm_triton_persistent(x, w, b, **CFG)
    assert not y.isnan().any()  # every element written (outputs are NaN-poisoned)
    assert _rel(y, gemm_reference(x, w, b)) < 1e-6  # fp32, no TF32


def test_strided_input():
    g = torch.Generator().manual_seed(1)
    big = torch.randn(9, 80, generator=g)
    x = big[:, ::2]  # K stride 2
    w = torch.randn(20, 40, generator=g)
    assert _rel(gemm_triton_persistent(x, w, None, **CFG), gemm_reference(x, w, None)) < 1e-6


def test_row_bits_independent_of_m_and_neighbours():
    g = torch.Generator().manual_seed(2)
    w = torch.randn(24, 48, generator=g)
    x = torch.randn(37, 48, generator=g)
    full = gemm_triton_persistent(x, w, None, **CFG)
    for m in (1, 2, 3, 16, 17):
        assert torch.equal(gemm_triton_persistent(x[:m], w, None, **CFG), full[:m])
    # row 0 with different neighbours (same tile position) keeps its bits
    other = torch.cat([x[:1], torch.randn(15, 48, generator=g)])
    assert torch.equal(gemm_triton_persistent(other, w, None, **CFG)[0], full[0])


def test_stock_library_gemm_is_not_row_invariant():
    # the stock candidate (F.linear on the real M) changes a row's bits with M
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(33, 64, generator=g), torch.randn(48, 64, generator=g)
    assert not torch.equal(F.linear(x[:1], w)[0], F.linear(x, w)[0])


def test_errors_name_the_field():
    x, w = torch.randn(2, 8), torch.randn(4, 9)
    with pytest.raises(ValueError, match="K=8"):
        gemm_triton_persistent(x, w, None, **CFG)
    with pytest.raises(TypeError, match="w has dtype"):
        gemm_triton_persistent(x, torch.randn(4, 8).double(), None, **CFG)
    with pytest.raises(ValueError, match="block_n=24"):
        gemm_triton_persistent(x, torch.randn(4, 8), None, block_m=16, block_n=24, block_k=16)
    with pytest.raises(ValueError, match="bias"):
        gemm_triton_persistent(x, torch.randn(4, 8), torch.randn(5), **CFG)


def test_cpu_without_interpreter_is_refused(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        gemm_triton_persistent(torch.randn(2, 8), torch.randn(4, 8), None, **CFG)


@pytest.mark.parametrize("m,n,k,bias", [(1, 24, 40, True), (19, 36, 20, False), (40, 16, 64, True)])
def test_tma_loads_give_the_pointer_kernels_bits(m, n, k, bias):
    # tma=1 only changes how tiles reach the SM; tails past M, N and K read zeros
    g = torch.Generator().manual_seed(m * 7 + n)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    b = torch.randn(n, generator=g) if bias else None
    y = gemm_triton_persistent(x, w, b, **CFG, tma=1)
    assert not y.isnan().any()
    assert torch.equal(y, gemm_triton_persistent(x, w, b, **CFG))


def test_tma_falls_back_to_pointer_loads_when_unaligned():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 80, generator=g)[:, ::2]  # K stride 2: no TMA descriptor
    w = torch.randn(20, 40, generator=g)
    assert torch.equal(gemm_triton_persistent(x, w, None, **CFG, tma=1), gemm_triton_persistent(x, w, None, **CFG))


@pytest.mark.parametrize("split", [16, 32, 48])
@pytest.mark.parametrize("tma", [0, 1])
def test_split_rows_give_each_rows_bits(split, tma):
    # rows [0, split) on the first config, the rest in a second launch into the same output:
    # the same config both sides gives the one-launch bits (a row does not see its neighbours)
    g = torch.Generator().manual_seed(split)
    x, w, b = torch.randn(50, 40, generator=g), torch.randn(36, 40, generator=g), torch.randn(36, generator=g)
    tail = {"tail_" + k: v for k, v in CFG.items()}
    y = gemm_triton_persistent(x, w, b, **CFG, tma=tma, split_m=split, **tail, tail_tma=tma)
    assert not y.isnan().any()
    assert torch.equal(y, gemm_triton_persistent(x, w, b, **CFG, tma=tma))
    other = dict(tail_block_m=32, tail_block_n=16, tail_block_k=32, tail_num_warps=4, tail_num_stages=2)
    z = gemm_triton_persistent(x, w, b, **CFG, split_m=split, **other)
    assert torch.equal(z[:split], y[:split]) and not z.isnan().any()
    assert _rel(z, gemm_reference(x, w, b)) < 1e-6
