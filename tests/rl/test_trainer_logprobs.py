"""The trainer's logprobs are the rollout's, bit for bit (torch.equal), under
selection="pinned": seeded T=1 rollouts of tiny Llama, Qwen3 and Qwen3-MoE
in a co-batched and chunked prefill, a prefix-cache hit and preemptions, all
scored in one packed trainer call with gradients on, and rollouts longer
than one step's token budget, which the trainer scores in chunks. With
selection="stock" some logprob differs, so the comparison can fail."""
from __future__ import annotations

import pytest
import torch

from detent.engine.train_model import TrainerModel
from rl_helpers import make_llm, model_bundle, prompt, rollout

BUDGET = 48  # one deployment for every cell (the budget is a deployment fact): sequences fit it whole


def _cells(b, sel):
    """(prompt, completion ids, rollout logprobs, what the cell exercised) for each rollout."""
    V = b.config.vocab_size
    prompts = [prompt(100 + i, 5 + 6 * i, V) for i in range(5)]
    out = []
    llm = make_llm(b, sel, max_num_batched_tokens=BUDGET)  # 5 prompts: prefills cut by the budget
    for p, (c, lp) in zip(prompts, rollout(llm, prompts, seeds=list(range(5)))):
        out.append((p, c, lp))
    again = rollout(llm, prompts[3:4], seeds=[77])  # prefix-cache hit on prompt 3
    assert llm.llm_engine.stats()["prefix_cache_hits"] > 0
    out.append((prompts[3], *again[0]))
    tight = make_llm(b, sel, max_num_batched_tokens=BUDGET, num_gpu_blocks=17)  # 16 blocks for 22 needed
    for p, (c, lp) in zip(prompts * 2, rollout(tight, prompts * 2, seeds=list(range(10, 20)))):
        out.append((p, c, lp))
    assert tight.llm_engine.stats()["num_preemptions"] > 0
    return llm, out


def _score(llm, cells):
    tm = TrainerModel(llm, logprob_chunk=5)
    lps = tm([p + c for p, c, _ in cells], [len(p) for p, _, _ in cells])
    assert all(lp.requires_grad and lp.dtype == torch.float32 for lp in lps)
    return [torch.equal(lp.detach(), want) for lp, (_, _, want) in zip(lps, cells)]


@pytest.mark.parametrize("model", ["llama", "qwen3", "qwen3_moe"])
def test_trainer_logprobs_equal_rollout_logprobs(model):
    llm, cells = _cells(model_bundle(model), "pinned")
    assert all(len(c) == 10 for _, c, _ in cells)
    assert all(_score(llm, cells))


@pytest.mark.parametrize("model", ["llama", "qwen3_moe"])
def test_stock_selection_breaks_trainer_equality(model):
    llm, cells = _cells(model_bundle(model), "stock")
    assert not all(_score(llm, cells)), "stock matched every rollout: this comparison could not fail"


def test_checkpointed_layers_give_the_same_bits_and_gradients():
    b = model_bundle("llama")
    llm = make_llm(b, "pinned", max_num_batched_tokens=BUDGET)
    seqs = [prompt(7, 20, b.config.vocab_size), prompt(8, 33, b.config.vocab_size)]
    grads, lps = [], []
    for ckpt in (False, True):
        tm = TrainerModel(llm, checkpoint_layers=ckpt, logprob_chunk=4 if ckpt else 1024)
        lp = tm(seqs)
        sum(x.sum() for x in lp).backward()
        lps.append(torch.cat(lp).detach())
        grads.append(torch.cat([p.grad.flatten() for p in tm.parameters()]))
    assert torch.equal(lps[0], lps[1])
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-5, atol=1e-6)


LONG_BUDGET = 16  # every prompt, and every prompt + completion, is longer than one step


def _long_cells(b, sel):
    """Seeded T=1 rollouts whose prompt + completion (32 .. 46 tokens) exceed
    the token budget, co-batched so the engine cuts their prefills."""
    V = b.config.vocab_size
    llm = make_llm(b, sel, max_num_batched_tokens=LONG_BUDGET)
    prompts = [prompt(200 + i, 20 + 7 * i, V) for i in range(3)]
    return llm, [(p, c, lp) for p, (c, lp) in zip(prompts, rollout(llm, prompts, [1, 2, 3], max_tokens=12))]


@pytest.mark.parametrize("model", ["llama", "qwen3", "qwen3_moe"])
def test_sequences_longer_than_the_budget_are_scored_in_chunks(model):
    """The trainer runs each sequence in chunks over steps, each step under
    the engine's budget, a later chunk attending to the earlier chunks' KV;
    pinned, its logprobs are the rollout's bit for bit, with gradients."""
    llm, cells = _long_cells(model_bundle(model), "pinned")
    assert all(len(p) + len(c) > LONG_BUDGET for p, c, _ in cells)
    assert all(_score(llm, cells))
    with torch.no_grad():  # the scoring-only pass chunks the same way (TrainerForward)
        from detent.engine.trainer import TrainerForward
        plain = TrainerForward(llm).logprobs([p + c for p, c, _ in cells])
    assert all(torch.equal(lp[len(p) - 1:], want) for lp, (p, _, want) in zip(plain, cells))


@pytest.mark.parametrize("model", ["llama", "qwen3", "qwen3_moe"])
def test_stock_selection_breaks_chunked_trainer_equality(model):
    llm, cells = _long_cells(model_bundle(model), "stock")
    assert not all(_score(llm, cells)), "stock matched every rollout: this comparison could not fail"


def test_plan_chunks_fills_each_step_to_the_budget():
    from detent.engine.trainer import plan_chunks
    assert plan_chunks([9, 14], 5) == [[(0, 0, 5)], [(0, 5, 4), (1, 0, 1)], [(1, 1, 5)], [(1, 6, 5)], [(1, 11, 3)]]
    assert plan_chunks([3, 4, 2], 16) == [[(0, 0, 3), (1, 0, 4), (2, 0, 2)]]
    assert plan_chunks([40], 16) == [[(0, 0, 16)], [(0, 16, 16)], [(0, 32, 8)]]


def test_trainer_refuses_bad_input():
    b = model_bundle("llama")
    llm = make_llm(b, "pinned", max_num_batched_tokens=BUDGET)
    tm = TrainerModel(llm)
    with pytest.raises(ValueError, match="max_model_len=256"):
        tm([[3] * 300])
    with pytest.raises(ValueError, match=r"num_prompt_tokens\[0\]=5"):
        tm([[3, 4, 5]], [5])
    with pytest.raises(ValueError, match="vocabulary"):
        tm([[3, 10_000]])



def test_trainer_refuses_what_is_not_token_ids():
    """A str sequence was scored as its characters' digits ("3456" as [3, 4, 5, 6]) and float
    ids or prompt lengths were truncated, silently; each is now a ValueError naming the entry.
    Integer tensors and NumPy arrays are token ids."""
    from detent.engine.trainer import TrainerForward
    b = model_bundle("llama")
    llm = make_llm(b, "pinned", max_num_batched_tokens=BUDGET)
    tm, tf = TrainerModel(llm), TrainerForward(llm)
    for score in (tm, tf.logprobs):
        with pytest.raises(ValueError, match=r"sequences\[0\] must be a list of token ids \(integers\), got str"):
            score(["3456"])
        with pytest.raises(ValueError, match=r"sequences\[1\] must be a list of token ids .* element 4.5 \(float\)"):
            score([[3, 4], [3, 4.5]])
        with pytest.raises(ValueError, match="sequences must be a list of token-id lists, got NoneType"):
            score(None)
    with pytest.raises(ValueError, match=r"num_prompt_tokens must be a list of integers, got element 1.5"):
        tm([[3, 4, 5]], [1.5])
    with pytest.raises(ValueError, match=r"num_prompt_tokens must be a list of integers, got int"):
        tm([[3, 4, 5]], 1)
    want = tm([[3, 4, 5, 6]], [2])[0]
    assert torch.equal(tm([torch.tensor([3, 4, 5, 6])], [torch.tensor(2)])[0], want)

def test_entropy_comes_with_the_same_logprob_bits():
    b = model_bundle("qwen3")
    llm = make_llm(b, "pinned", max_num_batched_tokens=BUDGET)
    seqs = [prompt(3, 12, b.config.vocab_size), prompt(4, 30, b.config.vocab_size)]
    tm = TrainerModel(llm, logprob_chunk=7)
    lps, ents = tm.logprobs_and_entropy(seqs, [4, 10])
    assert all(torch.equal(a.detach(), c.detach()) for a, c in zip(lps, tm(seqs, [4, 10])))
    with torch.no_grad():  # every position, other chunking: the same rows give the same bits
        full = TrainerModel(llm).logprobs_and_entropy(seqs)[1]
    for e, f, p in zip(ents, full, [4, 10]):
        torch.testing.assert_close(e.detach(), f[p - 1:], rtol=0, atol=0)
        assert (e > 0).all() and (e <= torch.log(torch.tensor(float(b.config.vocab_size)))).all()
    sum(e.sum() for e in ents).backward()
    assert all(p.grad is not None for p in tm.parameters())
