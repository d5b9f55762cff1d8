"""Whole-step CUDA graphs for steps with prompt tokens (on by default up to 2,048 tokens; GPU-tested and served).

Lease 6 measured a step of 16 prompt tokens beside 16 decodes at 11.0 ms of
device time and 10.9 ms of host time, against 5.4 ms for the decode graph of
16: the piecewise graphs (engine/piecewise_graph.py) run attention eagerly
between their pieces, and for a small step the host's 32 attention calls are
the step. vLLM replays one whole graph, attention inside, for every step of
up to 512 tokens. This does the same, up to `--mixed-graph-max-tokens` (at most
2,048). Under load a graph's launch is ~3 ms where the pieces' is 9-13 ms; with the fill's
sync fixed, TPOT p50 was lower than through the pieces at C = 128, at 80 % of vLLM's maximum
and at 20 req/s in leases 10 and 12 (docs/performance.md), so it is the default; `0` turns
it off.

A graph is captured for T tokens and S sequences (`pairs`) and for one
attention selection. A step of t <= T tokens and n <= S sequences replays it
on static buffers: its tokens and sequences, then one more sequence owning
the rows past t in the null block (reserved, never a request's; several when
those rows pass max_model_len, which no sequence may), then empty sequences.
The Triton attention finds a program's sequence from the query starts, so
extra programs do nothing, and a row's bits do not move
(tests/kernels/test_attention_triton.py::test_a_padded_launch_keeps_every_real_row,
tests/engine/test_mixed_graph.py).

What the graph bakes in is chosen at the padded shape, as the decode graphs
do: every selection at T tokens, attention's at S sequences and the
deployment's longest KV, with no host query lengths, so the short launch is
always in (its programs skip long sequences). The step picks the graph whose attention selection at that
padded shape equals its own longest query's; a step with no such graph, or
decode-only, or larger, takes the other runners. In `pinned` mode the
selections the padding can move are the neutral ones (tile heights, warps,
the combine), so bits do not change; tests/gpu/test_gpu_mixed_graph.py
checks it with `torch.equal`.
"""
from __future__ import annotations

import logging

import torch

from detent.engine.config import MIXED_GRAPH_MAX_TOKENS
from detent.engine.cuda_graph import GRAPH_SAFE_ATTENTION, NULL_BLOCK, capture_whole_model
from detent.engine.piecewise_graph import default_token_buckets
from detent.selection.context import AttentionMetadata, ForwardContext
from detent.selection.dispatch import Dispatcher

log = logging.getLogger(__name__)

MAX_TOKENS = MIXED_GRAPH_MAX_TOKENS  # the largest whole-step capture (engine/config.py says why)
SEQS = (4, 16, 64, 256)
# longest queries tried at capture: one per attention selection they reach (tile heights
# change at powers of two over the heads per KV head)
PROBE_Q = (2, 3, 4, 5, 8, 9, 16, 17, 32, 33, 64, 65, 127, 128, 129, 256, 257, 511, 512)
# attention that sizes its launch from the host's longest query (FlashAttention-4: its tile
# count reads max_seqlen_q): a graph of it is captured at the longest query a step of (T, S)
# can have, not at the shortest probe of its selection, so every replay's tiles are in the
# grid. Replays then give the eager step's bits on the H200
# (tests/gpu/test_gpu_fa4.py::test_whole_step_graph_replay_equals_eager, lease 21).
FULL_QUERY_CAPTURE = ("fa4",)


def refusal(attention_selector) -> str | None:
    """Why this deployment's attention cannot go inside a whole-step graph (None: it can).
    One implementation serves every step (docs/selir.md), so the smallest step's selection says:
    only the candidates whose replays with prompt rows were tested (GRAPH_SAFE_ATTENTION) may;
    checked before any capture runs, so such a deployment starts without them instead of
    warming 2,048-token steps only for the capture's check to refuse."""
    from detent.engine.warmup import StepShape
    impl = attention_selector(**StepShape((1,), (1,)).runtime())["impl"]
    if impl not in GRAPH_SAFE_ATTENTION:
        return f"attention {impl!r} is not known to replay correctly with prompt rows (needs one of " \
               f"{GRAPH_SAFE_ATTENTION})"
    return None


def graph_pairs(max_tokens: int, max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """(T, S) pairs to capture: the piecewise graphs' token buckets up to `max_tokens` (16, 24,
    32, 48, ..., 384, 512: lease 7's powers of two padded a 266-token step to 512 rows, and its
    mixed steps took 10.3 ms against 7.9 through the pieces), sequence buckets up to
    `max_num_seqs`, S <= 4 T (a step's own sequences are at most its tokens, plus the padding
    sequence; with S up to 4 T a step of n + n tokens and n + 1 sequences, a chunk's last
    n tokens beside n decodes, keeps its own token count: (32, 64) for n = 16, (128, 256) for 64)."""
    ts = default_token_buckets(min(max_tokens, max_num_batched_tokens, MAX_TOKENS))
    ss = sorted({min(s, max_num_seqs) for s in SEQS})
    return [(t, s) for t in ts for s in ss if s <= 4 * t]


def layout(t: int, s: int, mq: int, cap: int | None = None) -> list[int]:
    """Query counts of a capture's S sequences over T rows: mq, then decodes, then the rest
    in sequences of at most `cap` rows (the deployment's max_model_len: a longer one would
    reach past the rotary table and the block table), then empty sequences (zero queries)
    when the rows run out. Fewer decodes when the rest needs more sequences."""
    cap = cap or t
    if not 1 <= mq <= min(t, cap) or s < 1 or (s == 1 and mq != t):
        raise ValueError(f"no layout of {s} sequences over {t} rows with a longest query of {mq}")
    if s == 1:
        return [t]
    rest = t - mq
    ones = max(0, min(s - 2, rest - 1))
    while ones and 1 + ones + -(-(rest - ones) // cap) > s:
        ones -= 1
    tail = [min(cap, rest - ones - i) for i in range(0, rest - ones, cap)]
    q = [mq] + [1] * ones + tail
    if len(q) > s:
        raise ValueError(f"no layout of {s} sequences over {t} rows of at most {cap} each")
    return q + [0] * (s - len(q))


def pair_for(pairs: list[tuple[int, int]], t: int, n: int, cap: int | None = None) -> tuple[int, int] | None:
    """The smallest captured (T, S) a step of t tokens and n sequences fits; the rows past t
    need sequences of their own, of at most `cap` rows each (`MixedGraphRunner.fill`)."""
    fits = [(T, S) for T, S in pairs if T >= t and S >= n + _pad_seqs(T - t, cap)]
    return min(fits) if fits else None


def _pad_seqs(pad: int, cap: int | None) -> int:
    """Sequences the padding's `pad` rows take: at most `cap` rows each (None: one)."""
    return 0 if pad <= 0 else 1 if cap is None else -(-pad // cap)


class MixedGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 dispatcher: Dispatcher, device: torch.device, *, max_model_len: int,
                 pairs: list[tuple[int, int]], attention_site: tuple):
        self.model, self.kv_caches, self.block_size = model, kv_caches, block_size
        self.dispatcher, self.device = dispatcher, device
        self.max_model_len, self.site = max_model_len, attention_site
        self.pairs = sorted(set(pairs))
        t_max = max(t for t, _ in self.pairs)
        s_max = max(s for _, s in self.pairs)
        self.max_blocks = -(-max_model_len // block_size)
        i32 = dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(t_max, dtype=torch.long, device=device)
        self.positions = torch.zeros(t_max, dtype=torch.long, device=device)
        self.slots = torch.full((t_max,), -1, dtype=torch.long, device=device)
        # the padding sequence's positions and null-block slots, made once
        # a padding sequence restarts its positions every max_model_len rows (`layout`, `fill`)
        self.pad_positions = torch.arange(t_max, dtype=torch.long, device=device) % max_model_len
        self.pad_slots = NULL_BLOCK * block_size + self.pad_positions % block_size
        self.qsl = torch.zeros(s_max + 1, **i32)
        self.seq_lens = torch.ones(s_max, **i32)
        self.block_tables = torch.full((s_max, self.max_blocks), NULL_BLOCK, **i32)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple, torch.Tensor] = {}
        self._keys: dict[tuple[int, int, int], tuple] = {}
        self.pool = None
        self.disabled: str | None = None

    # ------------------------------------------------------------ selection at the padded shape
    def _meta(self, t: int, s: int, mq: int) -> AttentionMetadata:
        """Metadata of the padded shape, what the graph's launches are decided from: no host
        query lengths (so the short launch is always in), the longest KV; the kernels read
        the step's own values from the device buffers."""
        return AttentionMetadata(
            query_start_loc=self.qsl[:s + 1], seq_lens=self.seq_lens[:s], block_tables=self.block_tables[:s],
            slot_mapping=self.slots[:t], num_seqs=s, num_tokens=t, max_seqlen_q=mq,
            max_seqlen_k=self.max_model_len, block_size=self.block_size, query_start_loc_cpu=(),
            seq_lens_cpu=(self.max_model_len,) * s)

    def key(self, t: int, s: int, mq: int) -> tuple:
        """Attention's selection at the padded shape: T tokens, S sequences, longest query mq,
        the longest KV (the runtime values the capture's forward context gives it)."""
        k = self._keys.get((t, s, mq))
        if k is None:
            rt = ForwardContext(attn=self._meta(t, s, mq)).runtime(t)
            k = self._keys[(t, s, mq)] = tuple(sorted(self.dispatcher.select("attention", self.site, rt).items()))
        return k

    # ------------------------------------------------------------ capture
    def _set_layout(self, t: int, s: int, mq: int) -> None:
        """The capture's step: sequence 0 with mq queries, decodes, a sequence owning the rest of
        the T rows, and empty sequences where the rows run out, all in the null block (every row
        computes on finite values; the launches are decided from host values alone)."""
        q = layout(t, s, mq, self.max_model_len)
        qsl = [0]
        for n in q:
            qsl.append(qsl[-1] + n)
        self.input_ids[:t].zero_()
        self.positions[:t].copy_(torch.cat([self.pad_positions[:n] for n in q]))
        self.slots[:t].copy_(torch.cat([self.pad_slots[:n] for n in q]))
        self.qsl[:s + 1].copy_(torch.tensor(qsl, dtype=torch.int32))
        self.seq_lens[:s].copy_(torch.tensor([max(n, 1) for n in q], dtype=torch.int32))
        self.block_tables[:s].fill_(NULL_BLOCK)

    def plan(self) -> list[tuple[int, int, int]]:
        """(T, S, longest query) to capture, largest first: one per attention selection the
        probes reach at (T, S), and only where a step with that selection can need T tokens
        (its longest query times S passes the next smaller token bucket: a 16-row tile's steps
        of 4 sequences never reach 512 tokens)."""
        out = []
        ts = sorted({t for t, _ in self.pairs})
        ss = sorted({s for _, s in self.pairs})
        for t, s in sorted(self.pairs, reverse=True):
            smaller = max([x for x in ts if x < t], default=0)
            # the fewest sequences of a step that takes this pair: the next smaller sequence
            # bucket (it then needs a padding sequence), or one
            fewest = max([x for x in ss if x < s], default=1)
            reach: dict[tuple, list[int]] = {}
            for mq in PROBE_Q:
                if mq + fewest - 1 <= t and mq <= self.max_model_len and self._fits(t, s, mq):
                    reach.setdefault(self.key(t, s, mq), []).append(mq)
            for key, mqs in reach.items():
                if max(mqs) * s > smaller:
                    full = dict(key).get("impl") in FULL_QUERY_CAPTURE
                    out.append((t, s, self._longest_query(t, s) if full else mqs[0]))
        return out

    def _longest_query(self, t: int, s: int) -> int:
        """The longest query a step replaying (T, S) can have: T, or max_model_len. Its layout
        fits wherever a probe's did: a longer first sequence leaves the others fewer rows."""
        return min(t, self.max_model_len)

    def _fits(self, t: int, s: int, mq: int) -> bool:
        """Whether T rows fit S sequences of at most max_model_len tokens with one of mq."""
        try:
            layout(t, s, mq, self.max_model_len)
        except ValueError:
            return False
        return True

    @torch.inference_mode()
    def capture(self) -> "MixedGraphRunner":
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        try:
            for t, s, mq in self.plan():  # largest first: later graphs reuse its pool
                gkey = (t, s, self.key(t, s, mq))
                self._set_layout(t, s, mq)
                ctx = ForwardContext(attn=self._meta(t, s, mq), kv_caches=self.kv_caches,
                                     dispatcher=self.dispatcher)
                g, out = capture_whole_model(self.model, self.input_ids[:t], self.positions[:t], ctx, self.pool)
                if self.pool is None:
                    self.pool = g.pool()
                self.graphs[gkey], self.outputs[gkey] = g, out
        except Exception as e:  # noqa: BLE001  (any capture failure: the other runners serve, say why)
            self.graphs.clear()
            self.outputs.clear()
            self.disabled = f"mixed-step CUDA-graph capture failed ({type(e).__name__}: {e}); those steps " \
                            f"replay the piecewise graphs"
            log.warning(self.disabled)
        torch.cuda.synchronize(self.device)
        return self

    # ------------------------------------------------------------ replay
    def step_key(self, attn: AttentionMetadata) -> tuple | None:
        """(T, S, attention selection at the padded shape) of the graph this step would
        replay; None for a decode-only step, or one no pair holds."""
        t, n, mq = attn.num_tokens, attn.num_seqs, attn.max_seqlen_q
        if mq == 1 and t == n:  # decode-only: the decode graphs'
            return None
        if attn.block_tables.shape[1] > self.max_blocks:
            return None
        pair = pair_for(self.pairs, t, n, self.max_model_len)
        return None if pair is None else (pair[0], pair[1], self.key(pair[0], pair[1], mq))

    def plan_entry(self, attn: AttentionMetadata) -> tuple[int, int, int] | None:
        """The (T, S, longest query) of `plan()` this step's graph is captured from."""
        k = self.step_key(attn)
        return None if k is None else {(t, s, self.key(t, s, mq)): (t, s, mq) for t, s, mq in self.plan()}.get(k)

    def graph_for(self, attn: AttentionMetadata) -> tuple | None:
        if self.disabled or not self.graphs:
            return None
        gkey = self.step_key(attn)
        return gkey if gkey in self.graphs else None

    def fill(self, input_ids: torch.Tensor, positions: torch.Tensor, attn: AttentionMetadata, t_pad: int,
             s_pad: int) -> AttentionMetadata:
        """Copy the step into the static buffers, padded to t_pad tokens and s_pad sequences:
        the rows past the step's belong to one more sequence in the null block (its own
        queries over its own keys, so every row the graph computes is finite, as the decode
        graphs' padding is; one per max_model_len rows, as a longer one would read past the
        rotary table and the block table), and the sequences after them are empty. Returns the
        metadata the graph's kernels then read (device tensors only)."""
        t, n = attn.num_tokens, attn.num_seqs
        pad = t_pad - t
        self.input_ids[:t].copy_(input_ids)
        self.positions[:t].copy_(positions)
        self.slots[:t].copy_(attn.slot_mapping)
        self.qsl[:n + 1].copy_(attn.query_start_loc)
        self.seq_lens[:n].copy_(attn.seq_lens)
        w = attn.block_tables.shape[1]
        self.block_tables[:n, :w].copy_(attn.block_tables)
        k = n + _pad_seqs(pad, self.max_model_len)
        if pad:
            if s_pad < k:
                raise ValueError(f"{pad} padded rows need a sequence of their own per {self.max_model_len} rows: "
                                 f"s_pad {s_pad} < {k}")
            self.input_ids[t:t_pad].zero_()
            self.positions[t:t_pad].copy_(self.pad_positions[:pad])
            self.slots[t:t_pad].copy_(self.pad_slots[:pad])
            cap = self.max_model_len
            for i in range(k - n):  # fill_, not `[i] = v`: that copies from the host and waits
                rows = min(cap, pad - i * cap)
                self.qsl[n + 1 + i:n + 2 + i].fill_(t + i * cap + rows)
                self.seq_lens[n + i:n + i + 1].fill_(rows)
                self.block_tables[n + i].fill_(NULL_BLOCK)
        if s_pad > k:  # empty sequences: no query
            self.qsl[k + 1:s_pad + 1].fill_(t_pad)
            self.seq_lens[k:s_pad].fill_(1)
            self.block_tables[k:s_pad, 0].fill_(NULL_BLOCK)
        return AttentionMetadata(
            query_start_loc=self.qsl[:s_pad + 1], seq_lens=self.seq_lens[:s_pad],
            block_tables=self.block_tables[:s_pad], slot_mapping=self.slots[:t_pad], num_seqs=s_pad,
            num_tokens=t_pad, max_seqlen_q=attn.max_seqlen_q, max_seqlen_k=self.max_model_len,
            block_size=self.block_size)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor | None:
        gkey = self.graph_for(ctx.attn)
        if gkey is None:
            return None
        self.fill(input_ids, positions, ctx.attn, gkey[0], gkey[1])
        self.graphs[gkey].replay()
        return self.outputs[gkey][:ctx.attn.num_tokens]


def enable_mixed_graphs(runner, *, max_tokens: int, max_num_seqs: int, max_num_batched_tokens: int,
                        max_model_len: int, attention_site: tuple) -> MixedGraphRunner:
    """Capture whole-step graphs for small steps with prompt tokens and put them in front of
    the runner's `_forward` (decode graphs and piecewise graphs behind them)."""
    inner = runner._forward
    g = MixedGraphRunner(runner.model, runner.kv_caches, runner.block_size, runner.dispatcher, runner.device,
                         max_model_len=max_model_len, attention_site=attention_site,
                         pairs=graph_pairs(max_tokens, max_num_seqs, max_num_batched_tokens)).capture()
    if g.disabled is None:
        def forward(input_ids, positions, ctx):
            out = g.run(input_ids, positions, ctx)
            if out is None:
                return inner(input_ids, positions, ctx)
            runner.forward_path = "whole_graph"
            return out
        runner._forward = forward
    runner.mixed_graphs = g
    return g
