"""INTERIM selectors in plain Python, until the SelIR compiler provides the
real ones (issue: SelIR). Same selection dicts, same candidate names; the
SelIR provider replaces this module and this file is then deleted.
"""
from __future__ import annotations

from typing import Any


class InterimProvider:
    def __init__(self, facts: dict[str, Any], mode: str):
        if mode not in ("pinned", "stock", "conservative"):
            raise ValueError(f"selection mode must be pinned, stock or conservative, got {mode!r}")
        self.facts, self.mode = facts, mode

    def selector(self, family: str, site: dict[str, Any]):
        mode = self.mode
        if family == "gemm":
            if mode == "stock":
                return lambda **rt: {"impl": "torch"}
            chunk = 1 if mode == "conservative" else 16
            return lambda **rt: {"impl": "torch_chunked", "chunk": chunk}
        if family == "attention":
            if mode == "stock":
                return lambda **rt: {"impl": "sdpa"}
            split = 64 if mode == "conservative" else 256
            return lambda **rt: {"impl": "paged_split", "split_tokens": split, "q_chunk": 16}
        if family == "moe":
            if mode == "stock":
                return lambda **rt: {"impl": "torch_loop", "row_key": 0}
            return lambda **rt: {"impl": "torch_chunked", "chunk": 16, "row_key": 0}
        if family == "allreduce":
            return lambda **rt: {"impl": "native" if mode == "stock" else "ordered_gather"}
        return lambda **rt: {"impl": "torch_rowwise"}
