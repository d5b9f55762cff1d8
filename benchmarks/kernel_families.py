"""GPU kernels by family, from their names: one table for Detent's kernels
(`mixed_kernels.py`) and vLLM's (`vllm_profile.py`), so the two engines' splits line up.

First match wins. Attention comes before GEMM because FlashAttention's kernels (FA3 in
vLLM, FA4 in Detent's `fa4` arm) are CUTLASS kernels whose names also hold "cutlass";
the KV store comes before attention because vLLM's is `reshape_and_cache_flash`.
Copies and unnamed fusions are "other" in both engines.
"""
from __future__ import annotations

FAMILIES = (
    ("kv_store", ("store_kv", "reshape_and_cache", "concat_and_cache")),
    ("attention", ("attn", "combine", "flash", "fmha", "attention")),
    ("gemm", ("matmul", "gemm", "nvjet", "xmma", "cutlass", "cublas")),
    ("norm", ("rms_norm", "rmsnorm", "rsqrt")),  # torch.compile's fused RMSNorm: triton_..._pow_rsqrt_...
    ("rope", ("rope", "rotary")),
    ("silu", ("silu", "act_and_mul")),
    ("sampling", ("softmax", "gumbel", "argmax", "first_max", "sampl", "topk", "top_k")),
)


def family(kernel: str) -> str:
    k = kernel.lower()
    return next((name for name, keys in FAMILIES if any(s in k for s in keys)), "other")
