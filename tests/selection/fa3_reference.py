"""An independent plain-Python transcription of flash-attention hopper's
num_splits_heuristic (on our tile sizes): the oracle the SelIR attention
program's stock split is checked against (tests/selection/test_programs.py)."""
from __future__ import annotations

import math


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
