"""The CPU (torch) candidates: a row's bits do not depend on M or on its
neighbours for the invariant candidates; the stock ones can differ."""
import pytest
import torch

from detent.selection.context import AttentionMetadata
from detent.kernels.attention import attention_paged_split, attention_sdpa
from detent.kernels.gemm import gemm_torch, gemm_torch_chunked


@pytest.mark.parametrize("with_bias", [False, True])
def test_chunked_gemm_row_bits_do_not_depend_on_m_or_neighbours(with_bias):
    g = torch.Generator().manual_seed(0)
    k, n, chunk = 96, 80, 16
    w = torch.randn(n, k, generator=g) * 0.02
    b = torch.randn(n, generator=g) if with_bias else None
    row = torch.randn(1, k, generator=g)
    ref = gemm_torch_chunked(row, w, b, chunk)[0]
    for m in (1, 2, 3, 4, 15, 16, 17, 33, 64):
        for pos in sorted({0, m // 2, m - 1}):
            x = torch.randn(m, k, generator=g)
            x[pos] = row[0]
            assert torch.equal(gemm_torch_chunked(x, w, b, chunk)[pos], ref), (m, pos)


def test_library_gemm_on_the_real_m_is_not_invariant():
    """The comparator can fail: MKL's fp32 kernel for M = 1 differs from M >= 4."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1536, 576, generator=g) * 0.02
    x = torch.randn(64, 576, generator=g)
    one = gemm_torch(x[:1], w, None)[0]
    assert any(not torch.equal(gemm_torch(x[:m], w, None)[0], one) for m in (2, 4, 64))


def _run_chunks(fn, q, k, v, chunks, **kw):
    """Prefill one sequence in the given chunks through the paged cache."""
    bs, nb = 4, 32
    cache = torch.zeros(2, nb, bs, k.shape[1], k.shape[2])
    length = q.shape[0]
    table = torch.arange(1, 1 + -(-length // bs), dtype=torch.int32)
    outs, done = [], 0
    for c in chunks:
        slots = torch.tensor([int(table[p // bs]) * bs + p % bs for p in range(done, done + c)])
        meta = AttentionMetadata(torch.tensor([0, c]), torch.tensor([done + c]), table[None], slots,
                                 1, c, c, done + c, bs, (0, c), (done + c,))
        outs.append(fn(q[done:done + c], k[done:done + c], v[done:done + c], cache, meta, 0.25, **kw))
        done += c
    return torch.cat(outs)


def test_paged_split_is_chunking_invariant_and_sdpa_is_not():
    g = torch.Generator().manual_seed(0)
    n = 37
    q, k, v = (torch.randn(n, h, 16, generator=g) for h in (6, 2, 2))
    whole = _run_chunks(attention_paged_split, q, k, v, [n], split_tokens=8, q_chunk=16)
    cut = _run_chunks(attention_paged_split, q, k, v, [5, 1, 20, 1, 10], split_tokens=8, q_chunk=16)
    assert torch.equal(whole, cut)
    ref = _run_chunks(attention_sdpa, q, k, v, [n])
    torch.testing.assert_close(whole, ref, atol=1e-5, rtol=1e-5)  # the same attention
    assert not torch.equal(ref, _run_chunks(attention_sdpa, q, k, v, [5, 1, 20, 1, 10]))
