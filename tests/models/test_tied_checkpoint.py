"""A tied model's checkpoint that still carries `lm_head.weight`: checked against the
embedding's shape, and loaded as transformers loads it (tied when the copy is equal, its own
weight when it differs: transformers' own load of the same files is the reference)."""
import logging
import os
import re

import pytest
import torch
import transformers as tf
from safetensors.torch import load_file

from detent.models import ModelConfig, load_model
from detent.models.weights import CheckpointError
from helpers import copy_checkpoint, prefill_logits

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True)
IDS = [5, 17, 3, 90, 41, 8, 60]


@pytest.fixture(scope="module")
def tied(tmp_path_factory):
    d = tmp_path_factory.mktemp("tied")
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(**TINY)).save_pretrained(d)
    assert "lm_head.weight" not in load_file(os.path.join(d, "model.safetensors"))  # saved once, as tied
    return d


def _with_head(src, dst, head):
    """A copy of `src` whose file also holds `lm_head.weight = head(embedding)`."""
    def edit(sd):
        sd["lm_head.weight"] = head(sd["model.embed_tokens.weight"])
    return copy_checkpoint(src, dst, edit)


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


def test_an_equal_tied_copy_stays_tied(tied, tmp_path):
    d = _with_head(tied, tmp_path, lambda e: e.clone())
    m = _load(d)
    assert m.lm_head.weight is m.model.embed_tokens.weight and m.lm_head.tied
    assert torch.equal(prefill_logits(m, IDS), prefill_logits(_load(tied), IDS))


@pytest.mark.parametrize("tp", [1, 2])
def test_a_differing_tied_copy_loads_untied_as_transformers_does(tied, tmp_path, caplog, tp):
    """transformers keeps both tensors, untied, when they differ (with a warning); the loader
    used the embedding as the head, other logits than transformers'. Now the head is the file's,
    on every rank; update_weights then takes lm_head.weight as its own weight."""
    from detent.engine.weight_update import apply, problems_for
    d = _with_head(tied, tmp_path, lambda e: e.flip(0) * 1.5)
    ref = tf.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    assert ref.lm_head.weight.data_ptr() != ref.model.embed_tokens.weight.data_ptr()
    with caplog.at_level(logging.WARNING, logger="detent.models"):
        ranks = [_load(d, tp_rank=r, tp_size=tp) for r in range(tp)]
    sd = load_file(os.path.join(d, "model.safetensors"))
    head = torch.cat([m.lm_head.weight for m in ranks])[:TINY["vocab_size"]]
    assert torch.equal(head, sd["lm_head.weight"]) and not any(m.lm_head.tied for m in ranks)
    emb = torch.cat([m.model.embed_tokens.weight for m in ranks])[:TINY["vocab_size"]]
    assert torch.equal(emb, sd["model.embed_tokens.weight"])
    assert "lm_head.weight in" in caplog.text and "differs from model.embed_tokens.weight" in caplog.text
    if tp == 1:
        with torch.no_grad():
            want = ref(torch.tensor([IDS])).logits[0].float()
        assert torch.allclose(prefill_logits(ranks[0], IDS), want, atol=1e-4, rtol=0)
        new = torch.zeros(96, 32)
        assert problems_for(ranks[0], [("lm_head.weight", (96, 32), "float32", True)]) == []
        assert apply(ranks[0], [("lm_head.weight", new)]) == 1
        assert torch.equal(ranks[0].lm_head.weight, new)
        assert torch.equal(ranks[0].model.embed_tokens.weight, sd["model.embed_tokens.weight"])
