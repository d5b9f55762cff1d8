"""`LLM.update_weights`: after an update, generation equals a fresh engine
loaded with the new weights, bit for bit (`==` on token ids, `torch.equal`
on logprobs), including for a prompt whose KV the prefix cache held under
the old weights; the parameters keep their storage; a bad update is refused
whole and changes nothing."""
from __future__ import annotations

import json

import pytest
import torch

from detent.engine import LLM, SamplingParams
from detent.engine.weight_update import WeightUpdateError
from detent.models import ModelConfig, load_model
from rl_helpers import TINY_QWEN3

PROMPTS = [[(7 * i + 3) % 150 + 2 for i in range(40)], [5, 9, 33, 2, 80]]
SP = [SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
      SamplingParams(temperature=1.0, seed=3, max_tokens=6, logprobs=3, ignore_eos=True)]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3")
    (d / "config.json").write_text(json.dumps(TINY_QWEN3))
    return str(d)


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_tied")
    (d / "config.json").write_text(json.dumps({**TINY_QWEN3, "tie_word_embeddings": True}))
    return str(d)


def _llm(path, seed):
    return LLM(model=path, load_format="dummy", seed=seed, device="cpu", max_model_len=128,
               num_gpu_blocks=40, max_num_batched_tokens=64)


def _new_weights(path, seed=5) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of the dummy model with another seed."""
    m = load_model(ModelConfig.from_hf(path), dtype="float32", load_format="dummy", seed=seed)
    return {n: s.dest.clone() for n, s in m.weight_sources().items()}


def _outputs(llm):
    outs = []
    for p, sp in zip(PROMPTS, SP):
        c = llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0].outputs[0]
        outs.append((list(c.token_ids), torch.tensor([[lp.logprob for lp in pos.values()] for pos in c.logprobs])))
    return outs


def _same(a, b) -> bool:
    return all(x[0] == y[0] and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_update_then_generate_equals_a_fresh_engine(model_dir):
    llm = _llm(model_dir, seed=0)
    old = _outputs(llm)  # fills the prefix cache with old-weight KV of PROMPTS[0]'s blocks
    ptrs = [p.data_ptr() for p in llm.llm_engine.runner.model.parameters()]
    new = _new_weights(model_dir)
    assert llm.update_weights(new.items()) == len(new)
    assert [p.data_ptr() for p in llm.llm_engine.runner.model.parameters()] == ptrs
    got = _outputs(llm)
    fresh = _outputs(_llm(model_dir, seed=5))
    assert _same(got, fresh)
    assert not _same(old, fresh)  # the update changed the outputs: the comparison can fail


def test_a_state_dict_and_a_partial_update_work(model_dir):
    llm = _llm(model_dir, seed=0)
    name = "model.layers.0.mlp.down_proj.weight"
    t = torch.full_like(_new_weights(model_dir)[name], 0.01)
    assert llm.update_weights({name: t}) == 1
    assert torch.equal(llm.llm_engine.runner.model.model.layers[0].mlp.down_proj.weight, t)


@pytest.mark.parametrize("break_it,message", [
    (lambda w: w.update({"model.layers.9.mlp.up_proj.weight": w["model.norm.weight"]}), "not a weight"),
    (lambda w: w.update({"model.norm.weight": torch.ones(3)}), r"shape \[3\]"),
    (lambda w: w.update({"model.norm.weight": w["model.norm.weight"].double()}), "dtype float64"),
    (lambda w: w["model.layers.1.self_attn.o_proj.weight"].__setitem__((0, 0), float("nan")), "NaN"),
    (lambda w: w.update({"model.norm.weight": torch.empty(64, device="meta")}),  # torch's own error, was
     "model.norm.weight: a meta-device tensor"),  # "Tensor.item() cannot be called on meta tensors"
])
def test_a_bad_update_is_refused_whole(model_dir, break_it, message):
    llm = _llm(model_dir, seed=0)
    before = {n: p.clone() for n, p in llm.llm_engine.runner.model.named_parameters()}
    w = _new_weights(model_dir)
    break_it(w)
    with pytest.raises(WeightUpdateError, match=message):
        llm.update_weights(w)
    after = dict(llm.llm_engine.runner.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("bad,message", [
    (torch.ones(3), r"lm_head.weight: shape \[3\], the checkpoint tensor is \[160, 64\]"),
    (torch.ones(160, 64, dtype=torch.float64), "lm_head.weight: dtype float64"),
    (torch.full((160, 64), float("nan")), "lm_head.weight: has NaN"),
])
def test_a_tied_lm_head_is_checked_as_the_embedding_it_copies(tied_dir, bad, message):
    """A tied model skips `lm_head.weight` (the embedding is the weight); a wrong one was
    skipped unchecked. It is refused as a wrong embedding would be, nothing changed; a
    right one is still skipped."""
    llm = _llm(tied_dir, seed=0)
    before = {n: p.clone() for n, p in llm.llm_engine.runner.model.named_parameters()}
    w = _new_weights(tied_dir)
    with pytest.raises(WeightUpdateError, match=message):
        llm.update_weights({**w, "lm_head.weight": bad})
    after = dict(llm.llm_engine.runner.model.named_parameters())
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert llm.update_weights({**w, "lm_head.weight": w["model.embed_tokens.weight"]}) == len(w)


def test_duplicates_and_running_requests_are_refused(model_dir):
    llm = _llm(model_dir, seed=0)
    w = _new_weights(model_dir)
    with pytest.raises(WeightUpdateError, match="given twice"):
        llm.update_weights([("model.norm.weight", w["model.norm.weight"])] * 2)
    llm.llm_engine.add_request("r", PROMPTS[1], SP[0])
    with pytest.raises(WeightUpdateError, match="requests are running"):
        llm.update_weights(w)
    llm.llm_engine.abort_request("r")
    llm.llm_engine.step()
    assert llm.update_weights(w) == len(w)
