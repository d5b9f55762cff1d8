"""A tied model's checkpoint that still carries `lm_head.weight`: checked against the
embedding's shape."""
import os
import re

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file, save_file

from detent.models import ModelConfig, load_model
from detent.models.weights import CheckpointError

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    d = tmp_path_factory.mktemp("tied")
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**TINY)).save_pretrained(d)
    assert "lm_head.weight" not in load_file(os.path.join(d, "model.safetensors"))  # saved once, as tied
    return d


def _with_head(src, dst, head):
    """A copy of `src` whose file also holds `lm_head.weight = head(embedding)`."""
    os.makedirs(dst, exist_ok=True)
    for f in ("config.json", "generation_config.json"):
        with open(os.path.join(src, f)) as a, open(os.path.join(dst, f), "w") as b:
            b.write(a.read())
    sd = load_file(os.path.join(src, "model.safetensors"))
    sd["lm_head.weight"] = head(sd["model.embed_tokens.weight"])
    save_file(sd, os.path.join(dst, "model.safetensors"))
    return str(dst)


def _load(d, **kw):
    return load_model(ModelConfig.from_hf(d), path=str(d), dtype=torch.float32, progress=False, **kw)


def test_a_tied_lm_head_of_the_wrong_shape_is_refused_naming_it(tied, tmp_path):
    """It was skipped unread: a checkpoint whose tied head has another vocabulary loaded as if
    fine. transformers refuses it (a size mismatch); so does the loader, naming tensor and file."""
    d = _with_head(tied, tmp_path, lambda e: torch.zeros(95, 32))
    with pytest.raises(CheckpointError, match=re.escape(
            "lm_head.weight: checkpoint [95, 32], model expects [96, 32], the shape of "
            "model.embed_tokens.weight it is tied to (model.safetensors)")):
        _load(d)
