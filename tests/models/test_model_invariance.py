"""The models add no batch dependence of their own: with every kernel
selection pinned, a sequence's logits are bit-identical (torch.equal)
alone, batched with other sequences, and fed as prefill then decode. With
the stock selections the same comparisons fail, so the cells can fail."""
import pytest
import torch

from detent.models import ModelConfig, load_model
from helpers import Session, batch_prefill_logits, prefill_logits

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
ARCHS = {
    "llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 32},
    "qwen3-moe": {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "num_experts": 8,
                  "num_experts_per_tok": 2, "moe_intermediate_size": 32, "norm_topk_prob": True},
}
A = [(i * 31 + 7) % 256 for i in range(37)]
OTHERS = [[(i * 17 + 3) % 256 for i in range(90)], [5, 6], list(range(200, 250))]


@pytest.fixture(scope="module", params=sorted(ARCHS))
def model(request):
    cfg = ModelConfig.from_hf({**TINY, **ARCHS[request.param]})
    return load_model(cfg, load_format="dummy", seed=7, dtype=torch.float32)


def _cells(model, mode):
    """(alone, in a batch) pairs of A's logits for several batches, plus
    full prefill vs prefill-then-decode of A's last 5 tokens."""
    alone = prefill_logits(model, A, mode)
    cells = []
    for others in ([OTHERS[0]], [OTHERS[1], OTHERS[2]], [OTHERS[0], OTHERS[2]]):
        cells.append((alone, batch_prefill_logits(model, others + [A], mode)[-1]))
    s = Session(model, max_len=64, mode=mode)
    stepped = torch.cat([s.step(A[:32])] + [s.step([t]) for t in A[32:]])
    cells.append((alone, stepped))
    return cells


def test_pinned_logits_do_not_depend_on_the_batch(model):
    for x, y in _cells(model, "pinned"):
        assert torch.equal(x, y)


def test_stock_logits_do_depend_on_the_batch(model):
    assert any(not torch.equal(x, y) for x, y in _cells(model, "stock"))
