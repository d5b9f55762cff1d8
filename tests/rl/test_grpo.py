"""GRPO end to end on a tiny random Llama (engine in rl mode, seeded group
rollouts, trainer with gradients, AdamW, update_weights every step): under
selection="pinned" every completion token's trainer logprob equals the
rollout's on every step (match rate exactly 1.0, max |diff| 0.0); under
"stock" some step has a mismatch, so the logged rate can fail."""
from __future__ import annotations

import pytest
import torch

from detent.engine import LLM
from detent.models import ModelConfig, load_model
from detent.rl import GRPOConfig, TargetTokenTask, group_advantages, grpo_loss, train_grpo
from engine_helpers import TINY_LLAMA

CFG = GRPOConfig(steps=3, prompts_per_step=2, group_size=4, max_tokens=8, lr=1e-2, kl_coef=0.05, seed=3)


def _llm(selection: str, budget: int = 48) -> LLM:
    """A fresh model: update_weights writes into it."""
    mc = ModelConfig.from_hf(TINY_LLAMA)
    model = load_model(mc, device="cpu", dtype="float32", load_format="dummy", seed=0)
    return LLM.from_model(model, mc, device="cpu", selection=selection, rl=True, max_model_len=64,
                          num_gpu_blocks=40, max_num_batched_tokens=budget)


def test_three_grpo_steps_match_exactly_under_pinned():
    llm = _llm("pinned")
    w0 = llm.llm_engine.runner.model.model.norm.weight.clone()
    logs = train_grpo(llm, TargetTokenTask(TINY_LLAMA["vocab_size"]), CFG)
    assert len(logs) == 3
    assert all(log.match_rate == 1.0 and log.max_abs_diff == 0.0 for log in logs), logs
    assert all(8 <= log.num_tokens <= 2 * 4 * 8 for log in logs)  # EOS (id 1) may end a completion early
    assert not torch.equal(llm.llm_engine.runner.model.model.norm.weight, w0)  # the engine got new weights


def test_colocated_shared_weights_match_exactly():
    """share_weights=True: the optimizer steps the engine's own tensors (no copy)."""
    from dataclasses import replace
    llm = _llm("pinned")
    w = llm.llm_engine.runner.model.model.norm.weight
    w0 = w.detach().clone()
    logs = train_grpo(llm, TargetTokenTask(TINY_LLAMA["vocab_size"]), replace(CFG, share_weights=True, kl_coef=0.0))
    assert all(log.match_rate == 1.0 and log.max_abs_diff == 0.0 for log in logs), logs
    assert not torch.equal(w.detach(), w0)


def test_sequences_longer_than_the_budget_match_exactly():
    """10-token prompts + 8 tokens against a 12-token budget: the rollouts'
    prefills and the trainer's scoring both run in chunks."""
    logs = train_grpo(_llm("pinned", budget=12), TargetTokenTask(TINY_LLAMA["vocab_size"], prompt_len=10), CFG)
    assert all(log.match_rate == 1.0 and log.max_abs_diff == 0.0 for log in logs), logs
    # 8 completions a step: more than 16 tokens means one ran past 2 tokens, over the budget
    assert max(log.num_tokens for log in logs) > 16
    stock = train_grpo(_llm("stock", budget=12), TargetTokenTask(TINY_LLAMA["vocab_size"], prompt_len=10), CFG)
    assert min(log.match_rate for log in stock) < 1.0, stock  # measured 0.78, 0.83, 0.81


def test_stock_selection_shows_a_mismatch():
    logs = train_grpo(_llm("stock"), TargetTokenTask(TINY_LLAMA["vocab_size"]), CFG)
    assert min(log.match_rate for log in logs) < 1.0, logs
    assert max(log.max_abs_diff for log in logs) > 0.0


def test_grpo_loss_on_policy_is_the_advantage_weighted_logprob_gradient():
    """With old == new the ratio is 1 and the loss's gradient is -A/n per token."""
    lp = [torch.tensor([-1.0, -2.0], requires_grad=True), torch.tensor([-0.5], requires_grad=True)]
    adv = group_advantages(torch.tensor([[1.0, 0.0]])).flatten()
    assert torch.allclose(adv, torch.tensor([1.0, -1.0]), atol=1e-5)
    grpo_loss(lp, [x.detach() for x in lp], adv).backward()
    assert torch.allclose(lp[0].grad, torch.tensor([-0.25, -0.25]), atol=1e-5)
    assert torch.allclose(lp[1].grad, torch.tensor([0.5]), atol=1e-5)



def test_grpo_loss_refuses_misaligned_inputs():
    """old_logprobs split [2, 3] against logprobs [3, 2] has the same total: the tokens were
    paired across completions and a loss came back, silently wrong. A per-completion length
    mismatch (old or ref), no completions, advantages that are not a tensor, a negative
    clip_eps (clamp(1.5, 0.5) is 0.5 everywhere) or KL asked for without a reference are
    each refused, naming the argument."""
    lp = [torch.zeros(3, requires_grad=True), torch.zeros(2, requires_grad=True)]
    old = [torch.zeros(3), torch.zeros(2)]
    adv = torch.tensor([1.0, -1.0])
    with pytest.raises(ValueError, match=r"old_logprobs\[0\] has 2 tokens, logprobs\[0\] has 3"):
        grpo_loss(lp, [torch.zeros(2), torch.zeros(3)], adv)
    with pytest.raises(ValueError, match=r"ref_logprobs\[1\] has 3 tokens, logprobs\[1\] has 2"):
        grpo_loss(lp, old, adv, ref_logprobs=[torch.zeros(3), torch.zeros(3)], kl_coef=0.1)
    with pytest.raises(ValueError, match="2 logprob tensors but 1 ref_logprobs"):
        grpo_loss(lp, old, adv, ref_logprobs=[torch.zeros(3)], kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logprobs"):
        grpo_loss(lp, old, adv, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef must be >= 0"):
        grpo_loss(lp, old, adv, ref_logprobs=old, kl_coef=-0.1)
    with pytest.raises(ValueError, match="clip_eps must be >= 0"):
        grpo_loss(lp, old, adv, clip_eps=-0.2)
    with pytest.raises(ValueError, match="at least one completion"):
        grpo_loss([], [], torch.zeros(0))
    with pytest.raises(TypeError, match="advantages must be a tensor"):
        grpo_loss(lp, old, [1.0, -1.0])
    grpo_loss(lp, old, adv, ref_logprobs=old, kl_coef=0.1).backward()  # aligned: fine

def test_config_is_validated():
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        GRPOConfig(group_size=1)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        GRPOConfig(temperature=0.0)


@pytest.mark.parametrize("field, value, match", [
    ("clip_eps", -0.2, "clip_eps must be >= 0"), ("kl_coef", -0.1, "kl_coef must be >= 0"),
    ("kl_coef", float("nan"), "kl_coef must be >= 0"), ("lr", -1e-5, "lr must be >= 0"),
    ("lr", float("nan"), "lr must be >= 0"), ("weight_decay", -0.1, "weight_decay must be >= 0"),
    ("top_p", 0.0, r"top_p must be in \(0, 1\]"), ("top_p", 1.5, r"top_p must be in \(0, 1\]"),
    ("max_grad_norm", 0.0, "max_grad_norm must be > 0"), ("max_grad_norm", -1.0, "max_grad_norm must be > 0"),
    ("temperature", float("inf"), "temperature must be > 0 and finite"),
    ("steps", 1.5, "steps must be an integer"), ("group_size", "8", "group_size must be an integer")])
def test_config_refuses_values_that_would_train_wrong(field, value, match):
    """Each was accepted: a negative clip_eps or kl_coef inverts its term, a negative lr ascends
    the loss, max_grad_norm <= 0 zeroes or flips every gradient, NaN poisons the weights, and
    top_p or a non-integer count failed only later, inside the first step."""
    with pytest.raises(ValueError, match=f"GRPOConfig.{match}"):
        GRPOConfig(**{field: value})


def test_integer_rewards_train():
    """A task whose reward is an int or bool (a pass/fail check) failed the first step inside
    group_advantages (torch's mean() of an integer tensor): rewards are float32. A rewards
    tensor that is not [P, G >= 2] is refused rather than normalized as one group."""
    class PassFail(TargetTokenTask):
        def reward(self, problem, completion_ids):
            return int(problem.answer in completion_ids)
    cfg = GRPOConfig(steps=1, prompts_per_step=2, group_size=4, max_tokens=4, lr=1e-2, seed=3)
    logs = train_grpo(_llm("pinned"), PassFail(TINY_LLAMA["vocab_size"]), cfg)
    assert logs[0].match_rate == 1.0
    assert torch.equal(group_advantages(torch.tensor([[1, 0], [1, 1]])),
                       group_advantages(torch.tensor([[1.0, 0.0], [1.0, 1.0]])))
    for bad in (torch.tensor([1.0, 0.0, 1.0]), torch.tensor([[1.0], [0.0]])):
        with pytest.raises(ValueError, match=r"rewards must be a tensor \[P prompts, G >= 2 samples each\]"):
            group_advantages(bad)


def test_master_weights_keep_small_bf16_updates():
    """Plain AdamW at lr 1e-4 never moves a bf16 weight of 1.0 (each step rounds
    away); the fp32 masters accumulate the steps and the weight moves."""
    from detent.rl.optim import MasterWeightsAdamW
    plain = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    mastered = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    opt_plain, opt_master = torch.optim.AdamW([plain], lr=1e-4), MasterWeightsAdamW([mastered], lr=1e-4)
    for _ in range(100):
        for p, opt in ((plain, opt_plain), (mastered, opt_master)):
            opt.zero_grad()
            p.grad = torch.ones_like(p)
            opt.step()
    assert torch.equal(plain, torch.ones(4, dtype=torch.bfloat16))
    assert (mastered < 1.0).all() and mastered.dtype == torch.bfloat16


def test_arithmetic_reward_reads_the_answer():
    from detent.rl import ArithmeticTask, Problem

    class Tok:  # one character per id
        def apply_chat_template(self, msgs, add_generation_prompt=True):
            return msgs[0]["content"]

        def encode(self, text, add_special_tokens=False):
            return [ord(c) for c in text]

        def decode(self, ids, skip_special_tokens=True):
            return "".join(map(chr, ids))
    task = ArithmeticTask(Tok())
    p = Problem((), 9)
    enc = Tok().encode
    assert [task.reward(p, enc(t)) for t in ("9", " 9.", "1 + 8 equals 9.", "10", "nine", "-9")] == \
        [1.0, 1.0, 0.5, 0.0, 0.0, 0.0]
    import random
    q = task.sample(random.Random(0))
    a, b = map(int, "".join(map(chr, q.prompt_ids)).removeprefix("What is ").split("?")[0].split(" + "))
    assert q.answer == a + b
