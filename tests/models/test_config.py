"""ModelConfig.from_hf: both transformers config dialects, validation, rope."""
import dataclasses
import json

import pytest
import torch
import transformers as tf
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from detent.models import ModelConfig
from detent.models.layers import rope_inv_freq

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128,
         "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "max_position_embeddings": 512, "rms_norm_eps": 1e-5}
L3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}


def test_transformers4_and_5_rope_dialects_agree():
    v4 = ModelConfig.from_hf({**LLAMA, "rope_theta": 500000.0, "rope_scaling": {**L3, "rope_type": "llama3"}})
    v5 = ModelConfig.from_hf({**LLAMA, "rope_parameters": {**L3, "rope_type": "llama3", "rope_theta": 500000.0}})
    old = ModelConfig.from_hf({**LLAMA, "rope_theta": 500000.0, "rope_scaling": {**L3, "type": "llama3"}})
    assert v4 == v5 == old
    assert v4.rope_theta == 500000.0 and v4.rope_dict == {**L3, "rope_type": "llama3"}
    assert v4.head_dim == 8 and v4.num_kv_heads == 2


def test_fields_from_files(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "tie_word_embeddings": True,
                                                      "torch_dtype": "float16", "eos_token_id": 7}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9], "bos_token_id": 1}))
    c = ModelConfig.from_hf(tmp_path)
    assert c.eos_token_ids == (7, 9) and c.bos_token_id == 1
    assert c.tie_word_embeddings and c.dtype == "float16" and c.rope_scaling is None
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.vocab_size = 3


def test_moe_fields_both_names():
    base = {**LLAMA, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
            "num_experts_per_tok": 2, "moe_intermediate_size": 16, "norm_topk_prob": True,
            "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    a = ModelConfig.from_hf({**base, "num_experts": 4})
    b = ModelConfig.from_hf({**base, "num_local_experts": 4})
    assert a == b and a.num_experts == 4 and a.qk_norm and a.norm_topk_prob
    assert [a.layer_is_sparse(i) for i in range(6)] == [False, True, False, False, False, True]


@pytest.mark.parametrize("edit,match", [
    ({"num_key_value_heads": 3}, r"num_heads \(8\) must be a multiple of num_kv_heads \(3\)"),
    ({"architectures": []}, "missing 'architectures'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling type 'yarn' is not supported"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "llama3 rope scaling needs 'low_freq_factor'"),
    ({"mlp_bias": True}, "mlp_bias=true is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"vocab_size": 0}, "vocab_size must be a positive int"),
    ({"torch_dtype": "int8"}, "dtype must be float32, float16 or bfloat16"),
])
def test_bad_configs_name_the_field(edit, match):
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf({**LLAMA, **edit})


def test_missing_field_and_file(tmp_path):
    raw = dict(LLAMA)
    del raw["hidden_size"]
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        ModelConfig.from_hf(raw)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        ModelConfig.from_hf(tmp_path)


@pytest.mark.parametrize("kind,params", [("llama3", L3), ("linear", {"factor": 4.0})])
def test_rope_inverse_frequencies_match_transformers(kind, params):
    cfg = tf.LlamaConfig(**{k: v for k, v in LLAMA.items() if k not in ("architectures", "model_type")},
                         rope_parameters={**params, "rope_type": kind, "rope_theta": 500000.0})
    want, scale = ROPE_INIT_FUNCTIONS[kind](cfg, torch.device("cpu"))
    assert scale == 1.0
    got = rope_inv_freq(8, 500000.0, {**params, "rope_type": kind})
    assert torch.equal(got, want.float())
    assert not torch.equal(got, rope_inv_freq(8, 500000.0, None))
