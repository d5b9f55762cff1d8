"""benchmarks/wordlevel_model.py --weights: the checkpoint it writes holds Detent's dummy weights, so a
server loading the files runs on the same values as `--load-format dummy` (and vLLM on those values)."""
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
import wordlevel_model  # noqa: E402

from detent.models.config import ModelConfig  # noqa: E402
from detent.models.loader import load_model  # noqa: E402


def _small_dir(tmp_path) -> str:
    d = wordlevel_model.write(str(tmp_path / "wl"), vocab=512)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
               num_hidden_layers=2, head_dim=16)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    return d


def test_written_checkpoint_equals_the_dummy_weights(tmp_path):
    d = _small_dir(tmp_path)
    paths = wordlevel_model.write_weights(d, shard_bytes=64 << 10)  # several shards
    assert len(paths) > 1
    cfg = ModelConfig.from_hf(d)
    files = load_model(cfg, dtype="bfloat16", load_format="auto", path=d, progress=False).state_dict()
    dummy = load_model(cfg, dtype="bfloat16", load_format="dummy").state_dict()
    assert files.keys() == dummy.keys()
    for k in files:
        assert torch.equal(files[k], dummy[k]), k
    # another seed gives other values: the comparison can fail
    other = load_model(cfg, dtype="bfloat16", load_format="dummy", seed=1).state_dict()
    assert not all(torch.equal(files[k], other[k]) for k in files)


def test_every_word_encodes_to_its_own_id_as_vllm_bench_serve_sends_it(tmp_path):
    # `vllm bench serve --dataset-name random`: a run of consecutive ids from a random
    # offset, decoded to text and encoded again (transformers' tokenizer, special tokens
    # matched first). With special tokens named "t0".."t2", "t100" came back as [1, 0]
    from transformers import AutoTokenizer
    d = wordlevel_model.write(str(tmp_path / "wl"), vocab=2000)
    tok = AutoTokenizer.from_pretrained(d)
    assert tok.all_special_ids and set(tok.all_special_ids) <= {0, 1, 2}
    for start in (3, 97, 100, 1000, 1950):
        ids = [3 + (start - 3 + i) % 1997 for i in range(64)]
        assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids, start
    assert tok.encode(tok.decode([100, 101]), add_special_tokens=False) != [1, 0]


def test_a_qwen3_moe_directory_has_the_presets_shapes_and_serves(tmp_path):
    # benchmarks/arms_gpu.sh MODEL=qwen3-30b-a3b serves the arms at Qwen3-30B-A3B shapes (issue 20's
    # second model); here its config at the preset's shapes, then shrunk to run a step on CPU
    from detent.models.presets import preset
    d = wordlevel_model.write(str(tmp_path / "q3"), shape="qwen3-30b-a3b", vocab=512)
    with open(os.path.join(d, "config.json")) as f:
        cfg = json.load(f)
    want = preset("qwen3-30b-a3b")["config"]
    for k in ("architectures", "hidden_size", "moe_intermediate_size", "num_experts", "num_experts_per_tok",
              "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim"):
        assert cfg[k] == want[k], k
    assert (cfg["vocab_size"], cfg["bos_token_id"], cfg["eos_token_id"]) == (512, 1, 2)
    cfg.update(hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8,
               num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
               head_dim=16)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f)
    from detent import LLM, SamplingParams
    llm = LLM(d, load_format="dummy", device="cpu", dtype="float32", max_model_len=64)
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0))[0]
    assert len(out.outputs[0].token_ids) == 3
