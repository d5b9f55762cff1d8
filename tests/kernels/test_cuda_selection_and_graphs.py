"""GPU selections through SelIR (cuda facts, checked on CPU) and the
CPU-checkable parts of the CUDA-graph runner."""
import pytest
import torch

from detent.engine.cuda_graph import (
    CudaGraphRunner,
    _check_graph_safe,
    default_capture_sizes,
)
from detent.selection.context import ForwardContext
from detent.selection import make_dispatcher
from detent.selection.facts import default_facts_for

LLAMA_8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": 14336, "vocab_size": 128256, "num_hidden_layers": 32}
FACTS = default_facts_for(LLAMA_8B, device="cuda", dtype="bfloat16", tp=1, page_size=16, max_context=8192,
                          triton=True, num_sms=132, arch="sm_90")
ATTN_SITE = (("num_heads", 32), ("num_kv_heads", 8), ("head_dim", 128), ("block_size", 16), ("dtype", "bfloat16"))
GEMM_SITE = (("n", 4096), ("k", 4096), ("dtype", "bfloat16"))


def _rt(num_seqs, q, k):
    return dict(num_tokens=num_seqs * q, num_seqs=num_seqs, max_seqlen_q=q, max_seqlen_k=k, total_kv=num_seqs * k)


def test_stock_split_moves_with_the_batch_pinned_does_not():
    stock, pinned = (make_dispatcher(FACTS, m) for m in ("stock", "pinned"))
    batches = [_rt(1, 1, 1024), _rt(8, 1, 1024), _rt(64, 1, 1024), _rt(1, 1024, 1024)]
    assert len({stock.select("attention", ATTN_SITE, rt)["split_tokens"] for rt in batches}) > 1
    sels = [pinned.select("attention", ATTN_SITE, rt) for rt in batches]
    assert {s["impl"] for s in sels} == {"triton_paged"}
    assert {s["split_tokens"] for s in sels} == {256}
    assert {s["rowsum"] for s in sels} == {"mma"}  # tile rows may follow the query length


def test_gemm_modes():
    stock, cons, pin = (make_dispatcher(FACTS, m) for m in ("stock", "conservative", "pinned"))
    assert stock.select("gemm", GEMM_SITE, _rt(3, 1, 9)) == {"impl": "torch"}
    assert cons.select("gemm", GEMM_SITE, _rt(1, 1, 9)) == cons.select("gemm", GEMM_SITE, _rt(256, 1, 9))
    assert pin.select("gemm", GEMM_SITE, _rt(1, 1, 9))["impl"] == "triton_persistent"
    with pytest.raises(ValueError):
        make_dispatcher(FACTS, "fast")


def test_capture_sizes():
    assert default_capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 32]
    assert default_capture_sizes(256)[-1] == 256
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(3) == [1, 2, 3]


def test_graph_runner_refuses_cpu_and_host_metadata_attention():
    with pytest.raises(ValueError, match="CUDA device"):
        CudaGraphRunner(torch.nn.Linear(2, 2), [], 16, None, torch.device("cpu"), max_model_len=64,
                        capture_sizes=[1])
    ctx = ForwardContext(attn=None)
    ctx.memo[("attention", (), ())] = {"impl": "paged_split", "split_tokens": 256}
    with pytest.raises(RuntimeError, match="host metadata"):
        _check_graph_safe(ctx)
    ctx.memo[("attention", (), ())] = {"impl": "triton_paged"}
    _check_graph_safe(ctx)
    # FlashAttention-4: in decode and whole-step graphs (their replays were tested on the device)
    ctx.memo[("attention", (), ())] = {"impl": "fa4"}
    _check_graph_safe(ctx)
