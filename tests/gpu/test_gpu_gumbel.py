"""The fused Gumbel-max kernel on the GPU (kernels/gumbel_triton.py): the same
tokens as the torch reference (`torch.equal`), a row's token the same alone
and in a batch of 128, at Llama-3's vocabulary. Prints both times."""
import time

import pytest
import torch

from detent.kernels.gumbel import gumbel_argmax_torch
from detent.kernels.gumbel_triton import gumbel_argmax_triton

pytestmark = pytest.mark.gpu


def _timed(fn, *args):
    fn(*args)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(10):
        out = fn(*args)
    torch.cuda.synchronize()
    return out, (time.perf_counter() - t) / 10


@pytest.mark.parametrize("b", [1, 64, 128])
def test_fused_equals_reference_and_is_row_invariant(b):
    v = 128256
    g = torch.Generator(device="cuda").manual_seed(b)
    z = torch.randn(b, v, device="cuda", generator=g) * 4
    z[0, ::5] = float("-inf")
    seeds = [(i * 2654435761) % 2**63 for i in range(b)]
    pos = [1024 + i for i in range(b)]
    args = (seeds, pos, [0] * b, 0)
    want, t_ref = _timed(gumbel_argmax_torch, z, *args)
    got, t_fused = _timed(gumbel_argmax_triton, z, *args)
    print(f"batch {b}: reference {t_ref * 1e6:.0f} us, fused {t_fused * 1e6:.0f} us")
    assert torch.equal(got, want)
    last = gumbel_argmax_triton(z[-1:].clone(), seeds[-1:], pos[-1:], [0], 0)
    assert torch.equal(last, got[-1:])
