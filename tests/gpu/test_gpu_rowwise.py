import pytest
import torch

from detent.kernels import rowwise_triton as R

pytestmark = pytest.mark.gpu
BF16 = torch.bfloat16


def _rel(a, b):
    assert not a.isnan().any()
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _rows_invariant(fn, x, *rest):
    full = fn(x, *rest)
    full = full[0] if isinstance(full, tuple) else full
    for m in (1, 3, 64, 255):
        part = fn(x[:m], *[r[:m] if torch.is_tensor(r) and r.shape[:1] == x.shape[:1] else r for r in rest])
        part = part[0] if isinstance(part, tuple) else part
        assert torch.equal(part, full[:m]), m


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(residual):
    x = torch.randn(256, 4096, device="cuda", dtype=BF16)
    w = 1 + 0.1 * torch.randn(4096, device="cuda", dtype=BF16)
    r = torch.randn_like(x) if residual else None
    out = R.rms_norm_triton(x, w, 1e-5, r)
    ref = R.rms_norm_reference(x, w, 1e-5, r)
    if residual:
        assert _rel(out[0], ref[0]) < 8e-3 and torch.equal(out[1], ref[1])
    else:
        assert _rel(out, ref) < 8e-3
    _rows_invariant(lambda a, b: R.rms_norm_triton(a, w, 1e-5, b), x, r)


@pytest.mark.parametrize("nh", [32, 4])
def test_head_norm_rows_are_invariant_at_every_place_in_a_program(nh):
    # Qwen3's q (32 heads) and k (4 heads) norm: several 128-wide rows per program; a token's
    # heads land at other places in a program when tokens before it come or go
    x = torch.randn(300, nh, 128, device="cuda", dtype=BF16)
    w = 1 + 0.1 * torch.randn(128, device="cuda", dtype=BF16)
    assert R.norm_rows(128) > 1
    full = R.rms_norm_triton(x, w, 1e-6, None)
    assert _rel(full, R.rms_norm_reference(x, w, 1e-6, None)) < 8e-3
    for s in range(R.norm_rows(128) + 1):
        assert torch.equal(R.rms_norm_triton(x[s:s + 37], w, 1e-6, None), full[s:s + 37]), s
        flat = x[s:s + 37].reshape(-1, 128)[s:]  # rows (not tokens) shifted by s
        assert torch.equal(R.rms_norm_triton(flat, w, 1e-6, None), full[s:s + 37].reshape(-1, 128)[s:]), s


def test_rope():
    t = 256
    q = torch.randn(t, 32, 128, device="cuda", dtype=BF16)
    k = torch.randn(t, 8, 128, device="cuda", dtype=BF16)
    pos = torch.randint(0, 4096, (t,), device="cuda")
    inv = 1.0 / (500000 ** (torch.arange(0, 64, device="cuda").float() / 64))
    ang = torch.arange(4096, device="cuda").float()[:, None] * inv[None]
    cs = torch.cat([ang.cos(), ang.sin()], -1)
    qo, ko = R.rope_triton(q, k, pos, cs)
    qr, kr = R.rope_reference(q, k, pos, cs)
    assert _rel(qo, qr) < 8e-3 and _rel(ko, kr) < 8e-3
    _rows_invariant(lambda a, b, p: R.rope_triton(a, b, p, cs), q, k, pos)


def test_silu_and_mul():
    x = torch.randn(256, 2 * 14336, device="cuda", dtype=BF16)
    assert _rel(R.silu_and_mul_triton(x), R.silu_and_mul_reference(x)) < 8e-3
    _rows_invariant(R.silu_and_mul_triton, x)


def test_log_softmax():
    x = torch.randn(64, 128256, device="cuda", dtype=torch.float32) * 3
    assert _rel(R.log_softmax_triton(x), R.log_softmax_reference(x)) < 1e-6
    _rows_invariant(R.log_softmax_triton, x)


def test_store_kv():
    cache = torch.randn(2, 64, 16, 8, 128, device="cuda", dtype=BF16)
    ref = cache.clone()
    k = torch.randn(40, 8, 128, device="cuda", dtype=BF16)
    v = torch.randn_like(k)
    slots = torch.randperm(64 * 16, device="cuda")[:40]
    slots[5] = -1
    R.store_kv_triton(k, v, cache, slots)
    R.store_kv_reference(k, v, ref, slots)
    assert torch.equal(cache, ref)


def test_rms_norm_reads_heads_in_place_with_the_copy_s_bits():
    # Qwen3's q/k norm reads [T, NH, D] heads inside the qkv rows (no copy): same bits as the copy
    qkv = torch.randn(37, (32 + 8) * 128, device="cuda", dtype=BF16)
    w = torch.randn(128, device="cuda", dtype=BF16)
    q = qkv[:, :32 * 128].view(37, 32, 128)
    out = R.rms_norm_triton(q, w, 1e-6, None)
    assert torch.equal(out, R.rms_norm_triton(q.reshape(37 * 32, 128), w, 1e-6, None).view(37, 32, 128))
