"""Decode vs prefill, and rollout vs trainer, bit for bit.

- each decoded token's logprob (and its top-5) equals what prefilling
  prompt + output reports for that position (`prompt_logprobs`);
- the trainer forward (engine/trainer.py) over prompt + completion
  reproduces every rollout logprob, for rollouts made in a crowded batch.
Comparator: `==` on ids, `torch.equal` on float32 tensors. With
selection="stock" the comparison fails (the tests can fail).
"""
from __future__ import annotations

import pytest
import torch

from detent.engine import SamplingParams
from detent.engine.trainer import TrainerForward
from engine_helpers import bundle, generate_target, make_llm, prompt

_ROLLOUTS: dict = {}


def rollout(b, sel):
    """The target generated among 4 others with chunked prefills (cached per model and mode)."""
    if (b.name, sel) not in _ROLLOUTS:
        llm = make_llm(b, sel, max_num_batched_tokens=24)
        t = prompt(11, 37, b.config.vocab_size)
        others = [prompt(20 + i, 5 + 13 * i, b.config.vocab_size) for i in range(4)]
        _ROLLOUTS[b.name, sel] = (llm, t, generate_target(llm, t, others, row=2))
    return _ROLLOUTS[b.name, sel]


def prefill_view(llm, t, r):
    """prompt_logprobs of prompt + output at the output positions, as tensors."""
    seq = t + r.token_ids
    out = llm.generate([{"prompt_token_ids": seq}],
                       SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=5), use_tqdm=False)[0]
    pls = out.prompt_logprobs
    assert pls[0] is None and len(pls) == len(seq)
    chosen, ids, lps = [], [], []
    for j, tok in enumerate(r.token_ids):
        pos = pls[len(t) + j]
        chosen.append(pos[tok].logprob)
        row = list(pos.items())[:6]
        row += [(-1, None)] * (6 - len(row))
        ids.append([i for i, _ in row])
        lps.append([float("-inf") if lp is None else lp.logprob for _, lp in row])
    return torch.tensor(chosen), torch.tensor(ids), torch.tensor(lps)


MODELS = ["llama", "qwen3_moe", pytest.param("smollm2", marks=pytest.mark.slow)]


@pytest.mark.parametrize("model", MODELS)
def test_decode_logprobs_equal_prompt_logprobs(model):
    b = bundle(model)
    llm, t, r = rollout(b, "pinned")
    chosen, ids, lps = prefill_view(llm, t, r)
    assert torch.equal(chosen, r.logprobs)
    assert torch.equal(ids, r.top_ids) and torch.equal(lps, r.top_logprobs)


@pytest.mark.parametrize("model", MODELS)
def test_trainer_forward_reproduces_rollout_logprobs(model):
    b = bundle(model)
    llm, t, r = rollout(b, "pinned")
    tf = TrainerForward(llm)
    other = prompt(5, 23, b.config.vocab_size)  # scored in the same trainer batch
    lps = tf.logprobs([other, t + r.token_ids])[1]
    assert lps.dtype == torch.float32 and lps.shape == (len(t) + 15,)
    assert torch.equal(lps[len(t) - 1:], r.logprobs)


# the tiny models' shapes happen to give equal bits under stock here; SmolLM2's real ones do not
@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2"])
def test_stock_selection_breaks_decode_vs_prefill(model):
    b = bundle(model)
    llm, t, r = rollout(b, "stock")
    chosen, _, _ = prefill_view(llm, t, r)
    trainer = TrainerForward(llm).logprobs([t + r.token_ids])[0][len(t) - 1:]
    assert not (torch.equal(chosen, r.logprobs) and torch.equal(trainer, r.logprobs))


def test_trainer_rejects_bad_sequences():
    llm = make_llm(bundle("llama"), "pinned")
    tf = TrainerForward(llm)
    with pytest.raises(ValueError, match="at least 2"):
        tf.logprobs([[5]])
    with pytest.raises(ValueError, match="vocabulary"):
        tf.logprobs([[5, 10_000]])
