"""The engine's user-facing configuration, validated at the boundary.

`EngineConfig` holds what the user asked for (vLLM's argument names).
Values discovered at startup — the resolved device, dtype and
max_model_len, the number of KV blocks — live in `EngineState`.
"""
from __future__ import annotations

from dataclasses import dataclass

from typing import Any

import torch

from detent.models.loader import DTYPES, LOAD_FORMATS, resolve_dtype
from detent.selection.compiler.solver import MODES as SELECTION_MODES

# The user's choices are checked here, once, against the lists of the floors
# that use them: selection modes (selection/compiler/solver.py), dtypes and
# load formats (models/loader.py).


# the largest whole-step graph (engine/mixed_graph.py): vLLM's is 512; 2,048 (the default
# mixed cap) so that a 1,024-token chunk beside decodes is one replay too (lease 8: such a
# step took 9.5 ms of host time through the pieces against a 5.8 ms decode step before it)
MIXED_GRAPH_MAX_TOKENS = 2048
MIXED_GRAPH_MIN_TOKENS = 16  # the smallest (the token buckets start at 16)

# attention_backend's values: Detent's implementations, and the vLLM names (`--attention-backend`) that
# mean one: TRITON_ATTN (Triton paged attention) and FLASH_ATTN (FlashAttention; Detent's is
# FlashAttention-4, `pip install "detent[fa4]"`, SM90). Lease 27 (H100, docs/performance.md): fa4 served
# 20 req/s at 1.14x vLLM's p50 TPOT against triton_paged's 1.25x, but one 8k-token request at a time
# at 9.2 ms a token against 6.4 (no split-KV decode): a per-workload choice
ATTENTION_BACKENDS = {"triton_paged": "triton_paged", "fa4": "fa4", "TRITON_ATTN": "triton_paged",
                      "FLASH_ATTN": "fa4"}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # path, HF cache name or preset; None: the embedded SmolLM2
    tensor_parallel_size: int = 1
    tuple: str | None = None  # commitment tuple path (t.json); None: the default tuple
    selection: str = "pinned"
    dtype: str = "auto"
    device: str = "auto"
    enable_prefix_caching: bool = True
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    block_size: int = 16
    load_format: str = "auto"
    seed: int = 0
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks: int | None = None  # overrides any memory budget
    max_logprobs: int = 20
    enforce_eager: bool = False  # GPU: no CUDA graphs
    # GPU: steps with prefill tokens replay piecewise CUDA graphs (everything but
    # attention) up to this many tokens (and max_num_batched_tokens); larger steps
    # run eagerly; 0: never
    piecewise_max_tokens: int = 8192
    # GPU, tp = 1: steps with prompt tokens of up to this many tokens (16 .. MIXED_GRAPH_MAX_TOKENS) replay one
    # whole-step graph, attention inside (engine/mixed_graph.py); 0: off. On by default since lease 12: under load it
    # was faster than the pieces at C = 128, 80 % of vLLM's maximum and 20 req/s in two leases (docs/performance.md)
    mixed_graph_max_tokens: int = MIXED_GRAPH_MAX_TOKENS
    # a step that carries decodes takes at most this many tokens (prompts wait for
    # later steps rather than stall every generating request); None: no cap
    max_mixed_batched_tokens: int | None = 2048
    # a step that carries decodes and passes this many tokens ends on a multiple of it
    # (scheduler.SchedulerLimits.mixed_token_align; None: off). 1,024: a fresh 1,024-token
    # prompt beside 26 decodes then runs 1,024 rows, not the 1,152-row graph, whose GEMMs take a
    # second round of the H200's 132 SMs; under load beside vLLM in one hold (lease 18) TPOT p50
    # went from 1.24x to 1.11x vLLM's at 80 % of its maximum and from 1.35x to 1.20x at 20 req/s,
    # C = 128 throughput 0.98x and 0.97x (docs/performance.md)
    mixed_token_align: int | None = 1024
    # plan and launch step N+1 while step N runs on the device (None: on for CUDA)
    async_scheduling: bool | None = None
    # after startup, move every object alive to Python's permanent GC generation
    # (gc.freeze), so a full collection never walks the imports and the model
    # again: that walk stalled one decode step by 0.11 s on the H200's host
    # (None: on for CUDA; it is process-wide, so off for CPU test processes)
    freeze_gc: bool | None = None
    # before serving, run every kernel configuration SelIR finds reachable, so no
    # request waits for a Triton compile (engine/warmup.py; None: on for CUDA)
    warmup: bool | None = None
    # RL sampling contract: every request must carry a seed and sample (temperature > 0);
    # see engine/rl_contract.py
    rl: bool = False
    # structured-output compile jobs that may wait in one grammar lane (GrammarLimits.max_queued_compiles):
    # a request with a new spec past it is refused at add_request (CompileQueueFull). None: no bound,
    # as vLLM's offline LLM (a caller waits for its own specs); detent-serve sets 64, since there a
    # flood of slow specs from one client would delay every other structured request a compile timeout each
    max_queued_grammar_compiles: int | None = None
    # the tokenizer (and its chat template) from this directory or HF cache name instead of the model's,
    # as vLLM's `tokenizer` (models/resolve.py resolve_tokenizer)
    tokenizer: str | None = None
    # the default tuple's attention (the SelIR knob attention.impl, docs/selir.md), by Detent's name
    # or vLLM's (ATTENTION_BACKENDS); None: the default tuple's own (triton_paged). Pinned selection
    # without `tuple` only: a tuple names its attention itself
    attention_backend: str | None = None

    def __post_init__(self):
        def positive(name):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"{name} must be a positive int, got {v!r}")
        for name in ("tensor_parallel_size", "max_num_seqs", "max_num_batched_tokens", "block_size",
                     "max_model_len", "kv_cache_memory_bytes", "num_gpu_blocks", "max_mixed_batched_tokens",
                     "mixed_token_align", "max_queued_grammar_compiles"):
            positive(name)
        for name in ("piecewise_max_tokens", "mixed_graph_max_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if self.mixed_graph_max_tokens and not (MIXED_GRAPH_MIN_TOKENS <= self.mixed_graph_max_tokens
                                                <= MIXED_GRAPH_MAX_TOKENS):
            # the token buckets of engine/mixed_graph.py
            raise ValueError(f"mixed_graph_max_tokens must be 0 (off) or {MIXED_GRAPH_MIN_TOKENS} .. "
                             f"{MIXED_GRAPH_MAX_TOKENS} (the largest whole-step graph), "
                             f"got {self.mixed_graph_max_tokens}")
        if self.selection not in SELECTION_MODES:
            raise ValueError(f"selection must be one of {SELECTION_MODES}, got {self.selection!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {['auto', *sorted(DTYPES)]}, got {self.dtype!r}")
        if self.device not in ("auto", "cpu", "cuda") and not str(self.device).startswith("cuda:"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {', '.join(LOAD_FORMATS)}, got {self.load_format!r}")
        if not isinstance(self.seed, int):
            raise ValueError(f"seed must be an int, got {self.seed!r}")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be >= 0, got {self.max_logprobs}")
        if self.attention_backend is not None:
            if self.attention_backend not in ATTENTION_BACKENDS:
                raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, got "
                                 f"{self.attention_backend!r} (Detent's attention implementations, and the vLLM "
                                 f"names that mean one)")
            if self.tuple is not None:
                raise ValueError("attention_backend sets the default tuple's attention; the commitment tuple "
                                 f"{self.tuple} names its own (knob attention.impl): give one or the other")
            if self.selection != "pinned":
                raise ValueError(f"attention_backend sets the default tuple's attention, which selection "
                                 f"{self.selection!r} does not run: it needs selection 'pinned'")

    def tuple_knobs(self) -> dict[str, dict[str, Any]] | None:
        """Knobs the default tuple takes from this config ({family: {knob: value}}), or None."""
        if self.attention_backend is None:
            return None
        return {"attention": {"impl": ATTENTION_BACKENDS[self.attention_backend]}}

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        dev = torch.device(self.device)
        if dev.type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device={self.device!r} but no CUDA device is available")
        return dev

    def resolve_dtype(self, mc: Any, device: torch.device) -> torch.dtype:
        """'auto': the checkpoint's dtype on GPU (float32 checkpoints stay float32), float32 on CPU."""
        return resolve_dtype(self.dtype, mc, device)


@dataclass(frozen=True)
class EngineState:
    """What startup discovered."""
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    num_blocks: int  # KV blocks, the reserved null block included
    block_size: int

    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1


@dataclass(frozen=True)
class EngineLimits:
    """What a request may ask of a built engine (`LLMEngine.limits()`): servers
    validate against these instead of reading the engine's internals."""
    max_model_len: int
    vocab_size: int
    max_logprobs: int
    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int = 16  # tokens per KV-cache block
    kv_cache_tokens: int = 0  # the KV pool: usable blocks x block_size
    # the ids min_tokens bans (None: not told): a server's worker builds a request's mask tables with
    # them (sampling/processors.checked_params), which admission, on the step thread, then takes
    eos_token_ids: tuple[int, ...] | None = None
