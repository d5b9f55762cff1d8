"""`LLM(..., rl=True)`: every request must carry a seed and sample
(temperature > 0); unseeded or greedy requests are refused at admission
with an error naming the field. Without rl=True both are accepted."""
from __future__ import annotations

import pytest

from detent.engine import SamplingParams
from rl_helpers import make_llm, model_bundle


def test_rl_mode_refuses_unseeded_and_greedy_requests():
    llm = make_llm(model_bundle("llama"), rl=True)
    with pytest.raises(ValueError, match="must carry a seed"):
        llm.generate([{"prompt_token_ids": [3, 4]}], SamplingParams(temperature=1.0, max_tokens=2), use_tqdm=False)
    with pytest.raises(ValueError, match=r"temperature must be > 0 \(got 0.0\)"):
        llm.generate([{"prompt_token_ids": [3, 4]}], SamplingParams(temperature=0.0, seed=1, max_tokens=2),
                     use_tqdm=False)
    out = llm.generate([{"prompt_token_ids": [3, 4]}], SamplingParams(temperature=0.7, top_p=0.9, seed=1, max_tokens=2),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2


def test_without_rl_mode_unseeded_requests_run():
    llm = make_llm(model_bundle("llama"))
    out = llm.generate([{"prompt_token_ids": [3, 4]}], SamplingParams(temperature=1.0, max_tokens=2), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 2
