"""Selections of the Triton candidates on CUDA per mode, as plain Python.

A stand-in provider (same interface as selection's providers) for the GPU
tests and benchmarks until SelIR's programs cover CUDA; it also documents
what those programs should say:

- stock: gemm = cuBLAS on the real M; attention = triton_paged with
  split_tokens from an FA3-style split count (batch, KV heads, SMs, KV
  length); moe = triton_fused at the table row nearest the token count.
- pinned: gemm = triton_persistent, tile config by M (configs measured
  bit-identical on the H200, tests/gpu checks it); attention = triton_paged
  with split_tokens fixed (256), tile rows by query length and the MMA row
  sum (tile-shape-neutral; or one 16-row tile with tl.sum via
  DETENT_PINNED_ATTN_BLOCK_M=16 DETENT_PINNED_ATTN_ROWSUM=sum); moe =
  triton_fused with the row key pinned.
- conservative (vLLM/SGLang deterministic-mode style): one fixed config per
  family: persistent matmul 128x128x64 for every M, attention without
  split-KV (one split up to max_context), moe at one row key.
Row-wise families use triton_rowwise in every mode (they read no batch value).
"""
from __future__ import annotations

import math
import os
from typing import Any

from detent.kernels.gemm_triton import config_for

PINNED_SPLIT_TOKENS = 256
ATTN_BLOCK_N = 64


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def fa3_num_splits(batch: int, num_kv_heads: int, max_seqlen_q: int, max_seqlen_k: int, group: int,
                   num_sms: int, block_m: int = 64, block_n: int = 128, max_splits: int = 128) -> int:
    """flash-attention hopper's num_splits_heuristic, on our tile sizes."""
    num_m_blocks = cdiv(max(max_seqlen_q, 1) * group, block_m)  # GQA packed
    num_n_blocks = cdiv(max(max_seqlen_k, 1), block_n)
    total = batch * num_kv_heads * num_m_blocks
    if total >= 0.8 * num_sms or num_n_blocks <= 4:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    eff = []
    for s in range(1, max_splits + 1):
        waves = total * s / num_sms
        eff.append(waves / math.ceil(waves))
    best = max(eff)
    for s in range(1, max_splits + 1):
        if eff[s - 1] >= 0.85 * best:
            return s
    return 1


def attn_block(max_seqlen_q: int, group: int) -> tuple[int, int]:
    """(block_m, num_warps): 16-row tiles for decode-shaped steps, 64 for prefill."""
    return (16, 4) if max_seqlen_q * group <= 16 else (64, 4)


def pinned_attn_block(max_seqlen_q: int, group: int) -> tuple[int, int]:
    """Pinned mode: tile rows by query length (16 for decode-shaped steps, 64
    for prefill), legal only with the MMA row sum (rowsum="mma": bits do not
    depend on the tile shape; tests/gpu's block_m-neutrality test checks it
    on the device). DETENT_PINNED_ATTN_BLOCK_M=16 (with ..._ROWSUM=sum) keeps
    one tile shape instead: 19% faster decode attention at batch 256, 24%
    slower 8k prefill on the H200 (benchmarks/kernels.py --attn-variants)."""
    policy = os.environ.get("DETENT_PINNED_ATTN_BLOCK_M", "by_query")
    if policy == "by_query":
        return attn_block(max_seqlen_q, group)
    bm = int(policy)
    return bm, 4 if bm <= 64 else 8


def pinned_rowsum() -> str:
    rs = os.environ.get("DETENT_PINNED_ATTN_ROWSUM", "mma")
    if os.environ.get("DETENT_PINNED_ATTN_BLOCK_M", "by_query") == "by_query" and rs != "mma":
        raise ValueError("DETENT_PINNED_ATTN_BLOCK_M=by_query needs DETENT_PINNED_ATTN_ROWSUM=mma "
                         "(tl.sum's order follows the tile shape)")
    return rs


class TritonDefaults:
    def __init__(self, facts: dict[str, Any], mode: str):
        if mode not in ("pinned", "stock", "conservative"):
            raise ValueError(f"selection mode must be pinned, stock or conservative, got {mode!r}")
        self.facts, self.mode = facts, mode

    def selector(self, family: str, site: dict[str, Any]):
        mode, facts = self.mode, self.facts
        if family == "gemm":
            if mode == "stock":
                return lambda **rt: {"impl": "torch"}
            if mode == "conservative":
                fixed = dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)
                return lambda **rt: {"impl": "triton_persistent", **fixed}
            n = site.get("n", 4096)
            return lambda **rt: {"impl": "triton_persistent", **config_for(rt["num_tokens"], n)}
        if family == "attention":
            g = site["num_heads"] // site["num_kv_heads"]
            kvh = site["num_kv_heads"]
            if mode == "conservative":
                split = cdiv(facts["max_context"], ATTN_BLOCK_N) * ATTN_BLOCK_N
                return lambda **rt: {"impl": "triton_paged", "split_tokens": split, "block_m": 64,
                                     "block_n": ATTN_BLOCK_N, "num_warps": 4, "combine": "sequential",
                                     "rowsum": "sum"}
            if mode == "pinned":
                rowsum = pinned_rowsum()

                def pinned(**rt):
                    bm, nw = pinned_attn_block(rt["max_seqlen_q"], g)
                    return {"impl": "triton_paged", "split_tokens": PINNED_SPLIT_TOKENS, "block_m": bm,
                            "block_n": ATTN_BLOCK_N, "num_warps": nw, "rowsum": rowsum}
                return pinned

            def stock(**rt):
                s = fa3_num_splits(rt["num_seqs"], kvh, rt["max_seqlen_q"], rt["max_seqlen_k"], g,
                                   facts.get("num_sms", 132))
                split = cdiv(cdiv(max(rt["max_seqlen_k"], 1), s), ATTN_BLOCK_N) * ATTN_BLOCK_N
                bm, nw = attn_block(rt["max_seqlen_q"], g)
                return {"impl": "triton_paged", "split_tokens": split, "block_m": bm,
                        "block_n": ATTN_BLOCK_N, "num_warps": nw, "rowsum": "sum"}
            return stock
        if family == "moe":
            from detent.kernels.moe_triton import MOE_CONFIGS, nearest_row_key
            if mode == "stock":
                return lambda **rt: {"impl": "triton_fused", "row_key": nearest_row_key(rt["num_tokens"])}
            key = max(MOE_CONFIGS) if mode == "conservative" else sorted(MOE_CONFIGS)[1]
            return lambda **rt: {"impl": "triton_fused", "row_key": key}
        if family in ("norm", "rope", "act", "logsoftmax"):
            return lambda **rt: {"impl": "triton_rowwise"}
        if family == "allreduce":
            return lambda **rt: {"impl": "native" if mode == "stock" else "ordered_gather"}
        return lambda **rt: {"impl": "torch_rowwise"}


def make_triton_dispatcher(facts: dict[str, Any], mode: str):
    from detent.selection.dispatch import Dispatcher
    return Dispatcher(TritonDefaults(facts, mode))


__all__ = ["TritonDefaults", "fa3_num_splits", "make_triton_dispatcher", "PINNED_SPLIT_TOKENS"]
