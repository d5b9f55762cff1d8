"""A model directory with Llama-3.1 shapes (8B, or 70B with --70b) and a
word-level tokenizer: word "t<i>" is token i, so a prompt of N words is N
tokens exactly and load tests need no hub. Serve it with `--load-format dummy`.

    python3 benchmarks/wordlevel_model.py /tmp/wl8b
"""
from __future__ import annotations

import json
import os
import sys


def write(d: str, big: bool = False, vocab: int = 128256) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(d, exist_ok=True)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t1", "eos_token": "t2",
                   "unk_token": "t0", "model_max_length": 8192, "clean_up_tokenization_spaces": False}, f)
    cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
           "hidden_size": 8192 if big else 4096, "intermediate_size": 28672 if big else 14336,
           "num_attention_heads": 64 if big else 32, "num_key_value_heads": 8,
           "num_hidden_layers": 80 if big else 32, "head_dim": 128, "max_position_embeddings": 8192,
           "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "bos_token_id": 1,
           "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu"}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


if __name__ == "__main__":
    print("wrote", write(sys.argv[1], big="--70b" in sys.argv))
