"""The RL sampling contract (`LLM(..., rl=True)`, `detent-serve --rl`).

An RL trainer recomputes every rollout token's logprob and must be able to
regenerate any rollout exactly, so under `rl=True` every request samples
(temperature > 0; top-k / top-p / min-p allowed) from an explicit seed. An
unseeded or greedy request is refused at admission with a ValueError that
names the field (the server turns it into a 400).
"""
from __future__ import annotations

from detent.sampling.params import SamplingParams


def check_rl_params(p: SamplingParams) -> None:
    if p.seed is None:
        raise ValueError("rl mode: every request must carry a seed (set seed; the engine runs with rl=True, "
                         "so rollouts are reproducible)")
    if p.greedy:
        raise ValueError(f"rl mode: temperature must be > 0 (got {p.temperature}); rollouts sample "
                         "from the policy")
