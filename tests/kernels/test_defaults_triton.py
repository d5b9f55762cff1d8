"""The Triton default selections per mode (kernels/defaults_triton.py) and the
CPU-checkable parts of the CUDA-graph runner."""
import pytest
import torch

from detent.engine.cuda_graph import CudaGraphRunner, _check_graph_safe, default_capture_sizes
from detent.engine.forward_context import ForwardContext
from detent.kernels.defaults_triton import TritonDefaults, fa3_num_splits

FACTS = {"max_context": 8192, "num_sms": 132}
ATTN_SITE = {"num_heads": 32, "num_kv_heads": 8, "head_dim": 128, "block_size": 16, "dtype": "bfloat16"}


def _rt(num_seqs, q, k):
    return dict(num_tokens=num_seqs * q, num_seqs=num_seqs, max_seqlen_q=q, max_seqlen_k=k, total_kv=num_seqs * k)


def test_fa3_split_count_follows_the_batch():
    # one 1k-context decode fills few SMs: split; 64 of them fill the GPU: no split
    assert [fa3_num_splits(b, 8, 1, 1024, 4, 132) for b in (1, 8, 64, 256)] == [7, 2, 1, 1]
    assert fa3_num_splits(1, 8, 1, 200, 4, 132) == 1  # <= 4 KV blocks: never split


def test_stock_split_moves_with_the_batch_pinned_does_not():
    stock = TritonDefaults(FACTS, "stock").selector("attention", ATTN_SITE)
    pinned = TritonDefaults(FACTS, "pinned").selector("attention", ATTN_SITE)
    batches = [_rt(1, 1, 1024), _rt(8, 1, 1024), _rt(64, 1, 1024), _rt(1, 1024, 1024)]
    assert len({stock(**rt)["split_tokens"] for rt in batches}) > 1
    assert {pinned(**rt)["split_tokens"] for rt in batches} == {256}
    assert {pinned(**rt)["rowsum"] for rt in batches} == {"mma"}  # tile rows may follow the query length


def test_pinned_single_tile_needs_nothing_and_by_query_needs_mma(monkeypatch):
    monkeypatch.setenv("DETENT_PINNED_ATTN_BLOCK_M", "16")
    monkeypatch.setenv("DETENT_PINNED_ATTN_ROWSUM", "sum")
    pinned = TritonDefaults(FACTS, "pinned").selector("attention", ATTN_SITE)
    assert {pinned(**rt)["block_m"] for rt in (_rt(1, 1, 9), _rt(1, 4096, 4096))} == {16}
    monkeypatch.setenv("DETENT_PINNED_ATTN_BLOCK_M", "by_query")
    with pytest.raises(ValueError, match="ROWSUM=mma"):
        TritonDefaults(FACTS, "pinned").selector("attention", ATTN_SITE)


def test_gemm_modes():
    site = {"n": 4096, "k": 4096, "dtype": "bfloat16"}
    assert TritonDefaults(FACTS, "stock").selector("gemm", site)(**_rt(3, 1, 9)) == {"impl": "torch"}
    cons = TritonDefaults(FACTS, "conservative").selector("gemm", site)
    assert cons(**_rt(1, 1, 9)) == cons(**_rt(256, 1, 9))
    pin = TritonDefaults(FACTS, "pinned").selector("gemm", site)
    assert pin(**_rt(1, 1, 9))["impl"] == "triton_persistent"
    with pytest.raises(ValueError, match="selection mode"):
        TritonDefaults(FACTS, "fast")


def test_capture_sizes():
    assert default_capture_sizes(256)[:6] == [1, 2, 4, 8, 16, 32]
    assert default_capture_sizes(256)[-1] == 256
    assert default_capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert default_capture_sizes(3) == [1, 2, 3]


def test_graph_runner_refuses_cpu_and_host_metadata_attention():
    with pytest.raises(ValueError, match="CUDA device"):
        CudaGraphRunner(torch.nn.Linear(2, 2), [], 16, None, torch.device("cpu"), max_model_len=64,
                        capture_sizes=[1])
    from detent.selection import registry
    fn = registry.get("attention", "paged_split").fn
    ctx = ForwardContext(attn=None)
    ctx.memo[("resolved", "attention", (), ())] = (fn, {})
    with pytest.raises(RuntimeError, match="host metadata"):
        _check_graph_safe(ctx)
    ctx.memo[("resolved", "attention", (), ())] = (registry.get("attention", "triton_paged").fn, {})
    _check_graph_safe(ctx)
