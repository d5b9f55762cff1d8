"""CUDA graphs for decode steps.

A decode-only step (every sequence contributes one token) runs as a replay
of a graph captured for the smallest captured batch size >= its batch; the
batch is padded with dummy sequences that read and write only the reserved
null KV block (block 0). Prefill and mixed steps stay eager.

Selection is resolved at capture: the capture runs the model inside a
forward context whose metadata has the captured batch size, query length 1
and `max_seqlen_k = max_model_len`, so every kernel family's selector runs
once per captured size and its choice is baked into the graph. In `pinned`
mode the choice cannot depend on those values anyway; in `stock` mode this
is the stock behaviour of engines that capture graphs.

What a graph needs from the kernels it captures: they read the step's
metadata only from device tensors (the static buffers below), never from
the host tuples, and they do not synchronize. A capture that fails (a
candidate that syncs, a CPU-only candidate) disables graphs with the reason
in `self.disabled`; the runner then stays eager.
"""
from __future__ import annotations

import logging

import torch

from detent.selection.context import AttentionMetadata, ForwardContext, forward_context
from detent.selection.dispatch import Dispatcher

log = logging.getLogger(__name__)

NULL_BLOCK = 0
# attention candidates that read the step's metadata only from device tensors (the
# others, the CPU paths, read host tuples, which a graph would freeze at capture), and
# whose replays on another step's metadata gave the eager call's bits on the H200:
# the Triton kernel, and FlashAttention-4, in decode graphs
# (tests/gpu/test_gpu_fa4.py::test_cuda_graph_replay_equals_eager, lease 8) and in
# whole-step graphs with prompt rows (::test_whole_step_graph_replay_equals_eager,
# lease 21; its graphs are captured at the longest query, engine/mixed_graph.py)
GRAPH_SAFE_ATTENTION = ("triton_paged", "fa4")


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 16 up to max_num_seqs (vLLM's shape)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if sizes[-1] != max_num_seqs:
        sizes.append(max_num_seqs)
    return sizes


class CudaGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 dispatcher: Dispatcher, device: torch.device, *, max_model_len: int,
                 capture_sizes: list[int]):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.dispatcher, self.device = dispatcher, device
        self.max_model_len = max_model_len
        self.sizes = sorted(set(capture_sizes))
        n = self.sizes[-1]
        self.max_blocks = -(-max_model_len // block_size)
        i32 = dict(dtype=torch.int32, device=device)
        # static inputs: replays copy the step's values in
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.qsl = torch.arange(n + 1, **i32)  # one query per sequence, always
        self.seq_lens = torch.ones(n, **i32)
        self.block_tables = torch.full((n, self.max_blocks), NULL_BLOCK, **i32)
        self.slots = torch.zeros(n, dtype=torch.long, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.pool = None
        self.disabled: str | None = None

    # ------------------------------------------------------------ capture
    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(
            query_start_loc=self.qsl[:b + 1], seq_lens=self.seq_lens[:b], block_tables=self.block_tables[:b],
            slot_mapping=self.slots[:b], num_seqs=b, num_tokens=b, max_seqlen_q=1,
            max_seqlen_k=self.max_model_len, block_size=self.block_size,
            query_start_loc_cpu=tuple(range(b + 1)), seq_lens_cpu=(self.max_model_len,) * b)

    def _reset_padding(self, start: int, end: int) -> None:
        # dummy sequences: length 1, token 0 at position 0, in the null block
        self.seq_lens[start:end] = 1
        self.positions[start:end] = 0
        self.input_ids[start:end] = 0
        self.slots[start:end] = NULL_BLOCK * self.block_size + (torch.arange(start, end, device=self.device)
                                                                % self.block_size)
        self.block_tables[start:end, 0] = NULL_BLOCK

    @torch.inference_mode()
    def capture(self) -> "CudaGraphRunner":
        self._reset_padding(0, self.sizes[-1])
        try:
            for b in reversed(self.sizes):  # largest first: later graphs reuse its pool
                ctx = ForwardContext(attn=self._meta(b), kv_caches=self.kv_caches, dispatcher=self.dispatcher)
                g, out = capture_whole_model(self.model, self.input_ids[:b], self.positions[:b], ctx, self.pool)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[b], self.outputs[b] = g, out
        except Exception as e:  # noqa: BLE001  (any capture failure: stay eager and say why)
            self.graphs.clear()
            self.outputs.clear()
            self.disabled = f"CUDA-graph capture failed ({type(e).__name__}: {e}); decode runs eagerly"
            log.warning(self.disabled)
        torch.cuda.synchronize(self.device)
        return self

    # ------------------------------------------------------------ replay
    def size_for(self, attn: AttentionMetadata) -> int | None:
        """The captured size this step replays with, or None (run eagerly)."""
        if self.disabled or not self.graphs or attn.max_seqlen_q != 1 or attn.num_tokens != attn.num_seqs:
            return None
        if attn.block_tables.shape[1] > self.max_blocks:
            return None
        for s in self.sizes:
            if s >= attn.num_seqs:
                return s
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata) -> torch.Tensor | None:
        b = self.size_for(attn)
        if b is None:
            return None
        n = attn.num_seqs
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.seq_lens[:n].copy_(attn.seq_lens)
        self.slots[:n].copy_(attn.slot_mapping)
        w = attn.block_tables.shape[1]
        self.block_tables[:n, :w].copy_(attn.block_tables)
        if b > n:
            self._reset_padding(n, b)
        self.graphs[b].replay()
        return self.outputs[b][:n]


def capture_whole_model(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
                        ctx: ForwardContext, pool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """One graph of the whole forward on static inputs, in `ctx`: two warm-up runs first (Triton
    compiles, cuBLAS workspaces, selections), then the check that attention reads no host
    metadata. Returns the graph and its output tensor."""
    with forward_context(ctx):
        for _ in range(2):
            model(input_ids, positions)
        _check_graph_safe(ctx)
        torch.cuda.synchronize(input_ids.device)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            out = model(input_ids, positions)
    return g, out


def _check_graph_safe(ctx: ForwardContext) -> None:
    for name in ctx.selected("attention"):
        if name not in GRAPH_SAFE_ATTENTION:
            raise RuntimeError(f"attention candidate {name!r} is not known to replay correctly in this "
                               f"graph (it may read host metadata); this graph needs one of {GRAPH_SAFE_ATTENTION}")


def enable_cuda_graphs(runner, *, max_num_seqs: int, max_model_len: int,
                       capture_sizes: list[int] | None = None) -> CudaGraphRunner:
    """Capture decode graphs for a `ModelRunner` (with its current dispatcher)
    and hook them into its `_forward`: decode-only steps replay, the rest run
    eagerly. Calling it again (e.g. after swapping the dispatcher) recaptures."""
    eager = getattr(runner, "_eager_forward", None) or runner._forward
    runner._eager_forward = eager
    runner._forward = eager
    g = CudaGraphRunner(runner.model, runner.kv_caches, runner.block_size, runner.dispatcher, runner.device,
                        max_model_len=max_model_len,
                        capture_sizes=capture_sizes or default_capture_sizes(max_num_seqs)).capture()
    if g.disabled is None:
        def forward(input_ids, positions, ctx):
            out = g.run(input_ids, positions, ctx.attn)
            if out is None:
                return eager(input_ids, positions, ctx)
            runner.forward_path = "decode_graph"
            return out
        runner._forward = forward
    runner.cuda_graphs = g
    return g
