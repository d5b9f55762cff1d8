"""DeepGEMM's bf16 GEMM candidate on the H200 (needs `detent[deepgemm]` there and nvcc >= 12.9).

Not yet run: written in a session without a GPU (docs/performance.md,
"DeepGEMM (issue 19 item 3)"). The first run compiles one kernel per
configuration through NVCC, so expect tens of seconds before the first result.
"""
import pytest
import torch

from detent.kernels import registry

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16
SMS = 132  # the H200's SM count (even, as DeepGEMM requires)
MS = (1, 2, 7, 64, 100, 255, 256, 257, 1000, 2048)


@pytest.fixture(scope="module")
def dg():
    if "deepgemm" not in registry.candidates("gemm"):
        pytest.skip(f"deepgemm is not registered: {registry.why_unavailable('gemm', 'deepgemm')}")
    return registry.get("gemm", "deepgemm").fn


def _inputs(m=2048, n=4096, k=4096):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=BF16, generator=g)
    w = torch.randn(n, k, device="cuda", dtype=BF16, generator=g) * 0.02
    return x, w


@pytest.mark.parametrize("chunk", [0, 512])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_float64(dg, chunk, bias):
    x, w = _inputs(m=300, n=1024, k=2048)
    b = torch.randn(1024, device="cuda", dtype=BF16) if bias else None
    want = x.double() @ w.double().T + (b.double() if bias else 0)
    y = dg(x, w, b, chunk=chunk, num_sms=SMS)
    assert ((y.double() - want).norm() / want.norm()).item() < 8e-3  # bf16 output rounding


def test_pinned_rows_do_not_depend_on_m_or_neighbours(dg):
    x, w = _inputs()
    full = dg(x, w, None, chunk=512, num_sms=SMS)
    for m in MS:
        assert torch.equal(dg(x[:m], w, None, chunk=512, num_sms=SMS), full[:m]), m
    y = torch.randn_like(x)
    y[300] = x[5]
    assert torch.equal(dg(y, w, None, chunk=512, num_sms=SMS)[300], full[5])


def test_unpinned_rows_depend_on_m(dg):
    # the control: DeepGEMM choosing its configuration from the real M. If this
    # fails, its configuration did not change these rows' bits over MS, and the
    # chunk pin costs padding for nothing here: record that in docs/performance.md
    x, w = _inputs()
    full = dg(x, w, None, chunk=0, num_sms=SMS)
    differs = [m for m in MS if not torch.equal(dg(x[:m], w, None, chunk=0, num_sms=SMS), full[:m])]
    assert differs, f"unpinned DeepGEMM gave the same row bits for every M in {MS}"
