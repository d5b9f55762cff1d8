"""Fused MoE: SGLang/vLLM look up a tuned config table keyed by token count
and take the row nearest the batch's M (`min(keys, key=|key - M|)`). Every
config value follows that row key, so the cut falls on it (docs/selir.md section 7): one
pin fixes all of the row's selection points.
"""
from detent.selection.compiler.lang import Fact, Runtime, assume, neutral  # noqa: F401

# token count -> (BLOCK_SIZE_M, BLOCK_SIZE_N, BLOCK_SIZE_K, GROUP_SIZE_M, num_warps, num_stages)
CONFIGS = {
    1: (16, 32, 64, 1, 4, 4), 2: (16, 32, 64, 1, 4, 4), 4: (16, 64, 64, 1, 4, 4),
    8: (16, 64, 128, 1, 4, 4), 16: (16, 64, 128, 1, 4, 3), 24: (16, 64, 128, 1, 4, 3),
    32: (16, 64, 128, 1, 4, 3), 48: (32, 64, 128, 1, 4, 3), 64: (32, 64, 128, 8, 4, 3),
    96: (32, 128, 128, 8, 4, 3), 128: (64, 64, 128, 8, 4, 3), 256: (64, 128, 128, 8, 8, 3),
    512: (64, 128, 128, 16, 8, 3), 1024: (128, 128, 64, 16, 8, 3), 1536: (128, 128, 64, 16, 8, 3),
    2048: (128, 128, 64, 32, 8, 3), 3072: (128, 256, 64, 32, 8, 3), 4096: (128, 256, 64, 32, 8, 3),
}
CPU_CHUNK = 16  # rows per expert GEMM call on CPU (programs/gemm.py: CPU_CHUNKS)
KEYS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096)
# the Triton kernel's tiles by token count (SGLang's fused_moe table shape):
# token count -> (block_m, block_n, block_k, group_m, num_warps, num_stages)
GPU_CONFIGS = {
    16: (16, 64, 128, 1, 4, 4), 128: (32, 64, 128, 8, 4, 4),
    1024: (64, 128, 64, 8, 4, 3), 4096: (128, 128, 64, 16, 8, 3),
}
GPU_KEYS = (16, 128, 1024, 4096)  # the keys of GPU_CONFIGS, in order


def nearest_row(m, keys):
    best = keys[0]
    for key in keys:
        if abs(key - m) < abs(best - m):
            best = key
    return best


def select(device: Fact[str], triton: Fact[bool], stock_kernels: Fact[bool], num_experts: Fact[int],
           top_k: Fact[int], max_num_batched_tokens: Fact[int], num_tokens: Runtime[int]):
    assume(0 <= num_tokens <= max_num_batched_tokens, "more rows than max_num_batched_tokens")
    if device == "cuda" and triton:
        # the kernel takes its tile config from its table row. Its grouped GEMMs reduce
        # K like the Triton GEMM and combine the k slots in a fixed order, and every row
        # gave identical bits on the H200 (tests/gpu/test_gpu_moe.py): the row may follow
        # the batch (neutral), so prefill gets prefill tiles. Stock takes the same row.
        # fuse_glue=2: routing, alignment and combine as three launches instead of ~35
        # small torch kernels (1.6x faster decode at batch 1 on the H200); its routing
        # rounds the weights its own way, so it is one constant for every batch.
        row = nearest_row(num_tokens, GPU_KEYS)
        tile = GPU_CONFIGS[row if stock_kernels else neutral(row)]
        return {"impl": "triton_fused", "block_m": tile[0], "block_n": tile[1], "block_k": tile[2],
                "group_m": tile[3], "num_warps": tile[4], "num_stages": tile[5], "fuse_glue": 2}
    row_key = nearest_row(num_tokens, KEYS)
    if stock_kernels:
        return {"impl": "torch_loop", "row_key": row_key}
    # the expert GEMMs run on CPU_CHUNK-row library calls: the table's BLOCK_SIZE_M
    # (16-128) would give chunks whose rows MKL's AVX2 path computes by position
    return {"impl": "torch_chunked", "chunk": CPU_CHUNK, "row_key": row_key}


def conservative(device: Fact[str], triton: Fact[bool]):
    if device == "cuda" and triton:
        tile = GPU_CONFIGS[GPU_KEYS[-1]]
        return {"impl": "triton_fused", "block_m": tile[0], "block_n": tile[1], "block_k": tile[2],
                "group_m": tile[3], "num_warps": tile[4], "num_stages": tile[5], "fuse_glue": 2}
    return {"impl": "torch_chunked", "chunk": 1, "row_key": 1}
