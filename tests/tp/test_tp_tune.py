"""`detent.tune.tune` on a tensor-parallel engine (2 gloo ranks, CPU): the
profile comes from rank 0's dispatcher, every candidate is installed on
every rank (collective_rpc) and timed with the real cost model, and the
tuned tuple serves at tp = 2."""
from __future__ import annotations

from detent import LLM, SamplingParams
from detent.selection import CommitmentTuple
from detent.tune import tune
from detent.workloads import make


def test_tune_at_tp2_installs_on_every_rank(tmp_path):
    from detent.models.tiny import write_tiny_llama
    model = write_tiny_llama(str(tmp_path / "tiny"))
    kw = dict(tensor_parallel_size=2, device="cpu", dtype="float32", max_model_len=256, max_num_batched_tokens=32)
    llm = LLM(model=model, **kw)
    try:
        out = tune(llm, make("W-C", num_requests=2, max_len=40), families=["gemm"], max_candidates=2,
                   min_fraction=1.0, refine=0, interactions=0)
        assert out.facts["tp"] == 2
        assert sum(sum(c.values()) for c in out.profile["attention"].values()) > 0
        assert sum(sum(c.values()) for c in out.profile["allreduce"].values()) > 0  # a tp = 2 family
        gemm = out.result.families["gemm"]
        assert [t["assignment"] for t in gemm.tried] == [{"chunk": 16}, {"chunk": 1}]
        assert all(t["costs"][1.0] > 0 for t in gemm.tried)
        ranks = llm.llm_engine.runner.collective_rpc(_installed_chunk)
        assert ranks[0] == ranks[1]  # both ranks run the last candidate installed
    finally:
        llm.shutdown()
    path = str(tmp_path / "t.json")
    out.result.chosen.save(path)
    served = LLM(model=model, tuple=path, **kw)
    try:
        assert served.llm_engine.fingerprint().tuple_hash == CommitmentTuple.load(path).hash
        o = served.generate([{"prompt_token_ids": [11, 12, 13]}], SamplingParams(max_tokens=2, ignore_eos=True),
                            use_tqdm=False)
        assert len(o[0].outputs[0].token_ids) == 2
    finally:
        served.shutdown()


def _installed_chunk(st):
    return st.runner.dispatcher.tuple.families["gemm"]["knobs"]["chunk"]
