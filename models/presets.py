"""Preset model names: their Hugging Face repo ids (looked up in the local HF
cache) and built-in configs, so `load_format="dummy"` runs at the real shapes
without any files."""
from __future__ import annotations

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                 "original_max_position_embeddings": 8192}
_LLAMA31 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "rope_scaling": _LLAMA31_ROPE,
            "max_position_embeddings": 131072, "tie_word_embeddings": False, "bos_token_id": 128000,
            "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16", "head_dim": 128}
_QWEN3 = {"model_type": "qwen3", "vocab_size": 151936, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
          "max_position_embeddings": 40960, "tie_word_embeddings": False, "bos_token_id": 151643,
          "eos_token_id": [151645, 151643], "torch_dtype": "bfloat16", "head_dim": 128}

PRESETS: dict[str, dict] = {
    "smollm2-135m-instruct": {
        "repos": ("HuggingFaceTB/SmolLM2-135M-Instruct",),
        "config": {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
                   "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                   "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
                   "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
                   "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
                   "torch_dtype": "bfloat16"},
    },
    "llama-3.1-8b": {
        "repos": ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B",
                  "meta-llama/Meta-Llama-3.1-8B-Instruct", "meta-llama/Meta-Llama-3.1-8B"),
        "config": {**_LLAMA31, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                   "num_attention_heads": 32, "num_key_value_heads": 8},
    },
    "llama-3.1-70b": {
        "repos": ("meta-llama/Llama-3.1-70B-Instruct", "meta-llama/Llama-3.1-70B",
                  "meta-llama/Meta-Llama-3.1-70B-Instruct", "meta-llama/Meta-Llama-3.1-70B"),
        "config": {**_LLAMA31, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
                   "num_attention_heads": 64, "num_key_value_heads": 8},
    },
    "qwen3-8b": {
        "repos": ("Qwen/Qwen3-8B",),
        "config": {**_QWEN3, "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096,
                   "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
                   "num_key_value_heads": 8},
    },
    "qwen3-30b-a3b": {
        "repos": ("Qwen/Qwen3-30B-A3B", "Qwen/Qwen3-30B-A3B-Instruct-2507"),
        "config": {**_QWEN3, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                   "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
                   "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                   "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
                   "decoder_sparse_step": 1, "mlp_only_layers": []},
    },
}

DEFAULT_PRESET = "smollm2-135m-instruct"


def preset(name: str) -> dict | None:
    return PRESETS.get(name.strip().lower())
