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
