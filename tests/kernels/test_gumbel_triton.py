"""The `gumbel` family's fused Triton kernel (kernels/gumbel_triton.py) under
Triton's interpreter, against the torch reference (kernels/gumbel.py).

Comparator: token indices with `torch.equal`. The reference's noise is itself
checked against an independent pure-Python Philox and Random123's vectors
(tests/sampling/test_rng.py)."""
import pytest
import torch

from detent.kernels.gumbel import gumbel_argmax_torch
from detent.kernels.gumbel_triton import gumbel_argmax_triton

SEEDS = [0, 1, 2**63 + 7, 2**64 - 1, 123456789012345, 42, 2**32 + 5, 9]
POSITIONS = [0, 7, 4095, 2**32 - 1, 31, 100, 5, 2048]


def _z(b: int, v: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(b, v, generator=g) * 3
    z[1, ::3] = float("-inf")  # excluded tokens
    z[2, : v - 5] = float("-inf")  # only the last five may be drawn
    return z


@pytest.mark.parametrize("v", [7, 1000, 3000])
@pytest.mark.parametrize("role", [0, 1])
def test_equals_the_torch_reference(v, role):
    z = _z(8, v)
    args = (SEEDS, POSITIONS, [0, 1, 2, 3, 0, 5, 9, 2**31], role)
    want = gumbel_argmax_torch(z, *args)
    got = gumbel_argmax_triton(z, *args)
    assert torch.equal(got, want)
    assert bool((z.gather(1, got[:, None]) > float("-inf")).all())


def test_every_row_masked_takes_the_first_token_as_argmax_does():
    z = torch.full((2, 2500), float("-inf"))
    args = ([1, 2], [3, 4], [0, 0], 0)
    assert torch.equal(gumbel_argmax_triton(z, *args), gumbel_argmax_torch(z, *args))
    assert gumbel_argmax_triton(z, *args).tolist() == [0, 0]


def test_a_row_alone_equals_the_row_in_a_batch():
    z = _z(8, 2100, seed=3)
    keys = (SEEDS, POSITIONS, [0] * 8, 0)
    batch = gumbel_argmax_triton(z, *keys)
    for i in range(8):
        alone = gumbel_argmax_triton(z[i:i + 1].clone(), [SEEDS[i]], [POSITIONS[i]], [0], 0)
        assert torch.equal(alone, batch[i:i + 1])


@pytest.mark.parametrize("v", [3000, 4097])
def test_many_chunks_equal_the_reference(monkeypatch, v):
    """One block per chunk: 3 and 5 chunks a row, the last one partial."""
    from detent.kernels import gumbel_triton
    monkeypatch.setattr(gumbel_triton, "CHUNK_BLOCKS", 1)
    z = _z(8, v, seed=5)
    args = (SEEDS, POSITIONS, [0] * 8, 0)
    assert torch.equal(gumbel_triton.gumbel_argmax_triton(z, *args), gumbel_argmax_torch(z, *args))


def test_a_tie_across_chunks_goes_to_the_lower_id(monkeypatch):
    from detent.kernels import gumbel_triton
    monkeypatch.setattr(gumbel_triton, "CHUNK_BLOCKS", 1)
    z = torch.full((2, 3000), float("-inf"))
    z[0, [2500, 1500]] = 3e38  # chunks 2 and 1; z + g rounds to z in float64: a tie
    z[1, [2999, 7]] = 3e38  # chunks 2 and 0
    args = ([1, 2], [3, 4], [0, 0], 0)
    assert gumbel_triton.gumbel_argmax_triton(z, *args).tolist() == [1500, 7]
    assert torch.equal(gumbel_triton.gumbel_argmax_triton(z, *args), gumbel_argmax_torch(z, *args))


def test_candidates_path_is_the_reference():
    z = _z(3, 50)
    ids = torch.tensor([[0, 4, 9, 49], [1, 2, 3, 5], [10, 11, 12, 13]])
    zc = z.gather(1, ids)
    args = ([1, 2, 3], [4, 5, 6], [0, 0, 0], 0)
    assert torch.equal(gumbel_argmax_triton(zc, *args, ids=ids), gumbel_argmax_torch(zc, *args, ids=ids))


def test_position_out_of_range_is_refused():
    with pytest.raises(ValueError, match="position"):
        gumbel_argmax_triton(torch.zeros(1, 8), [1], [2**32], [0], 0)


def test_dense_kernel_equals_the_reference_drawing_at_few_tokens():
    """Every row truncated to a few tokens: the reference draws at those ids only
    (kernels/gumbel.py `_candidates`), the fused kernel over the whole row."""
    z = torch.full((4, 3000), float("-inf"))
    g = torch.Generator().manual_seed(5)
    for i, n in enumerate([1, 3, 40, 300]):
        ids = torch.randperm(3000, generator=g)[:n]
        z[i, ids] = torch.randn(n, generator=g)
    args = ([11, 12, 2**63 + 1, 14], [0, 9, 99, 2**31], [0, 1, 0, 2], 0)
    from detent.kernels.gumbel import _candidates
    assert _candidates(z) is not None  # the reference takes its sparse path here
    assert torch.equal(gumbel_argmax_triton(z, *args), gumbel_argmax_torch(z, *args))


def test_the_sampler_draws_the_same_tokens_through_the_fused_kernel():
    """The whole sampler (greedy, temperature, top-k, top-p, min-p, masks) with the
    `gumbel` family forced to the fused kernel gives the torch reference's tokens."""
    from detent.sampling.params import SamplingParams
    from detent.sampling.sampler import SamplingRow
    from sampler_override import reference_and_kernel_outputs

    V = 1500
    g = torch.Generator().manual_seed(9)
    logits = torch.randn(9, V, generator=g) * 2
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.0),
              SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_k=5),
              SamplingParams(temperature=0.9, top_p=0.5), SamplingParams(temperature=1.0, min_p=0.2),
              SamplingParams(temperature=1.3, top_k=50, top_p=0.9), SamplingParams(temperature=1.0, logprobs=3),
              SamplingParams(temperature=1.0, allowed_token_ids=[3, 700, 1499])]
    rows = [SamplingRow(p, seed=1000 + i, position=17 + i) for i, p in enumerate(params)]
    outs = reference_and_kernel_outputs(logits, rows, "gumbel")
    assert outs[0] == outs[1]
