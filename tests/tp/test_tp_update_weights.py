"""`update_weights` at tensor_parallel_size = 2 (gloo): each rank takes its
shard of the full tensors, and generation then equals a fresh tp = 2 engine
loaded with those weights, bit for bit; a bad update is refused by every
rank before any rank copies."""
from __future__ import annotations

import pytest
import torch

from detent.engine import SamplingParams
from detent.engine.weight_update import WeightUpdateError
from detent.models import ModelConfig, load_model
from detent.engine import LLM
from test_tp_engine import TARGET, TINY, _write_model

def make_llm(path: str, tp: int, seed: int) -> LLM:
    return LLM(model=path, tensor_parallel_size=tp, load_format="dummy", device="cpu", seed=seed,
               max_model_len=128, kv_cache_memory_bytes=1 << 22)


SP = SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True)


def _run(llm):
    c = llm.generate([{"prompt_token_ids": TARGET}], SP, use_tqdm=False)[0].outputs[0]
    return list(c.token_ids), torch.tensor([[lp.logprob for lp in pos.values()] for pos in c.logprobs])


@pytest.mark.slow
def test_tp2_update_equals_a_fresh_engine(tmp_path):
    path = _write_model(tmp_path, "tiny")
    new = load_model(ModelConfig.from_hf(TINY), dtype="float32", load_format="dummy", seed=5)
    weights = [(n, s.dest.clone()) for n, s in new.weight_sources().items()]
    llm = make_llm(path, 2, 0)
    try:
        old = _run(llm)
        with pytest.raises(WeightUpdateError, match="shape"):
            llm.update_weights(weights[:-1] + [(weights[-1][0], torch.zeros(2, 2))])
        assert _run(llm)[0] == old[0] and torch.equal(_run(llm)[1], old[1])  # refused: nothing changed
        assert llm.update_weights(weights) == len(weights)
        got = _run(llm)
    finally:
        llm.llm_engine.shutdown()
    fresh_llm = make_llm(path, 2, 5)
    try:
        fresh = _run(fresh_llm)
    finally:
        fresh_llm.llm_engine.shutdown()
    assert got[0] == fresh[0] and torch.equal(got[1], fresh[1])
    assert not (old[0] == fresh[0] and torch.equal(old[1], fresh[1]))
