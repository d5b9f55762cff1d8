"""Piecewise CUDA graphs for prefill and mixed steps.

Decode-only steps replay one whole-model graph (engine/cuda_graph.py). A
step that carries prefill tokens cannot: its attention reads per-sequence
query lengths, and its launch grid follows them. Run eagerly, such a step
cost 40-55 ms of host time on the H200 for Llama-3.1-8B even with 16 tokens
(some 300 kernel launches, each through the dispatcher and Triton's
launcher), more than the device needed, and under load these steps set the
time per token (docs/performance.md, "Serving under load").

So, as vLLM's piecewise graphs do, everything except attention is captured
at token-count buckets, and attention runs eagerly between the pieces:

    piece 0: embedding .. layer 0's q, k, v  -> staging buffers
    attention(layer 0) eagerly, on the step's real metadata -> staging out
    piece 1: layer 0's o_proj .. layer 1's q, k, v -> staging
    ...
    piece L: the last layer's o_proj .. final norm -> hidden

A step of T tokens replays the smallest bucket >= T: its inputs are padded
with token 0 at position 0, and the padded rows are never read (attention
runs on the first T rows only, the runner keeps the first T hidden rows).
Each kernel outside attention computes a row from that row alone (the
kernels' batch invariance), so a row's bits do not depend on the padding:
tests/gpu/test_gpu_cuda_graph.py compares steps with and without these
graphs with `torch.equal`. One set of staging buffers serves every layer,
since attention i always runs between piece i and piece i + 1.

The split is made by `ForwardContext.attention_hook`, which `ops.attention`
calls instead of dispatching when it is set: during capture the hook ends
the current graph, and begins the next one after the (skipped) attention.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from detent.selection.context import AttentionMetadata, ForwardContext, forward_context
from detent.selection.dispatch import Dispatcher

log = logging.getLogger(__name__)


FINE_FROM, FINE_STEP, COARSE_FROM, COARSE_STEP = 512, 128, 2048, 512


def default_token_buckets(max_tokens: int) -> list[int]:
    """16, 24, 32, 48, ... (powers of two and 1.5x between) up to 512, then every 128
    tokens up to 2,048 and every 512 above, and max_tokens itself.

    A step replays the smallest bucket that holds it, so a bucket's padding is GEMM
    work thrown away: under load a mixed step is one 1,024-token prompt plus the
    decodes (1,054 tokens at 30 of them), which the powers-of-two ladder padded to
    1,536 (42.0 ms on the H200 against 34.8 at 1,152). Steps without decodes take
    up to max_num_batched_tokens, so the ladder reaches it: a 4,096-token step
    took the same device time either way (~100 ms) but 53 ms of host time eagerly
    against 6.7 through the pieces."""
    out, b = set(), 16
    while b <= min(max_tokens, FINE_FROM):
        out.add(b)
        if b * 3 // 2 <= min(max_tokens, FINE_FROM):
            out.add(b * 3 // 2)
        b *= 2
    out.update(range(FINE_FROM + FINE_STEP, min(max_tokens, COARSE_FROM) + 1, FINE_STEP))
    out.update(range(COARSE_FROM + COARSE_STEP, max_tokens + 1, COARSE_STEP))
    if max_tokens >= 16:
        out.add(max_tokens)
    return sorted(out)


@dataclass
class _Split:
    """One attention call between two pieces: which layer, its scale."""
    layer_idx: int
    scale: float


class _Staging:
    """q, k, v and the attention output, shared by every layer's split."""

    def __init__(self, n: int, q_shape, kv_shape, dtype, device):
        self.q = torch.zeros((n, *q_shape), dtype=dtype, device=device)
        self.k = torch.zeros((n, *kv_shape), dtype=dtype, device=device)
        self.v = torch.zeros((n, *kv_shape), dtype=dtype, device=device)
        self.out = torch.zeros((n, *q_shape), dtype=dtype, device=device)


class PiecewiseGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 dispatcher: Dispatcher, device: torch.device, *, buckets: list[int]):
        if device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {device}")
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.dispatcher, self.device = dispatcher, device
        self.buckets = sorted(set(buckets))
        n = self.buckets[-1]
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.graphs: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.splits: dict[int, list[_Split]] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.staging: _Staging | None = None
        self.pool = torch.cuda.graph_pool_handle()
        self.disabled: str | None = None

    # ------------------------------------------------------------ capture
    def _meta(self, t: int) -> AttentionMetadata:
        """Metadata the selectors read during capture: one sequence of t tokens
        (attention itself does not run then)."""
        i32 = dict(dtype=torch.int32, device=self.device)
        return AttentionMetadata(
            query_start_loc=torch.tensor([0, t], **i32), seq_lens=torch.tensor([t], **i32),
            block_tables=torch.zeros((1, 1), **i32), slot_mapping=torch.zeros(t, dtype=torch.long,
                                                                              device=self.device),
            num_seqs=1, num_tokens=t, max_seqlen_q=t, max_seqlen_k=t, block_size=self.block_size,
            query_start_loc_cpu=(0, t), seq_lens_cpu=(t,))

    def _warm_hook(self, q, k, v, *, layer_idx, scale):
        """Warm-up runs: attention is skipped (its output is the staging buffer),
        so the pieces' kernels compile and their selections are made."""
        if self.staging is None:
            self.staging = _Staging(self.buckets[-1], q.shape[1:], k.shape[1:], q.dtype, self.device)
        return self.staging.out[:q.shape[0]]

    def _capture_bucket(self, t: int, stream: torch.cuda.Stream) -> None:
        graphs: list[torch.cuda.CUDAGraph] = []
        splits: list[_Split] = []
        st = self.staging

        def hook(q, k, v, *, layer_idx, scale):
            st.q[:t].copy_(q)
            st.k[:t].copy_(k)
            st.v[:t].copy_(v)
            graphs[-1].capture_end()
            splits.append(_Split(layer_idx, scale))
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=self.pool)
            graphs.append(g)
            return st.out[:t]

        ctx = ForwardContext(attn=self._meta(t), kv_caches=self.kv_caches, dispatcher=self.dispatcher,
                             attention_hook=hook)
        with torch.cuda.stream(stream), forward_context(ctx):
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=self.pool)
            graphs.append(g)
            try:
                out = self.model(self.input_ids[:t], self.positions[:t])
            finally:
                graphs[-1].capture_end()
        self.graphs[t], self.splits[t], self.outputs[t] = graphs, splits, out

    @torch.inference_mode()
    def capture(self) -> "PiecewiseGraphRunner":
        # one capture stream for every bucket: the caching allocator hands a freed block only to
        # an allocation on the stream it was made on, so a stream per bucket kept every bucket's
        # activations apart in the pool (about 9 GiB at buckets up to 8,192 tokens for
        # Llama-3.1-8B shapes, which on an 80 GB card did not fit: docs/performance.md, lease 25)
        stream = torch.cuda.Stream(self.device)
        try:
            for t in reversed(self.buckets):  # largest first: smaller buckets reuse its pool
                ctx = ForwardContext(attn=self._meta(t), kv_caches=self.kv_caches, dispatcher=self.dispatcher,
                                     attention_hook=self._warm_hook)
                with forward_context(ctx):
                    for _ in range(2):  # Triton compiles, cuBLAS workspaces, selections
                        self.model(self.input_ids[:t], self.positions[:t])
                torch.cuda.synchronize(self.device)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                self._capture_bucket(t, stream)
                torch.cuda.current_stream(self.device).wait_stream(stream)
        except Exception as e:  # noqa: BLE001  (any capture failure: stay eager and say why)
            self.graphs.clear()
            self.outputs.clear()
            self.disabled = f"piecewise CUDA-graph capture failed ({type(e).__name__}: {e}); " \
                            f"prefill and mixed steps run eagerly"
            log.warning(self.disabled)
        torch.cuda.synchronize(self.device)
        return self

    # ------------------------------------------------------------ replay
    def bucket_for(self, num_tokens: int) -> int | None:
        if self.disabled or not self.graphs:
            return None
        for b in self.buckets:
            if b >= num_tokens:
                return b
        return None

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        """The step's hidden states [T, hidden], or None when no bucket fits (run eagerly).
        Called inside the step's forward context; attention dispatches on its real metadata."""
        from detent.selection import ops

        t = input_ids.shape[0]
        b = self.bucket_for(t)
        if b is None:
            return None
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        if b > t:
            self.input_ids[t:b].zero_()
            self.positions[t:b].zero_()
        st = self.staging
        graphs, splits = self.graphs[b], self.splits[b]
        for g, sp in zip(graphs, splits):
            g.replay()
            st.out[:t].copy_(ops.attention(st.q[:t], st.k[:t], st.v[:t], layer_idx=sp.layer_idx, scale=sp.scale))
        graphs[-1].replay()
        return self.outputs[b][:t]


def enable_piecewise_graphs(runner, *, max_tokens: int, buckets: list[int] | None = None) -> PiecewiseGraphRunner:
    """Capture piecewise graphs for a `ModelRunner` and hook them into its
    `_forward` behind the decode graphs: steps a decode graph does not take and
    that fit a bucket replay the pieces; larger steps run eagerly."""
    inner = runner._forward
    g = PiecewiseGraphRunner(runner.model, runner.kv_caches, runner.block_size, runner.dispatcher, runner.device,
                             buckets=buckets or default_token_buckets(max_tokens)).capture()
    if g.disabled is None:
        decode = getattr(runner, "cuda_graphs", None)

        def forward(input_ids, positions, ctx):
            if decode is not None and decode.size_for(ctx.attn) is not None:
                return inner(input_ids, positions, ctx)
            out = g.run(input_ids, positions, ctx)
            if out is None:
                return inner(input_ids, positions, ctx)
            runner.forward_path = "pieces"
            return out
        runner._forward = forward
    runner.piecewise_graphs = g
    return g
