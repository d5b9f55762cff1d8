"""A tiny random Llama checkpoint with the embedded SmolLM2's tokenizer and
chat template: a real model directory (config.json, safetensors, tokenizer)
that starts in a second, for the server's tests and benchmarks, and for a
smoke test of a deployment (`detent-serve --model DIR`)."""
from __future__ import annotations

import os
import shutil


def write_tiny_llama(path: str, hidden: int = 64, layers: int = 2) -> str:
    """Write the checkpoint to `path` and return `path`. Weights ~N(0, 0.02), as
    transformers initialises them (seed 0), so the numerics are realistic;
    the vocabulary is SmolLM2's 49,152 tokens."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from detent.models.resolve import resolve_model

    src = resolve_model(None).tokenizer_source
    cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, rope_theta=10000.0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(path, name))
    return path
