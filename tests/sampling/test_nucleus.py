"""Top-p (kernels/nucleus.py, the torch candidate) against an exact oracle written from the contract:
a token is kept when the mass of the float32 probabilities strictly before it,
in the order probability descending / ties to the lower id, is < top_p (top_p
1 keeps every token); the sums are Python fractions, exact
(reference.exact_nucleus). Comparator: torch.equal on the keep mask."""
import pytest
import torch

from detent.kernels.nucleus import top_p_keep

from .reference import exact_nucleus


def exact_keep(xk: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    probs = torch.softmax(xk, dim=-1)  # the probabilities the contract is stated on
    keep = torch.zeros_like(xk, dtype=torch.bool)
    for i in range(xk.shape[0]):
        keep[i, exact_nucleus(probs[i].tolist(), float(top_p[i]))] = True
    return keep


def _logits(kind: str, B: int, V: int, g: torch.Generator) -> torch.Tensor:
    if kind == "peaked":
        return torch.randn(B, V, generator=g) * 6
    if kind == "flat":  # the nucleus spans most of the vocabulary
        return torch.randn(B, V, generator=g) * 0.01
    if kind == "ties":  # few distinct values: the boundary falls inside a tie
        return torch.randint(-3, 3, (B, V), generator=g).float()
    x = torch.randn(B, V, generator=g) * 3  # "top-k": -inf entries, as truncation_mask passes them
    x[:, 1::3] = float("-inf")
    return x


@pytest.mark.parametrize("kind", ["peaked", "flat", "ties", "top-k"])
@pytest.mark.parametrize("V", [5, 300, 3001, 5003])  # 5003: two 15-bit digits, the others three of 10
def test_the_nucleus_is_the_exact_one(kind, V):
    g = torch.Generator().manual_seed(V)
    x = _logits(kind, 6, V, g)
    top_p = torch.tensor([0.05, 0.5, 0.9, 0.95, 0.999, 1.0], dtype=torch.float64)
    assert torch.equal(top_p_keep(x, top_p), exact_keep(x, top_p))


def test_a_tie_at_the_boundary_is_kept_in_id_order_while_the_mass_before_is_below_top_p():
    # four tokens of 1/4: top_p 0.5 keeps two (masses before 0, 1/4), 0.5 + ulp keeps three
    x = torch.zeros(1, 4)
    assert top_p_keep(x, torch.tensor([0.5], dtype=torch.float64)).tolist() == [[True, True, False, False]]
    above = torch.tensor([0.5000001], dtype=torch.float64)
    assert top_p_keep(x, above).tolist() == [[True, True, True, False]]
    # the tie need not be adjacent: ids 0 and 4 (0.2 each) follow id 2 (0.4); top_p 0.5 keeps id 0
    # (mass before 0.4) and not id 4 (0.6)
    y = torch.log(torch.tensor([[0.2, 0.1, 0.4, 0.1, 0.2]]))
    keep = top_p_keep(y, torch.tensor([0.5], dtype=torch.float64))
    assert keep.tolist() == [[True, False, True, False, False]]


def test_a_row_keeps_the_same_tokens_alone_and_among_others():
    g = torch.Generator().manual_seed(7)
    x = torch.cat([_logits(k, 3, 4096, g) for k in ("peaked", "flat", "ties", "top-k")])
    top_p = torch.rand(x.shape[0], generator=g, dtype=torch.float64) * 0.98 + 0.01
    batch = top_p_keep(x, top_p)
    for i in range(x.shape[0]):
        assert torch.equal(top_p_keep(x[i:i + 1].clone(), top_p[i:i + 1]), batch[i:i + 1]), i
