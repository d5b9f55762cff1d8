"""Warm start (engine/warmup.py) on the GPU selections: a tiny Llama with CUDA
facts runs its synthetic steps through the Triton candidates (GEMM, paged
attention, row-wise, the fused Gumbel draw) under Triton's interpreter, on the
scratch KV blocks. Checks the steps' metadata is valid for the GPU kernels and
that nothing SelIR finds reachable is left out. Comparator: `==` on sets."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "engine"))  # engine_helpers

from engine_helpers import TINY_LLAMA  # noqa: E402
from detent.engine.kv_cache import KVCacheSpec, allocate_kv_caches  # noqa: E402
from detent.engine.model_runner import ModelRunner  # noqa: E402
from detent.engine.warmup import Limits, warm_up  # noqa: E402
from detent.models import ModelConfig, load_model  # noqa: E402
from detent.selection import make_dispatcher  # noqa: E402
from detent.selection.facts import default_facts_for  # noqa: E402


def test_warm_steps_run_through_the_triton_candidates():
    mc = ModelConfig.from_hf(TINY_LLAMA)
    model = load_model(mc, device="cpu", dtype="float32", load_format="dummy", seed=0)
    facts = default_facts_for(TINY_LLAMA, device="cuda", dtype="float32", max_context=128, max_num_batched_tokens=64,
                              max_num_seqs=8, triton=True, num_sms=8, arch="sm90")
    d = make_dispatcher(facts, "pinned")
    d.record_calls = True
    spec = KVCacheSpec(mc.num_layers, mc.num_kv_heads, mc.head_dim, torch.float32, 16)
    runner = ModelRunner(model, allocate_kv_caches(spec, 64, torch.device("cpu")), 16, d, torch.device("cpu"))
    plan = warm_up(runner, facts, Limits(64, 8, 128), progress=False)
    assert plan.uncovered == []
    ran = {(fam, d._selectors[(fam, site)](**dict(rt))["impl"]) for fam, site, rt in d.calls}
    assert {("gemm", "triton_persistent"), ("attention", "triton_paged"), ("gumbel", "triton_rowwise"),
            ("norm", "triton_rowwise"), ("logsoftmax", "triton_rowwise"), ("top_p", "triton_rowwise")} <= ran
    assert any(len(s.query_lens) > 1 and max(s.kv_lens) > max(s.query_lens) for s in plan.shapes)  # mixed, paged
