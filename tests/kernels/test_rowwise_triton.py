import pytest
import torch

from detent.kernels import rowwise_triton as R


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _close(a, b, tol=2e-6):
    assert not a.isnan().any()
    assert ((a.double() - b.double()).abs().max() / b.double().abs().max()).item() < tol


@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm(residual):
    g = _gen(0)
    x, w = torch.randn(7, 48, generator=g), torch.randn(48, generator=g)
    r = torch.randn(7, 48, generator=g) if residual else None
    out = R.rms_norm_triton(x, w, 1e-6, r)
    ref = R.rms_norm_reference(x, w, 1e-6, r)
    if residual:
        _close(out[0], ref[0])
        assert torch.equal(out[1], ref[1])  # x + residual: one rounding, exact
        row = R.rms_norm_triton(x[3:4], w, 1e-6, r[3:4])
        assert torch.equal(row[0][0], out[0][3]) and torch.equal(row[1][0], out[1][3])
    else:
        _close(out, ref)
        assert torch.equal(R.rms_norm_triton(x[5:6], w, 1e-6, None)[0], out[5])


def test_rms_norm_reads_heads_in_place():
    # Qwen3's q/k norm: [T, NH, D] heads viewed inside the fused qkv rows, normalised without a copy
    g = _gen(3)
    qkv = torch.randn(5, 7 * 16, generator=g)  # 4 q heads, 2 k heads, 1 v head of 16
    w = torch.randn(16, generator=g)
    q = qkv[:, :64].view(5, 4, 16)
    assert not q.is_contiguous()
    out = R.rms_norm_triton(q, w, 1e-6, None)
    assert out.shape == (5, 4, 16) and out.is_contiguous()
    assert torch.equal(out, R.rms_norm_triton(q.reshape(20, 16), w, 1e-6, None).view(5, 4, 16))
    _close(out, R.rms_norm_reference(q, w, 1e-6, None))


def test_narrow_rows_share_a_program_and_keep_their_bits_at_any_offset():
    g = _gen(4)
    x, w = torch.randn(45, 16, generator=g), torch.randn(16, generator=g)
    per = R.norm_rows(16)
    assert per > 1 and R.norm_rows(1024) == 1 and R.norm_rows(4096) == 1
    full = R.rms_norm_triton(x, w, 1e-6, None)
    _close(full, R.rms_norm_reference(x, w, 1e-6, None))
    for s in (1, per - 1, per, per + 3):
        assert torch.equal(R.rms_norm_triton(x[s:], w, 1e-6, None), full[s:]), s


def test_rope():
    g = _gen(1)
    q, k = torch.randn(5, 4, 16, generator=g), torch.randn(5, 2, 16, generator=g)
    pos = torch.tensor([3, 0, 9, 9, 1])
    cs = torch.randn(12, 16, generator=g)
    qo, ko = R.rope_triton(q, k, pos, cs)
    qr, kr = R.rope_reference(q, k, pos, cs)
    _close(qo, qr)
    _close(ko, kr)
    q1, k1 = R.rope_triton(q[2:3], k[2:3], pos[2:3], cs)
    assert torch.equal(q1[0], qo[2]) and torch.equal(k1[0], ko[2])
    with pytest.raises(ValueError, match="cos_sin"):
        R.rope_triton(q, k, pos, cs.double())


def test_silu_and_mul():
    g = _gen(2)
    x = torch.randn(6, 70, generator=g)
    y = R.silu_and_mul_triton(x)
    _close(y, R.silu_and_mul_reference(x))
    assert torch.equal(R.silu_and_mul_triton(x[4:5])[0], y[4])
    with pytest.raises(ValueError, match="even"):
        R.silu_and_mul_triton(torch.randn(2, 5))


def test_log_softmax():
    g = _gen(3)
    x = torch.randn(3, 5000, generator=g) * 4
    y = R.log_softmax_triton(x)
    assert y.dtype == torch.float32
    _close(y, R.log_softmax_reference(x), tol=1e-6)
    assert torch.equal(R.log_softmax_triton(x[1:2])[0], y[1])


def test_store_kv_skips_negative_slots():
    g = _gen(4)
    cache = torch.full((2, 4, 4, 2, 16), float("nan"))
    ref = cache.clone()
    k, v = torch.randn(3, 2, 16, generator=g), torch.randn(3, 2, 16, generator=g)
    slots = torch.tensor([5, -1, 14])
    R.store_kv_triton(k, v, cache, slots)
    R.store_kv_reference(k, v, ref, slots)
    assert torch.equal(cache.nan_to_num(7.0), ref.nan_to_num(7.0))
    assert torch.equal(cache[0, 1, 1], k[0]) and torch.equal(cache[1, 3, 2], v[2])
    with pytest.raises(ValueError, match="slot_mapping"):
        R.store_kv_triton(k, v, cache, slots[:2])


def test_store_kv_takes_k_and_v_as_views_into_qkv():
    # the attention layer passes v (and, without q/k norm, k) as strided views of the qkv rows
    g = _gen(5)
    qkv = torch.randn(3, (4 + 2 + 2) * 16, generator=g)
    k, v = qkv[:, 64:96].view(3, 2, 16), qkv[:, 96:].view(3, 2, 16)
    a, b = torch.zeros(2, 4, 4, 2, 16), torch.zeros(2, 4, 4, 2, 16)
    slots = torch.tensor([5, 0, 14])
    R.store_kv_triton(k, v, a, slots)
    R.store_kv_triton(k.contiguous(), v.contiguous(), b, slots)
    assert torch.equal(a, b) and torch.equal(a[1, 3, 2], v[2])
