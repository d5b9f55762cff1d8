"""Strict loading, sharded checkpoints, dummy weights, TP slicing, and the
errors a user sees when a checkpoint or name is wrong."""
import os
import re

import pytest
import torch
import transformers as tf

from detent.models import ModelConfig, ModelNotFound, load_model, resolve_model
from detent.models.weights import CheckpointError
from helpers import copy_checkpoint, prefill_logits

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama")
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**TINY)).save_pretrained(d)
    return d


def _load(d):
    return load_model(ModelConfig.from_hf(d), path=str(d), dtype=torch.float32, progress=False)


def test_missing_tensor_is_named(ckpt, tmp_path):
    d = copy_checkpoint(ckpt, tmp_path, lambda sd: sd.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.weight"):
        _load(d)


def test_extra_tensor_is_named(ckpt, tmp_path):
    d = copy_checkpoint(ckpt, tmp_path, lambda sd: sd.__setitem__("model.layers.0.mlp.extra.weight",
                                                             torch.zeros(3)))
    with pytest.raises(CheckpointError, match=r"unexpected tensors: model\.layers\.0\.mlp\.extra\.weight"):
        _load(d)


def test_wrong_shape_is_named(ckpt, tmp_path):
    def edit(sd):
        sd["model.layers.0.mlp.up_proj.weight"] = torch.zeros(47, 32)
    d = copy_checkpoint(ckpt, tmp_path, edit)
    with pytest.raises(CheckpointError, match=re.escape(
            "model.layers.0.mlp.up_proj.weight: checkpoint [47, 32], model expects [48, 32]")):
        _load(d)


def test_truncated_file_is_named(ckpt, tmp_path):
    d = copy_checkpoint(ckpt, tmp_path, lambda sd: None)
    f = os.path.join(d, "model.safetensors")
    data = open(f, "rb").read()
    open(f, "wb").write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors.*(truncated|corrupt)"):
        _load(d)


def test_pickled_checkpoint_is_refused(ckpt, tmp_path):
    d = copy_checkpoint(ckpt, tmp_path, lambda sd: None)
    os.remove(os.path.join(d, "model.safetensors"))
    open(os.path.join(d, "pytorch_model.bin"), "wb").write(b"not opened")
    with pytest.raises(CheckpointError, match=r"pytorch_model\.bin.*never unpickles"):
        _load(d)


def test_unsupported_architecture_lists_supported(ckpt):
    cfg = ModelConfig.from_hf(ckpt).replace(architecture="GPT2LMHeadModel")
    with pytest.raises(ValueError, match=r"unsupported model architecture 'GPT2LMHeadModel'; supported: "
                                         r"LlamaForCausalLM, Qwen3ForCausalLM, Qwen3MoeForCausalLM"):
        load_model(cfg, load_format="dummy")


def test_unresolvable_name_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    with pytest.raises(ModelNotFound) as e:
        resolve_model("some-org/some-model")
    msg = str(e.value)
    assert str(tmp_path / "hf" / "hub" / "models--some-org--some-model") in msg
    # current huggingface_hub's command (`huggingface-cli` is deprecated): into the cache, or into a directory
    assert "    hf download some-org/some-model    # into the Hugging Face cache" in msg
    assert "    hf download some-org/some-model --local-dir models/some-model    # then pass models/some-model" in msg
    assert "huggingface-cli" not in msg
    with pytest.raises(ModelNotFound, match="not one of .*llama-3.1-8b"):
        resolve_model("not-a-model")
    with pytest.raises(ModelNotFound, match=r"models--Qwen--Qwen3-8B"):
        resolve_model("qwen3-8b")  # a preset without weights in the cache


def test_sharded_checkpoint_loads_like_single(ckpt, tmp_path):
    torch.manual_seed(0)
    m = tf.AutoModelForCausalLM.from_pretrained(ckpt)
    m.save_pretrained(tmp_path, max_shard_size="20KB")
    assert os.path.isfile(tmp_path / "model.safetensors.index.json")
    assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 2
    a, b = _load(ckpt), _load(tmp_path)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na


def test_hf_cache_snapshot_and_local_dir_resolve(ckpt, tmp_path, monkeypatch):
    snap = tmp_path / "hub" / "models--acme--tiny" / "snapshots" / "abc123"
    copy_checkpoint(ckpt, snap, lambda sd: None)
    (tmp_path / "hub" / "models--acme--tiny" / "refs").mkdir()
    (tmp_path / "hub" / "models--acme--tiny" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    r = resolve_model("acme/tiny")
    assert r.path == str(snap) and r.source == "hf-cache" and r.load_format == "safetensors"
    r = resolve_model(str(ckpt))
    assert r.source == "local" and r.config.num_layers == 2
    r = resolve_model(str(ckpt), "dummy")
    assert r.path is None and r.load_format == "dummy"


def test_presets_have_real_shapes_for_dummy():
    r = resolve_model("llama-3.1-70b", "dummy")
    c = r.config
    assert (c.hidden_size, c.num_layers, c.num_heads, c.num_kv_heads, c.intermediate_size) == \
        (8192, 80, 64, 8, 28672)
    assert r.config.rope_dict["rope_type"] == "llama3"
    c = resolve_model("qwen3-30b-a3b", "dummy").config
    assert (c.num_experts, c.num_experts_per_tok, c.moe_intermediate_size, c.qk_norm) == (128, 8, 768, True)
    c = resolve_model("QWEN3-8B", "dummy").config
    assert c.architecture == "Qwen3ForCausalLM" and c.head_dim == 128


def test_dummy_weights_scale_and_determinism():
    cfg = ModelConfig.from_hf({**TINY, "architectures": ["LlamaForCausalLM"]})
    a = load_model(cfg, load_format="dummy", seed=1, dtype=torch.float32)
    b = load_model(cfg, load_format="dummy", seed=1, dtype=torch.float32)
    c = load_model(cfg, load_format="dummy", seed=2, dtype=torch.float32)
    assert torch.equal(a.model.norm.weight, torch.ones(32))
    w = a.model.layers[0].mlp.gate_up_proj.weight
    assert 0.015 < w.std().item() < 0.025 and abs(w.mean().item()) < 0.005
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.model.layers[0].mlp.gate_up_proj.weight, c.model.layers[0].mlp.gate_up_proj.weight)
    logits = prefill_logits(a, [1, 2, 3])
    assert logits.dtype == torch.float32 and logits.shape == (3, 96)


@pytest.mark.parametrize("kv_heads,tp", [(2, 2), (1, 2), (2, 4)])
def test_tp_shards_are_slices_of_the_full_tensors(kv_heads, tp):
    """Each rank's shard is the slice of the tp=1 tensor; KV heads are
    replicated when there are fewer than ranks; MoE experts split their
    intermediate dim."""
    raw = {**TINY, "num_key_value_heads": kv_heads, "architectures": ["Qwen3MoeForCausalLM"],
           "model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 16, "vocab_size": 95}
    cfg = ModelConfig.from_hf(raw)
    full = load_model(cfg, load_format="dummy", seed=3, dtype=torch.float32)
    ranks = [load_model(cfg, load_format="dummy", seed=3, dtype=torch.float32, tp_rank=r, tp_size=tp)
             for r in range(tp)]
    f_attn = full.model.layers[0].self_attn.qkv_proj.weight
    q, kv, d = 4 * 8, kv_heads * 8, 8
    q_parts = [m.model.layers[0].self_attn.qkv_proj.weight[: q // tp] for m in ranks]
    assert torch.equal(torch.cat(q_parts), f_attn[:q])
    for r, m in enumerate(ranks):
        w = m.model.layers[0].self_attn.qkv_proj.weight
        local_kv = max(kv_heads // tp, 1) * d
        head = (r // (tp // kv_heads) if kv_heads < tp else r * (kv_heads // tp))
        assert torch.equal(w[q // tp: q // tp + local_kv], f_attn[q + head * d: q + head * d + local_kv])
        assert torch.equal(w[q // tp + local_kv:], f_attn[q + kv + head * d: q + kv + head * d + local_kv])
        assert m.kv_cache_shape(5, 16) == (2, 5, 16, local_kv // d, d)
    o = torch.cat([m.model.layers[1].self_attn.o_proj.weight for m in ranks], dim=1)
    assert torch.equal(o, full.model.layers[1].self_attn.o_proj.weight)
    emb = torch.cat([m.model.embed_tokens.weight for m in ranks])
    assert torch.equal(emb[:95], full.model.embed_tokens.weight) and not emb[95:].any()  # padded vocab
    e_full = full.model.layers[0].mlp.experts
    w2 = torch.cat([m.model.layers[0].mlp.experts.w2 for m in ranks], dim=2)
    assert torch.equal(w2, e_full.w2)
    gates = torch.cat([m.model.layers[0].mlp.experts.w13[:, : 16 // tp] for m in ranks], dim=1)
    assert torch.equal(gates, e_full.w13[:, :16])
    assert torch.equal(ranks[-1].model.layers[0].mlp.gate.weight, full.model.layers[0].mlp.gate.weight)


def test_bad_load_format_and_dtype():
    cfg = ModelConfig.from_hf({**TINY, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="load_format must be one of"):
        load_model(cfg, load_format="pt")
    with pytest.raises(ValueError, match="dtype must be one of"):
        load_model(cfg, load_format="dummy", dtype="int8")
    with pytest.raises(ValueError, match="needs path="):
        load_model(cfg, load_format="safetensors")


def test_auto_dtype_is_fp32_on_cpu_and_checkpoint_dtype_on_gpu():
    from detent.models.loader import resolve_dtype
    cfg = ModelConfig.from_hf({**TINY, "architectures": ["LlamaForCausalLM"], "torch_dtype": "bfloat16"})
    assert resolve_dtype("auto", cfg, torch.device("cpu")) == torch.float32
    assert resolve_dtype("auto", cfg, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("bf16", cfg, torch.device("cpu")) == torch.bfloat16


def test_bf16_checkpoint_loads_into_fp32(ckpt, tmp_path):
    m = tf.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    m.save_pretrained(tmp_path)
    ours = _load(tmp_path)
    w = ours.model.layers[0].mlp.gate_up_proj.weight
    assert w.dtype == torch.float32
    assert torch.equal(w[:48], m.model.layers[0].mlp.gate_proj.weight.float())


def test_index_naming_a_missing_shard(ckpt, tmp_path):
    m = tf.AutoModelForCausalLM.from_pretrained(ckpt)
    m.save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(f for f in os.listdir(tmp_path) if f.endswith(".safetensors"))[1]
    os.remove(tmp_path / shard)
    with pytest.raises(CheckpointError, match=f"shard files that are missing: .*{shard}"):
        _load(tmp_path)


def test_tp_ranks_read_their_slices_from_safetensors(ckpt):
    """Each rank reads only its part of each tensor from disk; the parts put
    back together are the tp = 1 parameters."""
    cfg = ModelConfig.from_hf(ckpt)
    full = _load(ckpt)
    ranks = [load_model(cfg, path=str(ckpt), dtype=torch.float32, progress=False, tp_rank=r, tp_size=2)
             for r in range(2)]
    cat = lambda get, dim=0: torch.cat([get(m) for m in ranks], dim)  # noqa: E731
    layer = lambda m: m.model.layers[1]  # noqa: E731
    gu = full.model.layers[1].mlp.gate_up_proj.weight
    assert torch.equal(cat(lambda m: layer(m).mlp.gate_up_proj.weight[:24]), gu[:48])
    assert torch.equal(cat(lambda m: layer(m).mlp.gate_up_proj.weight[24:]), gu[48:])
    assert torch.equal(cat(lambda m: layer(m).mlp.down_proj.weight, 1), layer(full).mlp.down_proj.weight)
    assert torch.equal(cat(lambda m: m.lm_head.weight), full.lm_head.weight)
    assert torch.equal(ranks[1].model.norm.weight, full.model.norm.weight)


def test_the_hf_download_command_we_print_is_one_the_hf_cli_accepts(tmp_path, monkeypatch):
    """The installed huggingface_hub's own `hf download` parser takes the command the message prints."""
    import shutil
    import subprocess
    hf = shutil.which("hf")
    if hf is None:
        pytest.skip("huggingface_hub's `hf` command is not installed")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    with pytest.raises(ModelNotFound) as e:
        resolve_model("qwen3-8b")
    [line] = [ln for ln in str(e.value).splitlines() if "--local-dir" in ln]
    argv = line.split("#")[0].split()
    assert argv[:3] == ["hf", "download", "Qwen/Qwen3-8B"]
    usage = subprocess.run([hf, "download", "--help"], capture_output=True, text=True, timeout=120).stdout
    assert "REPO_ID" in usage and "--local-dir" in usage
