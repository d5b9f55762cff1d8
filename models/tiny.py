"""A tiny random Llama checkpoint with the embedded SmolLM2's tokenizer and
chat template: a real model directory (config.json, safetensors, tokenizer)
that starts in a second, for the server's tests and benchmarks, and for a
smoke test of a deployment (`detent-serve --model DIR`).

`tokenizer="wordlevel"` writes a word-level tokenizer instead ("t<i>" is
token i: `write_wordlevel_tokenizer`), for a machine without the embedded
model's package (a GPU run of tests that send token ids only)."""
from __future__ import annotations

import os
import shutil


UNK, BOS, EOS = "<unk>", "<s>", "</s>"  # the word-level tokenizer's ids 0, 1, 2; no word holds them


def write_wordlevel_tokenizer(path: str, vocab: int, model_max_length: int = 8192) -> None:
    """A word-level tokenizer in `path`: word "t<i>" is token i (i >= 3; 0, 1 and 2 are
    "<unk>", "<s>" and "</s>"), so a prompt of N words is N tokens exactly. The special
    tokens are not words "t0".."t2": a tokenizer matches its special tokens inside words
    before it splits them, so "t100" would encode as "t1" + unknown."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    os.makedirs(path, exist_ok=True)
    words = {f"t{i}": i for i in range(3, vocab)}
    words.update({UNK: 0, BOS: 1, EOS: 2})
    tok = Tokenizer(models.WordLevel(words, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOS,
                   "unk_token": UNK, "model_max_length": model_max_length, "clean_up_tokenization_spaces": False}, f)


def write_tiny_llama(path: str, hidden: int = 64, layers: int = 2, tokenizer: str = "smollm2") -> str:
    """Write the checkpoint to `path` and return `path`. Weights ~N(0, 0.02), as
    transformers initialises them (seed 0), so the numerics are realistic;
    the vocabulary is SmolLM2's 49,152 tokens, with its tokenizer and chat
    template, or a word-level tokenizer of that size (`tokenizer="wordlevel"`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    if tokenizer not in ("smollm2", "wordlevel"):
        raise ValueError(f"tokenizer {tokenizer!r}: 'smollm2' or 'wordlevel'")
    cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, rope_theta=10000.0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(path)
    if tokenizer == "wordlevel":
        write_wordlevel_tokenizer(path, cfg.vocab_size, cfg.max_position_embeddings)
        return path
    from detent.models.resolve import resolve_model

    src = resolve_model(None).tokenizer_source
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if os.path.isfile(os.path.join(src, name)):
            shutil.copy(os.path.join(src, name), os.path.join(path, name))
    return path
