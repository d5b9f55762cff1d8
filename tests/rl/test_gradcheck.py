"""Each kernel family's backward (selection/autograd.py) passes
torch.autograd.gradcheck in float64 on tiny shapes, and each CPU candidate's
forward agrees with the reference math the backward differentiates.

Several CPU candidates compute in float32 inside (norm, rope, log-softmax,
attention, MoE routing), so finite differences through them in float64
would measure their rounding, not their derivative: for those, gradcheck
runs the family's wrapper over a float64 stand-in for the candidate (the
reference forward), and `test_candidates_agree_with_the_reference` ties the
real candidates to that reference in float32. gemm, act and embedding are
checked through the real candidates."""
from __future__ import annotations

import functools

import pytest
import torch

from detent.selection.context import AttentionMetadata
from detent.selection import grad_refs as R
from detent.kernels import registry
from detent.selection.autograd import WRAPPERS

D64 = dict(dtype=torch.float64)


def _t(*shape, grad=True, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape))
    return torch.randn(*shape, generator=g, **D64).requires_grad_(grad)


def _meta(lens: list[int], before: list[int] | None = None) -> AttentionMetadata:
    """Sequences back to back, each in its own blocks of 4 tokens; sequence b
    computes positions before[b] .. before[b] + lens[b] - 1 (0: whole)."""
    before = before or [0] * len(lens)
    bs, qsl, tables, slots, first = 4, [0], [], [], 1
    for n, p in zip(lens, before):
        nb = -(-(p + n) // bs)
        tables.append(list(range(first, first + nb)) + [0] * (8 - nb))
        slots += [(first + i // bs) * bs + i % bs for i in range(p, p + n)]
        qsl.append(qsl[-1] + n)
        first += nb
    kv = [p + n for n, p in zip(lens, before)]
    return AttentionMetadata(torch.tensor(qsl, dtype=torch.int32), torch.tensor(kv, dtype=torch.int32),
                             torch.tensor(tables, dtype=torch.int32), torch.tensor(slots), len(lens), qsl[-1],
                             max(lens), max(kv), bs, tuple(qsl), tuple(kv))


def _cand(family, impl):
    return registry.get(family, impl).fn


ATT_META = _meta([5, 3])
CASES = {
    "gemm/torch_chunked": lambda: (functools.partial(WRAPPERS["gemm"], _cand("gemm", "torch_chunked"), chunk=4),
                                   (_t(5, 3), _t(4, 3), _t(4))),
    "gemm/no_bias": lambda: (functools.partial(WRAPPERS["gemm"], _cand("gemm", "torch")), (_t(3, 6), _t(2, 6), None)),
    "act/torch_rowwise": lambda: (functools.partial(WRAPPERS["act"], _cand("act", "torch_rowwise")), (_t(4, 6),)),
    "embedding/torch_rowwise": lambda: (functools.partial(WRAPPERS["embedding"], _cand("embedding", "torch_rowwise")),
                                        (torch.tensor([0, 3, 3, 1]), _t(5, 3))),
    "norm": lambda: (functools.partial(WRAPPERS["norm"], lambda x, w, eps, r: R.rms_norm(x, w, r, eps=eps)),
                     (_t(3, 8), _t(8), 1e-5, None)),
    "norm/residual": lambda: (functools.partial(WRAPPERS["norm"], lambda x, w, eps, r: R.rms_norm(x, w, r, eps=eps)),
                              (_t(3, 8), _t(8, seed=1), 1e-5, _t(3, 8, seed=2))),
    "rope": lambda: (functools.partial(WRAPPERS["rope"], R.rope),
                     (_t(3, 2, 4), _t(3, 1, 4, seed=1), torch.tensor([0, 5, 2]), torch.randn(8, 4, **D64))),
    "logsoftmax": lambda: (functools.partial(WRAPPERS["logsoftmax"], R.log_softmax), (_t(3, 7),)),
    "attention": lambda: (functools.partial(
        WRAPPERS["attention"],
        lambda q, k, v, cache, meta, scale: R.attention(q, k, v, query_start_loc=meta.query_start_loc_cpu, scale=scale)),
        (_t(8, 4, 4), _t(8, 2, 4, seed=1), _t(8, 2, 4, seed=2), None, ATT_META, 0.5)),
    "moe": lambda: (functools.partial(
        WRAPPERS["moe"], lambda x, r, a, b, k, n: R.moe(x, r, a, b, top_k=k, renormalize=n)),
        (_t(5, 4), _t(5, 3, seed=1), _t(3, 6, 4, seed=2), _t(3, 4, 3, seed=3), 2, True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_family_backward_passes_gradcheck(case):
    fn, args = CASES[case]()
    tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]

    def f(*xs):
        full = list(args)
        for i, x in zip(tensors, xs):
            full[i] = x
        return fn(*full)
    assert torch.autograd.gradcheck(f, tuple(args[i] for i in tensors), eps=1e-6, atol=1e-5, rtol=1e-4)


def test_chunked_attention_backward_passes_gradcheck():
    """Two sequences scored in two steps through a paged cache, as the trainer
    runs sequences longer than its budget: step 1's attention reads step 0's
    K and V from the cache (the real `sdpa` candidate, exact in float64), and
    its backward reaches the step-0 tensors through the KV history."""
    from detent.selection.autograd import KVHistory
    sdpa = functools.partial(WRAPPERS["attention"], _cand("attention", "sdpa"))
    m0, m1 = _meta([5, 3]), _meta([3, 4], before=[5, 3])

    def f(q0, k0, v0, q1, k1, v1):
        cache, hist = torch.zeros(2, 8, 4, 2, 4, **D64), KVHistory()
        o0 = sdpa(q0, k0, v0, cache, m0, 0.5, history=hist.step(0, ("a", "b")))
        o1 = sdpa(q1, k1, v1, cache, m1, 0.5, history=hist.step(1, ("a", "b")))
        return torch.cat([o0, o1])
    args = (_t(8, 4, 4), _t(8, 2, 4, seed=1), _t(8, 2, 4, seed=2), _t(7, 4, 4, seed=3), _t(7, 2, 4, seed=4),
            _t(7, 2, 4, seed=5))
    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="KV history"):  # step 1 without the history cannot differentiate
        sdpa(args[3], args[4], args[5], torch.zeros(2, 8, 4, 2, 4, **D64), m1, 0.5)


def test_gradcheck_catches_a_wrong_backward(monkeypatch):
    """The check can fail: a reference with the wrong derivative is caught."""
    monkeypatch.setattr(R, "silu_and_mul", lambda x: torch.relu(x[..., :3]) * x[..., 3:])
    x = _t(4, 6)
    fn = functools.partial(WRAPPERS["act"], _cand("act", "torch_rowwise"))
    assert not torch.autograd.gradcheck(fn, (x,), eps=1e-6, atol=1e-5, raise_exception=False)


def test_candidates_agree_with_the_reference():
    g = torch.Generator().manual_seed(0)
    x, r, w = torch.randn(6, 16, generator=g), torch.randn(6, 16, generator=g), torch.randn(16, generator=g)
    for got, want in [(_cand("norm", "torch_rowwise")(x, w, 1e-5, r), R.rms_norm(x, w, r, eps=1e-5)),
                      ((_cand("logsoftmax", "torch_rowwise")(x),), (R.log_softmax(x),))]:
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    cs = torch.randn(9, 8, generator=g)
    pos = torch.tensor([0, 3, 8, 1, 1, 2])
    for a, b in zip(_cand("rope", "torch_rowwise")(x.view(6, 2, 8), r.view(6, 2, 8), pos, cs),
                    R.rope(x.view(6, 2, 8), r.view(6, 2, 8), pos, cs)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    q, k, v = torch.randn(8, 4, 4, generator=g), torch.randn(8, 2, 4, generator=g), torch.randn(8, 2, 4, generator=g)
    cache = torch.zeros(2, 8, 4, 2, 4)
    for impl, kw in [("paged_split", dict(split_tokens=4, q_chunk=2)), ("sdpa", {})]:
        got = _cand("attention", impl)(q, k, v, cache, ATT_META, 0.5, **kw)
        torch.testing.assert_close(got, R.attention(q, k, v, query_start_loc=ATT_META.query_start_loc_cpu, scale=0.5),
                                   rtol=1e-5, atol=1e-6)
    xm, rl = torch.randn(5, 4, generator=g), torch.randn(5, 3, generator=g)
    w13, w2 = torch.randn(3, 6, 4, generator=g), torch.randn(3, 4, 3, generator=g)
    torch.testing.assert_close(_cand("moe", "torch_chunked")(xm, rl, w13, w2, 2, True, chunk=4),
                               R.moe(xm, rl, w13, w2, top_k=2, renormalize=True), rtol=1e-5, atol=1e-5)
