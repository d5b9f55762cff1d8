"""`update_weights` at tensor_parallel_size = 2 (gloo): each rank takes its
shard of the full tensors (the loader's own `Source` slicing), so every
rank's parameters then equal a fresh tp = 2 engine's loaded with those
weights, and generation (greedy and seeded T=1) equals that engine's, bit
for bit. A bad update is refused by every rank before any rank copies. An
update that reached only rank 0 does not give the fresh engine's outputs,
so the comparison can fail. The trainer refuses a tp > 1 engine."""
from __future__ import annotations

import pytest
import torch

from detent.engine import SamplingParams
from detent.engine.train_model import TrainerModel
from detent.engine.trainer import TrainerForward
from detent.engine.weight_update import WeightUpdateError, apply
from detent.models import ModelConfig, load_model
from detent.engine import LLM
from test_tp_engine import TARGET, TINY, _write_model


def make_llm(path: str, tp: int, seed: int, device: str = "cpu") -> LLM:
    return LLM(model=path, tensor_parallel_size=tp, load_format="dummy", device=device, seed=seed,
               max_model_len=128, kv_cache_memory_bytes=1 << 22)


SP = [SamplingParams(temperature=0, max_tokens=6, logprobs=3, ignore_eos=True),
      SamplingParams(temperature=1.0, seed=11, max_tokens=6, logprobs=0, ignore_eos=True)]


def _run(llm):
    """(token ids, logprobs) of a greedy request and a seeded T=1 one, run together."""
    outs = llm.generate([{"prompt_token_ids": TARGET}, {"prompt_token_ids": TARGET[:21]}], SP, use_tqdm=False)
    return [(list(c.token_ids), torch.tensor([[lp.logprob for lp in pos.values()] for pos in c.logprobs]))
            for c in (o.outputs[0] for o in outs)]


def _same(a, b) -> bool:
    return all(x[0] == y[0] and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def _rank_weights(st):  # collective_rpc: this rank's parameters
    return {n: p.detach().clone() for n, p in st.runner.model.state_dict().items()}


def _rank0_only_apply(st, items):  # a broken update that skips every rank but 0
    return apply(st.runner.model, items) if st.info.rank == 0 else 0


@pytest.mark.slow
def test_tp2_update_equals_a_fresh_engine(tmp_path):
    path = _write_model(tmp_path, "tiny")
    new = load_model(ModelConfig.from_hf(TINY), dtype="float32", load_format="dummy", seed=5)
    weights = [(n, s.dest.clone()) for n, s in new.weight_sources().items()]
    fresh_llm = make_llm(path, 2, 5)
    try:
        fresh, fresh_w = _run(fresh_llm), fresh_llm.llm_engine.runner.collective_rpc(_rank_weights)
    finally:
        fresh_llm.llm_engine.shutdown()
    llm = make_llm(path, 2, 0)
    try:
        with pytest.raises(NotImplementedError, match="tensor_parallel_size=1"):
            TrainerModel(llm)
        with pytest.raises(NotImplementedError, match="tensor_parallel_size=1"):
            TrainerForward(llm)
        old = _run(llm)
        with pytest.raises(WeightUpdateError, match="shape"):
            llm.update_weights(weights[:-1] + [(weights[-1][0], torch.zeros(2, 2))])
        assert _same(_run(llm), old)  # refused: nothing changed
        # the control: the update reaching rank 0 only (rank 1 keeps the old shards)
        llm.llm_engine.runner.collective_rpc(_rank0_only_apply, weights)
        llm.reset_prefix_cache()
        half = _run(llm)
        assert llm.update_weights(weights) == len(weights)
        got, got_w = _run(llm), llm.llm_engine.runner.collective_rpc(_rank_weights)
    finally:
        llm.llm_engine.shutdown()
    assert all(g.keys() == f.keys() and all(torch.equal(g[n], f[n]) for n in g) for g, f in zip(got_w, fresh_w))
    assert not torch.equal(got_w[0]["model.layers.0.self_attn.qkv_proj.weight"],
                           got_w[1]["model.layers.0.self_attn.qkv_proj.weight"])  # shards, not replicas
    assert _same(got, fresh)
    assert not _same(old, fresh)
    assert not _same(half, fresh), "an update that skipped rank 1 matched: this comparison could not fail"


# head_dim 64, bf16: shapes the GPU candidates (Triton) take
GPU_MODEL = dict(vocab_size=4096, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=64, torch_dtype="bfloat16")


@pytest.mark.gpu
def test_tp2_gpu_update_equals_a_fresh_engine(tmp_path):
    """On two GPUs (NCCL, CUDA graphs): the update reaches both ranks' graph-captured
    parameters in place; generation then == a fresh tp = 2 engine's."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    path = _write_model(tmp_path, "gpu", **GPU_MODEL)
    # drawn on CUDA, as the fresh engine's ranks draw theirs (a CPU generator gives other values)
    new = load_model(ModelConfig.from_hf({**TINY, **GPU_MODEL}), device="cuda", dtype="bfloat16",
                     load_format="dummy", seed=5)
    weights = [(n, s.dest.clone()) for n, s in new.weight_sources().items()]
    runs = {}
    for name, seed in (("updated", 0), ("fresh", 5)):
        llm = make_llm(path, 2, seed, "cuda")
        try:
            if name == "updated":
                runs["old"] = _run(llm)
                llm.update_weights(weights)
            runs[name] = _run(llm)
        finally:
            llm.llm_engine.shutdown()
    assert _same(runs["updated"], runs["fresh"])
    assert not _same(runs["old"], runs["fresh"])
