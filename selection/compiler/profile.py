"""The default profile of runtime inputs (docs/selir.md section 5: the default tuple).

A small synthetic serving mix over the deployment's limits: decode steps at
batch sizes 1..max_num_seqs (powers of two) and context lengths up to
max_context, single prefill chunks up to max_num_batched_tokens, and mixed
steps (one prefill chunk plus decodes). Every point carries all runtime
values a selector may read (docs/architecture.md).
"""
from __future__ import annotations

from typing import Any

_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int8": 1, "float8_e4m3fn": 1}


def _pow2_upto(lo: int, hi: int) -> list[int]:
    out, v = [], lo
    while v <= hi:
        out.append(v)
        v *= 2
    return out


def default_profile(facts: dict[str, Any]) -> list[dict[str, int]]:
    max_ctx = int(facts.get("max_context", 4096))
    max_tok = int(facts.get("max_num_batched_tokens", 8192))
    max_seqs = int(facts.get("max_num_seqs", 256))
    hidden = int(facts.get("hidden", 4096))
    elt = _BYTES.get(str(facts.get("dtype", "bfloat16")), 2)
    pts: list[dict[str, int]] = []

    def add(num_tokens: int, num_seqs: int, max_q: int, max_k: int, total_kv: int) -> None:
        if num_tokens > max_tok or num_seqs > max_seqs or max_k > max_ctx:
            return
        pts.append({"num_tokens": num_tokens, "num_seqs": num_seqs, "max_seqlen_q": max_q,
                    "max_seqlen_k": max_k, "total_kv": total_kv, "message_bytes": num_tokens * hidden * elt})

    ctxs = [c for c in (16, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768) if c <= max_ctx]
    for b in _pow2_upto(1, min(max_seqs, 64)):
        for c in ctxs:
            add(b, b, 1, c, b * c)
    for q in _pow2_upto(16, min(max_tok, 8192)):
        add(q, 1, q, q, q)
        add(q + 7, 8, q, q + 512, q + 8 * 512)
    return pts
