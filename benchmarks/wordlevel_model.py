"""A model directory with Llama-3.1 shapes (8B, or 70B with --70b; or Qwen3-30B-A3B's) and a
word-level tokenizer: word "t<i>" is token i (i >= 3; 0, 1 and 2 are "<unk>",
"<s>" and "</s>"), so a prompt of N words is N tokens exactly and load tests
need no hub. Serve it with `--load-format dummy`.

The special tokens are not "t0", "t1" and "t2" (as before 2026-12-04): a
tokenizer matches its special tokens inside words before it splits them, so
"t100" encoded as "t1" + unknown, [1, 0]. `vllm bench serve`'s random prompts
(runs of consecutive ids decoded to text and encoded again) then came back as
[1, 0, 1, 0, ...] for every prompt whose run began with a "t1..." or
"t2..." word: about 40 % of them, all the same, so both servers' prefix
caches served them (vLLM logged hit rates of 27-48 % in lease 16).

    python3 benchmarks/wordlevel_model.py /tmp/wl8b
    python3 benchmarks/wordlevel_model.py /tmp/wl8b-w --weights   # + safetensors files
    python3 benchmarks/wordlevel_model.py /tmp/wlq3 --qwen3-30b-a3b   # Qwen3-30B-A3B shapes

`--weights` also writes the weights as safetensors shards: Detent's dummy
weights (models/weights.py `dummy_tensors`: norms 1, matrices N(0, 0.02),
seed 0), drawn on the GPU when there is one. Every server that loads the
directory with its default load format then runs on the same values, bit
for bit (vLLM's own dummy weights are uniform in +-1e-3). On the H200 the
two dummy initialisations cost the same GEMM time (benchmarks/gemm_waves.py
`--data`, lease 14), so this is for a side by side on identical values, not
a correction of the dummy-weight ones.
"""
from __future__ import annotations

import json
import os
import sys


def write(d: str, big: bool = False, vocab: int | None = None, shape: str | None = None) -> str:
    """The directory: Llama-3.1-8B shapes, 70B with `big`, or `shape="qwen3-30b-a3b"` (Qwen3-30B-A3B:
    128 experts, 8 a token; Detent's preset config) with the word-level tokenizer (`vocab`
    words, the shape's own vocabulary by default) and its special ids 1 and 2."""
    if shape == "qwen3-30b-a3b":
        from detent.models.presets import preset
        cfg = {**preset(shape)["config"], "vocab_size": vocab or 151936, "max_position_embeddings": 8192,
               "bos_token_id": 1, "eos_token_id": 2, "hidden_act": "silu"}
    elif shape is None:
        cfg = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab or 128256,
               "hidden_size": 8192 if big else 4096, "intermediate_size": 28672 if big else 14336,
               "num_attention_heads": 64 if big else 32, "num_key_value_heads": 8,
               "num_hidden_layers": 80 if big else 32, "head_dim": 128, "max_position_embeddings": 8192,
               "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "bos_token_id": 1,
               "eos_token_id": 2, "tie_word_embeddings": False, "hidden_act": "silu"}
    else:
        raise ValueError(f"shape {shape!r}: only qwen3-30b-a3b (or none, Llama-3.1)")
    from detent.models.tiny import write_wordlevel_tokenizer

    write_wordlevel_tokenizer(d, cfg["vocab_size"])
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def write_weights(d: str, seed: int = 0, shard_bytes: int = 4 << 30) -> list[str]:
    """Detent's dummy weights for the directory's config as safetensors shards
    (checkpoint names, bf16) plus the index file; the shard paths."""
    import torch
    from safetensors.torch import save_file

    from detent.models.config import ModelConfig
    from detent.models.registry import model_class
    from detent.models.weights import dummy_tensors

    cfg = ModelConfig.from_hf(d)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg).to(torch.bfloat16)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    shards: list[dict] = [{}]
    size = 0
    for name, t, _ in dummy_tensors(model, seed=seed, device=device):
        if size and size + t.nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t.cpu()
        size += t.nbytes
    paths, weight_map = [], {}
    for i, tensors in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, os.path.join(d, fn), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fn))
        paths.append(os.path.join(d, fn))
    total = sum(t.nbytes for s in shards for t in s.values())
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f)
    return paths


if __name__ == "__main__":
    out = write(sys.argv[1], big="--70b" in sys.argv,
                shape="qwen3-30b-a3b" if "--qwen3-30b-a3b" in sys.argv else None)
    if "--weights" in sys.argv:
        write_weights(out)
    print("wrote", out)
