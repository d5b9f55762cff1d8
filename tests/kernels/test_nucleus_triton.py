"""The `top_p` family's Triton kernel (kernels/nucleus_triton.py) under Triton's
interpreter, against the torch reference (kernels/nucleus.py) and the exact
oracle (tests/sampling/reference.py: Python fractions over the same float32
probabilities). Comparator: torch.equal on the keep mask.

The kernel spreads a row over chunks and a digit over launches; the answer must
not depend on either: every digit width and chunking gives the reference's
mask, and a row gives the same mask alone and among others."""
import os
import sys

import pytest
import torch

from detent.kernels import nucleus_triton as nt
from detent.kernels.nucleus import top_p_keep

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sampling"))
from reference import exact_nucleus  # noqa: E402  (the sampling tests' exact oracle)

def _logits(kind: str, B: int, V: int, g: torch.Generator) -> torch.Tensor:
    x = torch.randn(B, V, generator=g)
    if kind == "peaked":
        return x * 6
    if kind == "flat":  # the nucleus spans most of the vocabulary
        return x * 0.01
    if kind == "ties":  # few distinct values: the boundary falls inside a tie
        return torch.randint(-3, 3, (B, V), generator=g).float()
    if kind == "near":  # most of the mass on 24 logits a float32 step apart: probabilities equal or
        # a few ulps apart, so the boundary falls among values that differ in their last bits
        x = x - 12
        x[:, 1::max(1, V // 24)] = 3.0 + torch.arange(len(range(1, V, max(1, V // 24)))) * 2.384185791015625e-07
        return x
    x = x * 3  # "top-k": -inf entries, as truncation_mask passes them
    x[:, ::4] = float("-inf")
    return x


def exact_keep(xk: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(xk, dim=-1)
    keep = torch.zeros_like(xk, dtype=torch.bool)
    for i in range(xk.shape[0]):
        keep[i, exact_nucleus(probs[i].tolist(), float(top_p[i]))] = True
    return keep


TOP_P = torch.tensor([0.05, 0.5, 0.9, 0.95, 0.999, 1.0], dtype=torch.float64)


@pytest.fixture(params=["levels", "row"])
def launch(request, monkeypatch):
    """Both launches of the kernel: a launch a digit, and one program a row (blocks of 64 here, so
    a row spans several)."""
    monkeypatch.setattr(nt, "LAUNCH", request.param)
    monkeypatch.setattr(nt, "ROW_BLOCK", 64)
    return request.param


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "near", "top-k"])
@pytest.mark.parametrize("V", [5, 3001])  # one chunk; three chunks, the last one partial
def test_equals_the_reference_and_the_exact_nucleus(kind, V, launch):
    x = _logits(kind, 6, V, torch.Generator().manual_seed(V + 1))
    got = nt.top_p_keep_triton(x, TOP_P)
    assert torch.equal(got, top_p_keep(x, TOP_P))
    assert torch.equal(got, exact_keep(x, TOP_P))


@pytest.mark.parametrize("digit_bits", [2, 5, 10])
def test_every_digit_width_and_chunking_gives_the_same_mask(monkeypatch, digit_bits, launch):
    """Several chunks a row (blocks of 64, two a chunk: 6 chunks at V = 701, the last one
    partial), ties across chunk borders, and 30 / digit_bits launches (3 is the default)."""
    monkeypatch.setattr(nt, "BLOCK", 64)
    monkeypatch.setattr(nt, "CHUNK_BLOCKS", 2)
    monkeypatch.setattr(nt, "DIGIT_BITS", digit_bits)
    g = torch.Generator().manual_seed(digit_bits)
    x = torch.cat([_logits(k, 1, 701, g) for k in ("peaked", "flat", "ties", "near", "top-k")])
    top_p = torch.tensor([0.3, 0.9, 0.5, 0.45, 0.97], dtype=torch.float64)
    assert torch.equal(nt.top_p_keep_triton(x, top_p), top_p_keep(x, top_p))


def test_a_tie_split_across_chunks_is_kept_in_id_order(monkeypatch, launch):
    """Ten tokens of one probability, one in each of ten chunks (or blocks) of 4, and top_p
    between masses: the first few by id are kept, whatever chunk they sit in."""
    monkeypatch.setattr(nt, "BLOCK", 4)
    monkeypatch.setattr(nt, "ROW_BLOCK", 4)
    monkeypatch.setattr(nt, "CHUNK_BLOCKS", 1)
    x = torch.full((1, 40), -30.0)
    x[0, 2::4] = 0.0  # ids 2, 6, ..., 38 hold nearly all the mass, equally
    for p, kept in ((0.25, 3), (0.55, 6), (0.999, 10)):
        keep = nt.top_p_keep_triton(x, torch.tensor([p], dtype=torch.float64))
        assert torch.equal(keep, top_p_keep(x, torch.tensor([p], dtype=torch.float64)))
        assert keep[0].nonzero().flatten().tolist() == list(range(2, 40, 4))[:kept], p


def test_a_row_keeps_the_same_tokens_alone_and_among_others(launch):
    g = torch.Generator().manual_seed(11)
    # 1100: two blocks of 1024 for "levels", the last partial; 18 blocks of 64 for "row"
    x = torch.cat([_logits(k, 2, 1100, g) for k in ("peaked", "flat", "ties", "near", "top-k")])
    top_p = torch.rand(x.shape[0], generator=g, dtype=torch.float64) * 0.98 + 0.01
    batch = nt.top_p_keep_triton(x, top_p)
    for i in range(x.shape[0]):
        assert torch.equal(nt.top_p_keep_triton(x[i:i + 1].clone(), top_p[i:i + 1]), batch[i:i + 1]), i


def test_the_sampler_reaches_it_through_the_dispatcher(monkeypatch):
    """The sampler's top-p goes through `ops.top_p_keep`: with the family overridden to the
    kernel, the kernel launches and every output (tokens, logprobs, ranks, top-k) equals the
    torch candidate's."""
    from detent.sampling.params import SamplingParams
    from detent.sampling.sampler import SamplingRow
    from sampler_override import reference_and_kernel_outputs

    launches = []
    real = nt._top_p_kernel

    class Counted:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]
    monkeypatch.setattr(nt, "_top_p_kernel", Counted())
    x = _logits("peaked", 4, 700, torch.Generator().manual_seed(3))
    params = [SamplingParams(temperature=0.6, top_p=0.9, logprobs=3), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0, top_k=20, top_p=0.95), SamplingParams(temperature=1.0, top_p=0.3)]
    rows = [SamplingRow(p, seed=50 + i, position=9) for i, p in enumerate(params)]
    outs = reference_and_kernel_outputs(x, rows, "top_p")
    assert outs[0] == outs[1]
    assert len(launches) == 30 // nt.launch_for(4)[1] + 1


def test_auto_takes_each_launch_by_the_batch_with_the_same_mask(monkeypatch):
    """"auto" (the default): 3-bit levels for small batches, 2-bit levels between, one program a row
    for large ones (bounds shrunk here so the interpreter runs all three), each the reference's mask."""
    monkeypatch.setattr(nt, "LAUNCH", "auto")
    monkeypatch.setattr(nt, "AUTO_LEVELS3_MAX", 1)
    monkeypatch.setattr(nt, "AUTO_ROW_MIN", 5)
    monkeypatch.setattr(nt, "ROW_BLOCK", 64)
    seen = []
    for kernel in ("_top_p_kernel", "_top_p_row_kernel"):
        real = getattr(nt, kernel)

        class Spy:
            def __getitem__(self, grid, real=real, kernel=kernel):
                seen.append(kernel)
                return real[grid]
        monkeypatch.setattr(nt, kernel, Spy())
    x = torch.cat([_logits(k, 1, 300, torch.Generator().manual_seed(5)) for k in ("peaked", "flat", "ties", "near",
                                                                                   "top-k")])
    top_p = torch.tensor([0.3, 0.9, 0.5, 0.45, 0.97], dtype=torch.float64)
    for b, want in ((1, ["_top_p_kernel"] * 11), (3, ["_top_p_kernel"] * 16), (5, ["_top_p_row_kernel"])):
        seen.clear()
        assert torch.equal(nt.top_p_keep_triton(x[:b], top_p[:b]), top_p_keep(x[:b], top_p[:b])), b
        assert seen == want, b


def test_the_first_call_compiles_every_launch_so_serving_meets_none(monkeypatch):
    """Under "auto" a batch crossing a bound takes another kernel: the first call for a device and
    vocabulary also runs the other launches (on CUDA by default; forced here), once, on its first
    row, and its own mask is still the reference's."""
    monkeypatch.setattr(nt, "LAUNCH", "auto")
    monkeypatch.setattr(nt, "AUTO_LEVELS3_MAX", 1)
    monkeypatch.setattr(nt, "AUTO_ROW_MIN", 5)
    monkeypatch.setattr(nt, "ROW_BLOCK", 64)
    monkeypatch.setattr(nt, "WARM_ALL_LAUNCHES", True)
    monkeypatch.setattr(nt, "_WARMED", set())
    seen = []
    for kernel in ("_top_p_kernel", "_top_p_row_kernel"):
        real = getattr(nt, kernel)

        class Spy:
            def __getitem__(self, grid, real=real, kernel=kernel):
                seen.append((kernel, grid[0]))
                return real[grid]
        monkeypatch.setattr(nt, kernel, Spy())
    x = _logits("peaked", 3, 300, torch.Generator().manual_seed(9))
    top_p = torch.tensor([0.3, 0.9, 0.5], dtype=torch.float64)
    assert torch.equal(nt.top_p_keep_triton(x, top_p), top_p_keep(x, top_p))
    # warm: 3-bit levels (11 launches) and the row launch on one row; then the call's own 2-bit levels
    assert seen == [("_top_p_kernel", 1)] * 11 + [("_top_p_row_kernel", 1)] + [("_top_p_kernel", 3)] * 16
    seen.clear()
    assert torch.equal(nt.top_p_keep_triton(x, top_p), top_p_keep(x, top_p))
    assert seen == [("_top_p_kernel", 3)] * 16  # once per device and vocabulary
