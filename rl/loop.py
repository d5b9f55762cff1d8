"""`train_grpo`: rollout -> reward -> trainer logprobs with gradients ->
GRPO loss -> AdamW -> weights back into the engine, every step.

Rollouts are seeded (`SamplingParams(n=group_size, seed=...)`, the seeds
drawn from `GRPOConfig.seed` and the step), so a run is reproducible and
works under the engine's `rl=True` contract. Each step logs the reward,
the fraction of completion tokens whose trainer logprob `==` the rollout's,
the largest |difference|, and the time split.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass
from typing import Callable

import torch

from detent.engine.train_model import TrainerModel
from detent.rl.grpo import group_advantages, grpo_loss
from detent.rl.optim import MasterWeightsAdamW
from detent.rl.task import Task
from detent.sampling.params import SamplingParams


@dataclass(frozen=True)
class GRPOConfig:
    steps: int = 200
    prompts_per_step: int = 8
    group_size: int = 8
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    lr: float = 1e-5
    weight_decay: float = 0.0
    clip_eps: float = 0.2
    kl_coef: float = 0.0  # > 0: k3 KL to the initial policy (a frozen copy)
    max_grad_norm: float | None = 1.0
    seed: int = 0
    share_weights: bool = False  # colocated: train the engine's own tensors (no copy to sync)
    checkpoint_layers: bool = False
    logprob_chunk: int = 1024

    def __post_init__(self):
        for name in ("steps", "prompts_per_step", "group_size", "max_tokens", "logprob_chunk", "seed"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"GRPOConfig.{name} must be an integer, got {v!r}")
            if name != "seed" and v < 1:
                raise ValueError(f"GRPOConfig.{name} must be >= 1, got {v}")
        if self.group_size < 2:
            raise ValueError(f"GRPOConfig.group_size must be >= 2 (advantages are group-relative), got {self.group_size}")
        # NaN fails every check; a negative clip_eps or kl_coef inverts its term, and a max_grad_norm <= 0
        # zeroes (or flips the sign of) every gradient
        for name, ok, want in (("temperature", lambda v: 0 < v < math.inf, "> 0 and finite"),
                               ("top_p", lambda v: 0 < v <= 1, "in (0, 1]"),
                               ("lr", lambda v: 0 <= v < math.inf, ">= 0 and finite"),
                               ("weight_decay", lambda v: 0 <= v < math.inf, ">= 0 and finite"),
                               ("clip_eps", lambda v: 0 <= v < math.inf, ">= 0 and finite"),
                               ("kl_coef", lambda v: 0 <= v < math.inf, ">= 0 and finite"),
                               ("max_grad_norm", lambda v: 0 < v < math.inf, "> 0 and finite (or None)")):
            v = getattr(self, name)
            if name == "max_grad_norm" and v is None:
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not ok(v):
                raise ValueError(f"GRPOConfig.{name} must be {want}, got {v!r}")
        if self.kl_coef and self.share_weights:
            raise ValueError("kl_coef > 0 needs a frozen reference copy; it is not supported with share_weights")


@dataclass(frozen=True)
class StepLog:
    step: int
    reward_mean: float
    match_rate: float  # completion tokens with trainer logprob == rollout logprob
    max_abs_diff: float
    num_tokens: int
    loss: float
    rollout_s: float
    trainer_s: float  # forward + backward + optimizer step
    sync_s: float

    def as_dict(self) -> dict:
        return asdict(self)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _rollout(llm, task: Task, cfg: GRPOConfig, rng: random.Random):
    problems = [task.sample(rng) for _ in range(cfg.prompts_per_step)]
    params = [SamplingParams(n=cfg.group_size, temperature=cfg.temperature, top_p=cfg.top_p,
                             seed=rng.getrandbits(63), max_tokens=cfg.max_tokens, logprobs=0)
              for _ in problems]
    outs = llm.generate([{"prompt_token_ids": list(p.prompt_ids)} for p in problems], params, use_tqdm=False)
    samples = []  # (problem, completion ids, rollout logprobs [n] fp32)
    for p, o in zip(problems, outs):
        for c in o.outputs:
            lps = torch.tensor([pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs)], dtype=torch.float32)
            samples.append((p, list(c.token_ids), lps))
    return samples


def train_grpo(llm, task: Task, cfg: GRPOConfig = GRPOConfig(),
               on_step: Callable[[StepLog], None] | None = None) -> list[StepLog]:
    eng = llm.llm_engine
    device = eng.state.device
    trainer = TrainerModel(llm, share_weights=cfg.share_weights, checkpoint_layers=cfg.checkpoint_layers,
                           logprob_chunk=cfg.logprob_chunk)
    ref = None
    if cfg.kl_coef:
        ref = TrainerModel(llm, logprob_chunk=cfg.logprob_chunk).requires_grad_(False).eval()
    opt = MasterWeightsAdamW(trainer.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)  # fp32 masters
    logs = []
    for step in range(cfg.steps):
        rng = random.Random(cfg.seed * 1_000_003 + step)
        t0 = time.perf_counter()
        samples = _rollout(llm, task, cfg, rng)
        t1 = time.perf_counter()
        rewards = torch.tensor([float(task.reward(p, ids)) for p, ids, _ in samples],  # an int or bool reward too
                               dtype=torch.float32).view(-1, cfg.group_size)
        adv = group_advantages(rewards).flatten()
        keep = [i for i, (_, ids, _) in enumerate(samples) if ids]
        seqs = [list(samples[i][0].prompt_ids) + samples[i][1] for i in keep]
        starts = [len(samples[i][0].prompt_ids) for i in keep]
        old = [samples[i][2] for i in keep]
        trainer.train()
        lps = trainer(seqs, starts)
        new = torch.cat(lps).detach().cpu()  # one device-to-host copy, not one per completion
        old_all = torch.cat(old)
        ref_lps = None
        if ref is not None:
            with torch.no_grad():
                ref_lps = ref(seqs, starts)
        loss = grpo_loss(lps, old, adv[keep].to(device), cfg.clip_eps, ref_lps, cfg.kl_coef)
        opt.zero_grad()
        loss.backward()
        if cfg.max_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_(trainer.parameters(), cfg.max_grad_norm)
        opt.step()
        _sync(device)
        t2 = time.perf_counter()
        if cfg.share_weights:
            llm.reset_prefix_cache()  # the engine already runs the new tensors; its cached KV is stale
        else:
            llm.update_weights(trainer.checkpoint_tensors())
        _sync(device)
        t3 = time.perf_counter()
        log = StepLog(step, float(rewards.mean()), float((new == old_all).float().mean()),
                      float((new - old_all).abs().max()), int(new.numel()), float(loss.detach()),
                      t1 - t0, t2 - t1, t3 - t2)
        logs.append(log)
        if on_step is not None:
            on_step(log)
    return logs
