"""The GRPO objective (group-relative advantages, clipped ratio, optional KL).

On-policy, the "old" logprobs are the rollout's, which Detent reports bit
for bit equal to the trainer's under selection="pinned": the ratio is then
exactly 1 on every token and the clip never acts on noise.
"""
from __future__ import annotations

import torch


def group_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """rewards [P, G] (P prompts, G samples each) -> (r - group mean) / (group std + eps),
    float32 (integer or bool rewards are cast)."""
    if not isinstance(rewards, torch.Tensor) or rewards.dim() != 2 or rewards.shape[1] < 2:
        got = list(rewards.shape) if isinstance(rewards, torch.Tensor) else type(rewards).__name__
        raise ValueError(f"rewards must be a tensor [P prompts, G >= 2 samples each], got {got}: "
                         "advantages are relative to each prompt's group")
    if not rewards.is_floating_point():
        rewards = rewards.float()
    mean = rewards.mean(-1, keepdim=True)
    std = rewards.std(-1, keepdim=True, unbiased=False)
    return (rewards - mean) / (std + eps)


def grpo_loss(logprobs: list[torch.Tensor], old_logprobs: list[torch.Tensor], advantages: torch.Tensor,
              clip_eps: float = 0.2, ref_logprobs: list[torch.Tensor] | None = None,
              kl_coef: float = 0.0) -> torch.Tensor:
    """Per completion i: logprobs[i] [n_i] (with grad), old_logprobs[i] [n_i]
    (the rollout's), advantages [N]. Token-mean of
    -min(ratio * A, clip(ratio, 1 - eps, 1 + eps) * A) (+ kl_coef * k3 KL to
    the reference), each completion's tokens averaged, then the completions."""
    if not isinstance(advantages, torch.Tensor):
        raise TypeError(f"advantages must be a tensor [N], got {type(advantages).__name__}")
    if len(logprobs) != len(old_logprobs) or len(logprobs) != advantages.numel():
        raise ValueError(f"{len(logprobs)} logprob tensors, {len(old_logprobs)} old, {advantages.numel()} advantages")
    if not logprobs:
        raise ValueError("grpo_loss needs at least one completion (logprobs is empty)")
    if not clip_eps >= 0:
        raise ValueError(f"clip_eps must be >= 0, got {clip_eps}")
    # token i of completion j pairs with old[j][i] (and ref[j][i]): equal totals with other splits would misalign
    _same_lengths("old_logprobs", logprobs, old_logprobs)
    if not kl_coef >= 0:
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if kl_coef and ref_logprobs is None:
        raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs (the reference policy's logprobs)")
    if ref_logprobs is not None and kl_coef:
        if len(ref_logprobs) != len(logprobs):
            raise ValueError(f"{len(logprobs)} logprob tensors but {len(ref_logprobs)} ref_logprobs")
        _same_lengths("ref_logprobs", logprobs, ref_logprobs)
    lp = torch.cat(logprobs)  # every completion's tokens, back to back: one op per term, not per completion
    dev = lp.device
    n = torch.tensor([x.numel() for x in logprobs], device=dev)
    a = advantages.to(dev).repeat_interleave(n, output_size=lp.numel())  # output_size: no device sync
    ratio = torch.exp(lp - torch.cat(old_logprobs).to(dev))
    loss = -torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    if ref_logprobs is not None and kl_coef:
        d = torch.cat(ref_logprobs).to(dev) - lp
        loss = loss + kl_coef * (torch.exp(d) - d - 1)  # k3: unbiased, >= 0
    # each completion's token mean, then the mean over completions: token t of completion i weighs 1 / (n_i N)
    return (loss / (n * len(logprobs)).repeat_interleave(n, output_size=lp.numel())).sum()


def _same_lengths(name: str, logprobs: list[torch.Tensor], other: list[torch.Tensor]) -> None:
    for j, (x, y) in enumerate(zip(logprobs, other)):
        if x.numel() != y.numel():
            raise ValueError(f"{name}[{j}] has {y.numel()} tokens, logprobs[{j}] has {x.numel()}")
