"""The model runner: one forward over a mixed prefill + decode batch, then
sampling and prompt logprobs.

Per step it (1) builds the flattened batch and the attention metadata on the
host with numpy, (2) copies it to the device in one transfer, (3) runs the
model inside one forward context (`_forward`, the single place a GPU
helper replaces with CUDA-graph replay for decode batches), (4) gathers the
rows that sample, computes their logits and calls the sampler, and (5)
scores the prompt rows that asked for prompt logprobs.

The runner never allocates blocks: block tables arrive in the plan.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np
import torch

from detent.selection.context import AttentionMetadata, ForwardContext, forward_context
from detent.sampling import sampler as sampling
from detent.sampling.rng import to_device
from detent.scheduler.outputs import PLACEHOLDER, ModelOutput, SampledToken, SchedulerOutput
from detent.selection.dispatch import Dispatcher, use_dispatcher

PROMPT_LOGPROBS_ROWS = 256  # prompt rows scored per log-softmax call (bounds the [rows, vocab] buffer)
PACK_ALIGN = 2  # int64 elements: 16 bytes, the pointer alignment Triton specializes on


@dataclass
class StepHandle:
    """A launched step: its plan and its results, still on the device.

    `deferred` holds (logits, rows, last tokens) while the step's sampling
    waits for the previous step's tokens to reach the host (a grammar row
    whose last token was pending: `ModelRunner.sample_deferred`); `sampled`
    is None until then. Nothing else changes after the launch."""
    plan: SchedulerOutput
    sampled: "sampling.PendingSample | None"
    sample_row: dict[str, int]  # request id -> its row in `sampled`
    prompt_logprobs: "PendingPromptLogprobs | None"
    # CUDA events around the step's work on the device stream (timing only), or None
    events: "tuple[torch.cuda.Event, torch.cuda.Event] | None" = None
    # host seconds of the launch's parts: preparing the inputs, the model call (graph replays,
    # eager kernels between pieces); the rest of the launch is sampling and prompt logprobs
    launch_split: tuple[float, float] | None = None
    # what served the model call: "eager", "pieces", "decode_graph" or "whole_graph"
    forward_path: str | None = None
    deferred: tuple | None = None


@dataclass(frozen=True)
class Batch:
    """A step's device tensors plus the host values kernels and selectors read."""
    input_ids: torch.Tensor  # [T] long
    positions: torch.Tensor  # [T] long
    attn: AttentionMetadata
    sample_rows: torch.Tensor  # [R] long: flattened index of each sampling row
    prompt_rows: torch.Tensor  # [P] long: flattened index of each prompt-logprob row


class ModelRunner:
    # a step whose grammar rows wait for their last token is launched without its sampling,
    # sampled later by `sample_deferred` (the scheduler's `grammar_after_launch`)
    samples_after_launch = True

    def __init__(self, model: torch.nn.Module, kv_caches: list[torch.Tensor], block_size: int,
                 dispatcher: Dispatcher, device: torch.device):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.dispatcher = dispatcher
        self.device = device

    # ------------------------------------------------------------ step
    def execute(self, plan: SchedulerOutput) -> ModelOutput:
        return self.collect(self.launch(plan))

    @torch.inference_mode()
    def launch(self, plan: SchedulerOutput, prev: "StepHandle | None" = None) -> "StepHandle":
        """Queue the step's forward and sampling on the device; do not wait for them.

        Input tokens the host does not know yet (`PLACEHOLDER`, the tokens `prev`
        sampled) are taken from `prev`'s device tensor. Neither sampling nor prompt
        logprobs wait for the device (tests/sampling/test_no_sync.py): their
        values reach the host in `collect`.

        A sampling row with a grammar whose last token is pending needs that token
        on the host first (the grammar advances on it): the step's sampling then
        waits in `handle.deferred` for `sample_deferred`, while the forward is
        already queued."""
        t0 = time.perf_counter()
        events = None
        if self.device.type == "cuda":  # the step's span on the device, for the engine's counters
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        batch = self.prepare(plan, prev)
        ctx = ForwardContext(attn=batch.attn, kv_caches=self.kv_caches, dispatcher=self.dispatcher)
        t1 = time.perf_counter()
        self.forward_path = "eager"  # a graph runner in front of _forward names its own path
        with forward_context(ctx):
            hidden = self._forward(batch.input_ids, batch.positions, ctx)  # [T, hidden]
            t2 = time.perf_counter()
            sampled, deferred = self._sample(plan, hidden, batch)
            prompt_lps = self._prompt_logprobs(plan, hidden, batch)
        if events is not None and deferred is None:
            events[1].record()
        ids = [s.request_id for s in plan.seqs if s.sample is not None]
        return StepHandle(plan, sampled, {rid: i for i, rid in enumerate(ids)}, prompt_lps, events,
                          (t1 - t0, t2 - t1), self.forward_path, deferred)

    @torch.inference_mode()
    def sample_deferred(self, handle: "StepHandle", live: Callable[[str], bool]) -> None:
        """Sample `handle`'s rows now that the previous step's tokens have advanced
        their grammars (the scheduler's update). The rows are the ones planned, so
        the bits are those of sampling at launch after a collected step. A row whose
        request ended meanwhile (`live(request_id)` false) is sampled without its
        grammar, which may have terminated: the scheduler drops that row's token."""
        logits, rows, last = handle.deferred
        rows = [r if r.grammar is None or live(rid) else replace(r, grammar=None)
                for rid, r in zip(handle.sample_row, rows)]
        with use_dispatcher(self.dispatcher):  # outside the step's forward context
            handle.sampled, handle.deferred = sampling.sample_async(logits, rows, last), None
        if handle.events is not None:
            handle.events[1].record()

    @staticmethod
    def collect(handle: "StepHandle") -> ModelOutput:
        """Wait for `handle`'s results and hand them over as host values."""
        if handle.deferred is not None:
            raise RuntimeError("collect: the step's sampling is deferred; call sample_deferred first")
        plps = {} if handle.prompt_logprobs is None else handle.prompt_logprobs.resolve()
        if handle.sampled is None:
            return ModelOutput({}, plps)
        out = handle.sampled.resolve()
        return ModelOutput({rid: SampledToken(out.token_ids[i], (out.logprobs[i], out.ranks[i],
                                                                 tuple(out.topk_ids[i]), tuple(out.topk_logprobs[i])))
                            for rid, i in handle.sample_row.items()}, plps)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 ctx: ForwardContext) -> torch.Tensor:
        """The model call (hook: CUDA-graph replay for decode-only batches)."""
        return self.model(input_ids, positions)

    # ------------------------------------------------------------ host side
    def prepare(self, plan: SchedulerOutput, prev: "StepHandle | None" = None) -> Batch:
        seqs = plan.seqs
        bs = self.block_size
        qlens = np.fromiter((s.num_tokens for s in seqs), dtype=np.int64, count=len(seqs))
        starts = np.fromiter((s.start for s in seqs), dtype=np.int64, count=len(seqs))
        seq_lens = starts + qlens
        qsl = np.zeros(len(seqs) + 1, dtype=np.int64)
        np.cumsum(qlens, out=qsl[1:])
        t = int(qsl[-1])
        ids = np.fromiter((tok for s in seqs for tok in s.token_ids), dtype=np.int64, count=t)
        seq_of = np.repeat(np.arange(len(seqs)), qlens)  # [T] the sequence each token belongs to
        positions = np.arange(t, dtype=np.int64) - qsl[seq_of] + starts[seq_of]
        max_blocks = max(len(s.block_ids) for s in seqs)
        tables = np.zeros((len(seqs), max_blocks), dtype=np.int64)
        for i, s in enumerate(seqs):
            tables[i, :len(s.block_ids)] = s.block_ids
        slots = tables[seq_of, positions // bs] * bs + positions % bs
        sample_rows = np.array([qsl[i + 1] - 1 for i, s in enumerate(seqs) if s.sample is not None],
                               dtype=np.int64)
        p_rows = [qsl[i] + (s.prompt_rows_start - s.start) + np.arange(len(s.prompt_targets))
                  for i, s in enumerate(seqs) if s.prompt_targets]
        p_rows = np.concatenate(p_rows) if p_rows else np.zeros(0, dtype=np.int64)
        holes = np.flatnonzero(ids == PLACEHOLDER)  # tokens sampled by `prev`, not on the host yet
        if holes.size and prev is None:
            raise RuntimeError("the plan has placeholder tokens but no previous step to take them from")
        src = np.fromiter((prev.sample_row[seqs[i].request_id] for i in seq_of[holes]), dtype=np.int64,
                          count=holes.size) if holes.size else holes

        # one host -> device copy for everything, each part 16-byte aligned: Triton specializes a
        # kernel on whether a pointer is, so an unaligned part (the positions after an odd token
        # count) would compile a variant that the warm start did not run
        parts = [ids, positions, slots, qsl, seq_lens, tables.reshape(-1), sample_rows, p_rows, holes, src]
        offsets = np.cumsum([0] + [-(-p.size // PACK_ALIGN) * PACK_ALIGN for p in parts])
        buf = np.zeros(int(offsets[-1]), dtype=np.int64)
        for p, o in zip(parts, offsets):
            buf[o:o + p.size] = p
        flat = to_device(torch.from_numpy(buf), self.device)
        views = [flat[o:o + p.size] for p, o in zip(parts, offsets)]
        ids_t, pos_t, slots_t, qsl_t, lens_t, tables_t, srows_t, prows_t, holes_t, src_t = views
        if holes.size:
            ids_t = ids_t.index_copy(0, holes_t, prev.sampled.tokens.index_select(0, src_t))
        attn = AttentionMetadata(
            query_start_loc=qsl_t.to(torch.int32), seq_lens=lens_t.to(torch.int32),
            block_tables=tables_t.view(len(seqs), max_blocks).to(torch.int32), slot_mapping=slots_t,
            num_seqs=len(seqs), num_tokens=t, max_seqlen_q=int(qlens.max()),
            max_seqlen_k=int(seq_lens.max()), block_size=bs,
            query_start_loc_cpu=tuple(qsl.tolist()), seq_lens_cpu=tuple(seq_lens.tolist()))
        return Batch(ids_t, pos_t, attn, srows_t, prows_t)

    # ------------------------------------------------------------ outputs
    def _sample(self, plan: SchedulerOutput, hidden: torch.Tensor, batch: Batch):
        """(sampled, deferred): the step's sampling, or what `sample_deferred` needs for it."""
        rows = [s.sample for s in plan.seqs if s.sample is not None]
        if not rows:
            return None, None
        logits = self.model.compute_logits(hidden.index_select(0, batch.sample_rows))  # [R, V] fp32
        # a row whose last token is still pending (async scheduling) reads it as its last input token
        last = batch.input_ids.index_select(0, batch.sample_rows) if any(r.pending for r in rows) else None
        if any(r.pending and r.grammar is not None for r in rows):
            return None, (logits, rows, last)
        return sampling.sample_async(logits, rows, last), None

    def _prompt_logprobs(self, plan: SchedulerOutput, hidden: torch.Tensor,
                         batch: Batch) -> "PendingPromptLogprobs | None":
        seqs = [s for s in plan.seqs if s.prompt_targets]
        if not seqs:
            return None
        kmax = max(s.prompt_logprobs_k for s in seqs)
        targets = [t for s in seqs for t in s.prompt_targets]
        return PendingPromptLogprobs(score_rows(self.model, hidden, batch.prompt_rows, targets, kmax),
                                     tuple((s.request_id, len(s.prompt_targets), s.prompt_logprobs_k) for s in seqs))


def score_rows(model, hidden: torch.Tensor, rows: torch.Tensor, targets: list[int],
               k: int) -> list["sampling.PendingSample"]:
    """Raw logprob, rank and top-k of `targets[i]` under the logits of
    `hidden[rows[i]]`, still on the device, in parts of PROMPT_LOGPROBS_ROWS
    rows — through the sampler's own scoring (`logprobs_of`), so prompt
    logprobs and decode logprobs are one computation (same log-softmax, same
    rank rule, same top-k tie order). `scored` brings them to the host."""
    parts = []
    for c in range(0, rows.numel(), PROMPT_LOGPROBS_ROWS):
        logits = model.compute_logits(hidden.index_select(0, rows[c:c + PROMPT_LOGPROBS_ROWS]))  # [n, V] fp32
        parts.append(sampling.logprobs_of_async(logits, targets[c:c + PROMPT_LOGPROBS_ROWS], k))
    return parts


def scored(parts: list["sampling.PendingSample"]) -> list[tuple[float, int, tuple[int, ...], tuple[float, ...]]]:
    """`score_rows`' parts as host values: (logprob, rank, top-k ids, top-k logprobs) per row."""
    out = []
    for part in parts:
        so = part.resolve()
        out += [(lp, rk, tuple(ids), tuple(vals)) for lp, rk, ids, vals in
                zip(so.logprobs, so.ranks, so.topk_ids or [()] * len(so.logprobs),
                    so.topk_logprobs or [()] * len(so.logprobs))]
    return out


@dataclass(frozen=True)
class PendingPromptLogprobs:
    """A step's prompt logprobs while still on the device: the scored rows
    (`score_rows`) and whose they are, (request id, rows, k) in row order."""
    parts: list
    seqs: tuple[tuple[str, int, int], ...]

    def resolve(self) -> dict[str, tuple]:
        """request id -> its rows' (logprob, rank, top-k ids, top-k logprobs), top-k cut to its k."""
        results, out, o = scored(self.parts), {}, 0
        for rid, n, k in self.seqs:
            out[rid] = tuple((lp, rk, ids[:k], lps[:k]) for lp, rk, ids, lps in results[o:o + n])
            o += n
        return out
