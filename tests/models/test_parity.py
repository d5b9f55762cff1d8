"""Parity with transformers in float32: tiny random checkpoints that
transformers builds and saves; Detent loads them from disk and must give the
same log-probabilities at every position (|diff| <= 1e-4)."""
import pytest
import torch
import transformers as tf

from detent.models import ModelConfig, load_model
from helpers import Session, prefill_logits

TOL = 1e-4
PROMPTS = [[5, 17, 3, 99, 42], list(range(7, 30)), [(i * 37 + 11) % 120 for i in range(45)]]

BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            max_position_embeddings=256, rms_norm_eps=1e-6)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16, "rope_theta": 10000.0}

CASES = {
    "llama-gqa4:2-untied": (tf.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2)),
    "llama-attn-bias": (tf.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2,
                                             attention_bias=True)),
    "llama-mha-tied": (tf.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=4,
                                            tie_word_embeddings=True)),
    "llama-mqa8:1-llama3rope": (tf.LlamaConfig, dict(num_attention_heads=8, num_key_value_heads=1,
                                                     rope_parameters=LLAMA3_ROPE)),
    "llama-linear-rope-tied": (tf.LlamaConfig, dict(num_attention_heads=4, num_key_value_heads=2,
                                                    tie_word_embeddings=True, rope_parameters={
                                                        "rope_type": "linear", "factor": 2.0,
                                                        "rope_theta": 500.0})),
    "qwen3-qknorm-gqa": (tf.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),
    "qwen3-tied-mqa": (tf.Qwen3Config, dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                                            tie_word_embeddings=True)),
    "qwen3moe-norm-topk": (tf.Qwen3MoeConfig, dict(num_attention_heads=4, num_key_value_heads=2,
                                                   num_experts=8, num_experts_per_tok=2,
                                                   moe_intermediate_size=32, norm_topk_prob=True)),
    "qwen3moe-no-norm-mixed-layers": (tf.Qwen3MoeConfig, dict(
        num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3, num_experts=6,
        num_experts_per_tok=3, moe_intermediate_size=24, norm_topk_prob=False, mlp_only_layers=[1])),
}


def make_checkpoint(tmp_path, cls, kw, seed=0):
    """A transformers model with weights large enough that logits spread out
    (and norms away from 1, so a misplaced norm weight shows), saved to disk."""
    cfg = cls(**{**BASE, **kw})
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) * (1.2 / p.shape[-1] ** 0.5))
    model.save_pretrained(tmp_path)
    return model


def hf_logprobs(model, ids):
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)


@pytest.fixture(scope="module", params=sorted(CASES))
def pair(request, tmp_path_factory):
    cls, kw = CASES[request.param]
    d = tmp_path_factory.mktemp(request.param)
    ref = make_checkpoint(d, cls, kw)
    ours = load_model(ModelConfig.from_hf(d), path=str(d), dtype=torch.float32, progress=False)
    return ref, ours


def test_prefill_logprobs_match_transformers(pair):
    ref, ours = pair
    for ids in PROMPTS:
        want = hf_logprobs(ref, ids)
        got = torch.log_softmax(prefill_logits(ours, ids), -1)
        assert got.shape == want.shape
        # the oracle is not near-uniform, so a wrong model cannot pass by accident
        assert (want.max(-1).values - want.min(-1).values).min() > 3.0
        diff = (got - want).abs().max().item()
        assert diff <= TOL, f"max |logprob diff| {diff:.3g} > {TOL}"


def test_chunked_prefill_and_decode_match_transformers(pair):
    """The same sequence fed as prefill chunks and single decode steps through
    the paged KV cache gives the full-forward logprobs at every position."""
    ref, ours = pair
    ids = PROMPTS[2]
    want = hf_logprobs(ref, ids)
    s = Session(ours, max_len=64)
    pieces = [ids[:13], ids[13:38]] + [[t] for t in ids[38:]]
    got = torch.cat([s.step(p) for p in pieces])
    diff = (torch.log_softmax(got, -1) - want).abs().max().item()
    assert diff <= TOL, f"max |logprob diff| {diff:.3g} > {TOL}"


def test_a_wrong_weight_is_detected(tmp_path):
    """The comparison can fail: perturb one norm weight and the diff exceeds TOL."""
    cls, kw = CASES["qwen3-qknorm-gqa"]
    ref = make_checkpoint(tmp_path, cls, kw)
    ours = load_model(ModelConfig.from_hf(tmp_path), path=str(tmp_path), dtype=torch.float32,
                      progress=False)
    with torch.no_grad():
        ours.model.layers[1].self_attn.k_norm.weight[3] += 0.5
    ids = PROMPTS[1]
    diff = (torch.log_softmax(prefill_logits(ours, ids), -1) - hf_logprobs(ref, ids)).abs().max().item()
    assert diff > TOL
