"""`detent tune` on the GPU: both cost models on a small bf16 Llama with CUDA
graphs on, so every candidate is a new dispatcher and a recapture; the tuned
tuple passes the battery's quick cells and the same cells fail under stock.
The model has a word-level tokenizer (every request here is token ids), so
the test needs no embedded model's package on the GPU machine."""
import pytest

from detent import LLM
from detent.battery import OfflineBackend, run_battery
from detent.battery_cells import select
from detent.selection.compiler.tune_space import family_space
from detent.tune import tune
from detent.workloads import make

pytestmark = pytest.mark.gpu
# a KV cache of its own size: under a share of the card, memory that the file's earlier engines left
# in torch's cache (or other tests in the session) can leave no block (first GPU run, lease 28)
KW = dict(device="cuda", dtype="bfloat16", max_model_len=1024, max_num_seqs=64, max_num_batched_tokens=32,
          kv_cache_memory_bytes=1 << 26)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    from detent.models.tiny import write_tiny_llama
    return write_tiny_llama(str(tmp_path_factory.mktemp("tiny")), hidden=256, layers=2, tokenizer="wordlevel")


@pytest.mark.parametrize("cost", ["engine", "kernels"])
def test_tune_on_gpu_serves_an_invariant_tuple(model, tmp_path, cost):
    llm = LLM(model=model, **KW)
    try:
        out = tune(llm, make("W-C", num_requests=8, max_len=512), cost=cost, max_candidates=8, refine=1)
        att = out.result.families["attention"]
        assert att.chosen in family_space(out.facts, "attention").legal
        assert out.result.base_cost > 0 and len(att.tried) >= 2
    finally:
        llm.shutdown()
    path = str(tmp_path / "t.json")
    out.result.chosen.save(path)
    for selection, tuple_path in (("pinned", path), ("stock", None)):
        llm = LLM(model=model, selection=selection, tuple=tuple_path, **KW)
        try:
            results = run_battery(OfflineBackend(llm), select("quick"))
        finally:
            llm.shutdown()
        if selection == "pinned":
            assert all(r.passed for r in results), [(r.cell, r.differences) for r in results if not r.passed]
        else:
            assert any(not r.passed for r in results)


def test_kernel_cost_times_calls_inside_cuda_graphs(model, tmp_path):
    # KernelCost on CUDA: each bucketed call captured in a graph and timed by events (the device's
    # time, not the host's launch); none falls back to the host clock for gemm and attention
    from detent.selection import default_tuple
    from detent.tune_cost import profile_workload
    from detent.tune_engine import TupleInstaller, engine_facts
    from detent.tune_kernels import KernelCost
    llm = LLM(model=model, **KW)
    try:
        facts = engine_facts(llm)
        base = default_tuple(facts)
        calls = profile_workload(TupleInstaller(llm, str(tmp_path)), base, make("W-C", num_requests=4, max_len=512))
        cost = KernelCost(calls, facts, str(tmp_path), families=["gemm", "attention"])
        assert cost.measure(base, 1.0) > 0
        assert cost.graph_timed == len(cost.inputs) and cost.host_timed == 0
    finally:
        llm.shutdown()
