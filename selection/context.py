"""The step context: the one global every `ops` call reads.

A `ForwardContext` carries what a model step needs besides its tensors: the
kernel dispatcher, the `AttentionMetadata` of the step's mixed prefill +
decode batch, the KV caches, and the selections memoized for the step. The
model runner enters ``with forward_context(ctx):`` once per step; attention
layers and the `ops` façade read it from here instead of threading it
through every ``forward`` signature. It sits at the bottom of selection/
(it imports nothing of ours), below the ops and the dispatcher that read it.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Where each query token of the step reads and writes KV.

    Sequences are laid out back to back in the flattened token dimension:
    sequence ``b`` owns tokens ``query_start_loc[b]:query_start_loc[b+1]``,
    which sit at absolute positions ``seq_lens[b] - query_len_b ..
    seq_lens[b] - 1`` of that sequence.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32, on the model's device
    seq_lens: torch.Tensor  # [B] int32: KV length after this step's tokens are written
    block_tables: torch.Tensor  # [B, max_blocks] int32 (padded with 0)
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset, per token
    num_seqs: int
    num_tokens: int
    max_seqlen_q: int
    max_seqlen_k: int
    block_size: int
    # host copies, so CPU kernels and selectors never sync on device tensors
    query_start_loc_cpu: tuple[int, ...] = ()
    seq_lens_cpu: tuple[int, ...] = ()

    @functools.cached_property  # read on every ops call of the step: sum once
    def total_kv(self) -> int:
        return sum(self.seq_lens_cpu)

    @functools.cached_property  # read by every attention layer of the step: once
    def query_lens_cpu(self) -> tuple[int, ...]:
        q = self.query_start_loc_cpu
        return tuple(b - a for a, b in zip(q, q[1:]))


@dataclass
class ForwardContext:
    attn: AttentionMetadata | None
    # per layer: tensor [2, num_blocks, block_size, num_kv_heads, head_dim]
    kv_caches: list[torch.Tensor] = field(default_factory=list)
    # the selection.dispatch.Dispatcher every ops call of this step goes through
    dispatcher: Any = None
    # selections memoized for this step: (family, site, runtime) -> dict
    memo: dict[Any, dict] = field(default_factory=dict)
    # when set, ops.attention calls it instead of dispatching: the piecewise
    # CUDA graphs split the model there (engine/piecewise_graph.py)
    attention_hook: Any = None

    def runtime(self, num_tokens: int) -> dict[str, int]:
        """The batch-dependent inputs a SelIR selector may read."""
        a = self.attn
        if a is None:
            return {"num_tokens": num_tokens, "num_seqs": 1, "max_seqlen_q": num_tokens,
                    "max_seqlen_k": num_tokens, "total_kv": num_tokens}
        return {"num_tokens": num_tokens, "num_seqs": a.num_seqs, "max_seqlen_q": a.max_seqlen_q,
                "max_seqlen_k": a.max_seqlen_k, "total_kv": a.total_kv}

    def selected(self, family: str) -> list[str]:
        """Names of the candidates selected for `family` during this step so far."""
        return [sel["impl"] for key, sel in self.memo.items() if key[0] == family]


_CTX: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _CTX
    prev, _CTX = _CTX, ctx
    try:
        yield ctx
    finally:
        _CTX = prev


def get_forward_context() -> ForwardContext | None:
    return _CTX
