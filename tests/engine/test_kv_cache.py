"""KV cache sizing from a budget, and the error when one request cannot fit."""
import pytest
import torch

from detent.engine.kv_cache import CPU_DEFAULT_KV_BYTES, KVCacheSpec, allocate_kv_caches, num_blocks_for

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype=torch.float32, block_size=16)
CPU = torch.device("cpu")


def test_bytes_per_block():
    assert SPEC.bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4  # K and V, layers, tokens, heads, dim, fp32


def test_budget_and_override():
    bpb = SPEC.bytes_per_block
    assert num_blocks_for(SPEC, CPU, max_model_len=64, max_num_seqs=4, kv_cache_memory_bytes=10 * bpb + 7) == 10
    assert num_blocks_for(SPEC, CPU, max_model_len=64, max_num_seqs=4, num_gpu_blocks=9,
                          kv_cache_memory_bytes=10 * bpb) == 9
    # CPU default: enough for max_num_seqs requests of max_model_len (+ the null block), capped
    assert num_blocks_for(SPEC, CPU, max_model_len=64, max_num_seqs=4) == 4 * 4 + 1
    assert num_blocks_for(SPEC, CPU, max_model_len=2 ** 20, max_num_seqs=256) == CPU_DEFAULT_KV_BYTES // bpb


def test_one_request_must_fit():
    with pytest.raises(ValueError, match=r"kv_cache_memory_bytes=.* gives 3 usable blocks .* max_model_len=64 needs 4"):
        num_blocks_for(SPEC, CPU, max_model_len=64, max_num_seqs=1, kv_cache_memory_bytes=4 * SPEC.bytes_per_block)
    assert num_blocks_for(SPEC, CPU, max_model_len=64, max_num_seqs=1, num_gpu_blocks=5) == 5


def test_layout():
    caches = allocate_kv_caches(SPEC, 5, CPU)
    assert len(caches) == 2 and caches[0].shape == (2, 5, 16, 2, 16) and not caches[0].any()
