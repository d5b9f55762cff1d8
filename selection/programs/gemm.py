"""GEMM: the library GEMM picks its kernel by M (MKL fp32: M = 1, 2-3, >= 4;
cuBLAS: tile by M), so its row bits follow the batch. Detent's candidates fix
the shape a row sees: `torch_chunked` calls the library on fixed chunks of
rows; on GPU a Triton persistent matmul with a fixed tile config (no
split-K). The stock transcription picks the chunk and the Triton config by
M, as tuned tables do; the batch reaches the selection only through them.
"""
from detent.selection.lang import Fact, Runtime, assume, next_pow2, require  # noqa: F401

CHUNK_MAX = 16
# (block_m, block_n, block_k, num_warps, num_stages) by M bucket, like a tuned table
TRITON_CONFIGS = {
    16: (16, 64, 64, 4, 4),
    32: (32, 64, 64, 4, 4),
    64: (64, 64, 64, 4, 3),
    128: (128, 128, 64, 8, 3),
}


def m_bucket(m):
    b = 16
    for k in (16, 32, 64, 128):
        if m > k:
            b = min(k * 2, 128)
    return b


def select(device: Fact[str], triton: Fact[bool], stock_kernels: Fact[bool], n: Fact[int], k: Fact[int],
           max_num_batched_tokens: Fact[int], num_tokens: Runtime[int]):
    assume(0 <= num_tokens <= max_num_batched_tokens, "more rows than max_num_batched_tokens")
    if stock_kernels:
        return {"impl": "torch"}
    if device == "cuda" and triton:
        cfg = TRITON_CONFIGS[m_bucket(num_tokens)]
        return {"impl": "triton_persistent", "block_m": cfg[0], "block_n": cfg[1], "block_k": cfg[2],
                "num_warps": cfg[3], "num_stages": cfg[4]}
    chunk = min(next_pow2(num_tokens), CHUNK_MAX)
    require(chunk >= 4, "MKL fp32 runs other kernels for M = 1 and M = 2-3: a fixed chunk must be >= 4")
    return {"impl": "torch_chunked", "chunk": chunk}


def conservative(device: Fact[str], triton: Fact[bool]):
    if device == "cuda" and triton:
        return {"impl": "triton_persistent", "block_m": 16, "block_n": 64, "block_k": 64, "num_warps": 4,
                "num_stages": 2}
    return {"impl": "torch_chunked", "chunk": 1}
