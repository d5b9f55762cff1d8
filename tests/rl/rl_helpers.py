"""Shared pieces of the RL tests: the three tiny models, seeded T=1 rollouts,
and the rollout's chosen-token logprobs as a tensor (compared with torch.equal)."""
from __future__ import annotations

import torch

from detent.engine import SamplingParams
from engine_helpers import TINY_LLAMA, Bundle, bundle, make_llm, prompt

TINY_QWEN3 = {**TINY_LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "rms_norm_eps": 1e-6}

_QWEN3: list[Bundle] = []


def model_bundle(name: str) -> Bundle:
    """"llama", "qwen3" or "qwen3_moe" (tiny, random, float32), loaded once."""
    if name != "qwen3":
        return bundle(name)
    if not _QWEN3:
        from detent.models import ModelConfig, load_model
        mc = ModelConfig.from_hf(TINY_QWEN3)
        _QWEN3.append(Bundle("qwen3", load_model(mc, device="cpu", dtype="float32", load_format="dummy", seed=1),
                             mc, None))
    return _QWEN3[0]


def seeded(seed: int, max_tokens: int = 10) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, logprobs=0, ignore_eos=True)


def rollout(llm, prompts: list[list[int]], seeds: list[int], max_tokens: int = 10):
    """Seeded T=1 completions: (completion ids, chosen-token logprobs [n] fp32) per prompt."""
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], [seeded(s, max_tokens) for s in seeds],
                        use_tqdm=False)
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append((list(c.token_ids), torch.tensor([pos[t].logprob for t, pos in zip(c.token_ids, c.logprobs)])))
    return res


__all__ = ["TINY_QWEN3", "make_llm", "model_bundle", "prompt", "rollout", "seeded"]
