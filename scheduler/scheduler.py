"""Continuous batching with chunked prefill and preemption by recompute.

Each step gets a token budget (`max_num_batched_tokens`) and a sequence
limit (`max_num_seqs`). Running requests are served first — decodes before
prefill chunks, so a long prompt never starves the requests already
generating — then waiting requests are admitted in arrival order, each
after a prefix-cache lookup. A prompt longer than the remaining budget is
cut into chunks across steps.

When the KV pool runs out, the most recently admitted running request is
preempted: its blocks are released, its `num_computed_tokens` goes back to
0 and it returns to the front of the queue. On resume it recomputes prompt
+ outputs (often hitting its own cached blocks) and continues; since every
kernel is batch-invariant it produces exactly the tokens it would have.

The scheduler never touches tensors: it hands the runner a frozen
`SchedulerOutput` and takes back a frozen `ModelOutput`.

Overlap (the engine plans step N+1 while step N runs on the device):
`schedule()` advances `num_computed_tokens` as it plans, and a request that
samples gets `num_pending = 1` until `update()` brings the token. The next
plan may then include that request with a `PLACEHOLDER` for the token, which
the runner fills from step N's device tensor; its sampling row says so
(`SamplingRow.pending`), for what reads the output so far. A request whose
pending token must be its last (max_tokens, max_model_len) is not planned
again; one that needs its token on the host (`Request.needs_token_feedback`)
waits for it (a grammar request does not when `grammar_after_launch`: the
runner samples its row once the token has reached the host and advanced the
grammar); a request that turns out finished when its token arrives is
dropped from the step already launched for it (that row's token is
discarded). Prompt-logprob rows are planned after those already planned
(`Request.num_prompt_logprobs_planned`), as a chunk's rows may still be on
the device when the next chunk, or a recompute after preemption, is planned.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable

from detent.scheduler.block_manager import BlockManager
from detent.sampling.sampler import SamplingRow
from detent.scheduler.outputs import PLACEHOLDER, ModelOutput, ScheduledSeq, SchedulerOutput
from detent.scheduler.request import Request, RequestStatus


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # a step that carries decodes takes at most this many tokens in all (None: the
    # whole budget): prompts then wait for later steps instead of stalling every
    # generating request behind one long step
    max_mixed_batched_tokens: int | None = None
    # a step that carries decodes and passes this many tokens ends on a multiple of it:
    # its last prompt chunk leaves the rest to the next step (None: off). Chunking is
    # invariant, so no bits change; what changes is the step's GEMM shapes (on the
    # H200 one 1,024-token prompt and one decode cost 34.8 ms at a 1,152-token step,
    # 25.8 ms for the prompt alone: docs/performance.md)
    mixed_token_align: int | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "max_mixed_batched_tokens",
                     "mixed_token_align"):
            v = getattr(self, name)
            if name in ("max_mixed_batched_tokens", "mixed_token_align") and v is None:
                continue
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be a positive int, got {v!r}")


class Scheduler:
    def __init__(self, limits: SchedulerLimits, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True,
                 stop_strings: Callable[[Request], str | None] | None = None,
                 grammar_after_launch: bool = False):
        """`num_blocks` KV blocks of `block_size` tokens (the null block included):
        the scheduler owns the `BlockManager` that hands them out.
        `stop_strings(req)`: the request's text is detokenized up to its last
        token; the stop string it now holds, if any (the engine's output
        processor). The scheduler decides every stop, this one included.
        `grammar_after_launch`: the runner can sample a step's rows after the
        step is launched (ModelRunner.sample_deferred), so a grammar request is
        planned while its last token is still on the device."""
        self.limits = limits
        self.grammar_after_launch = grammar_after_launch
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching)
        self.stop_strings = stop_strings
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}  # every unfinished request by id
        self.finished_ids: list[str] = []  # finished since the last plan run (SchedulerOutput.finished_ids)
        self.num_preemptions = 0

    # ------------------------------------------------------------ queue edits
    def add(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in use")
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def finish(self, req: Request, status: RequestStatus, stop_reason: int | str | None = None) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self.waiting.remove(req)
        self.bm.free_request(req)
        if req.grammar is not None:  # a compile no request waits for any more is dropped
            req.grammar.release()
        req.status, req.stop_reason = status, stop_reason
        self.requests.pop(req.request_id, None)
        self.finished_ids.append(req.request_id)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is not None:
            self.finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.bm.free_request(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    # ------------------------------------------------------------ planning
    def schedule(self) -> SchedulerOutput:
        budget = self.limits.max_num_batched_tokens
        planned: dict[str, int] = {}  # request id -> tokens this step, in plan order
        preempted: list[str] = []

        decodes = [r for r in self.running if not r.is_prefill]
        prefills = [r for r in self.running if r.is_prefill]
        budget = self._plan_running(decodes, budget, planned, preempted)
        align = None
        if planned:  # the step carries decodes: prompts get what the mixed budget leaves
            budget = self._mixed_budget(budget)
            align = self.limits.mixed_token_align
        budget = self._plan_running(prefills, budget, planned, preempted, align)

        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            # a request whose grammar is still compiling waits; the ready ones behind it go first
            # (a preempted request whose last token is still on the device waits for it too)
            req = next((r for r in self.waiting if self._admittable(r)), None)
            if req is None:
                break
            # prompt logprobs need every prompt row computed, so they skip the cache
            hits = [] if req.wants_prompt_logprobs else self.bm.find_cached_blocks(req)
            done = len(hits) * self.bm.block_size
            n = min(req.num_tokens - done, budget)
            more = align and budget > n and self._can_admit_another(req, 1)
            cut = n if more else self._aligned(planned, n, align)
            if not self.bm.allocate(req, cut, hits):
                break
            self.waiting.remove(req)
            req.num_computed_tokens = done
            if req.num_cached_tokens < 0:  # first admission (a preempted request's re-admission is not a query)
                self.bm.record_lookup(req.num_tokens, done, enabled=not req.wants_prompt_logprobs)
                req.num_cached_tokens = done
                req.scheduled_time = time.monotonic()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            planned[req.request_id] = cut
            budget = 0 if cut < n else budget - n  # a cut chunk ends the step

        seqs = []
        for rid, n in planned.items():
            req = self.requests[rid]
            seqs.append(self._plan(req, n))
            req.num_computed_tokens += n
            if seqs[-1].sample is not None:
                req.num_pending += 1
        finished = ()
        if seqs:  # an empty plan is not run: the next one says them
            finished, self.finished_ids = tuple(self.finished_ids), []
        return SchedulerOutput(tuple(seqs), sum(planned.values()), tuple(preempted), finished)

    def _plan_running(self, reqs: list[Request], budget: int, planned: dict[str, int],
                      preempted: list[str], align: int | None = None) -> int:
        """Plan running requests in order (preempting the newest when blocks run out); the budget left."""
        for i, req in enumerate(reqs):
            if req.status != RequestStatus.RUNNING or budget == 0 or not self._plannable(req):
                continue
            want = min(req.num_tokens + req.num_pending - req.num_computed_tokens, budget)
            # only the step's last chunk is cut (a chunk another can follow is taken whole)
            more = align and budget > want and (self._can_admit_another(None, 0) or any(
                r.status == RequestStatus.RUNNING and self._plannable(r) for r in reqs[i + 1:]))
            n = want if more else self._aligned(planned, want, align)
            while not self.bm.allocate(req, n):
                victim = self.running[-1]  # the most recently admitted
                self._preempt(victim)
                preempted.append(victim.request_id)
                budget += planned.pop(victim.request_id, 0)
                if victim is req:
                    break
            else:
                planned[req.request_id] = n
                budget = 0 if n < want else budget - n  # a cut chunk ends the step
        return budget

    @staticmethod
    def _aligned(planned: dict[str, int], n: int, align: int | None) -> int:
        """How many of the step's last chunk's `n` tokens to take after those `planned`: all,
        or fewer so that a step past `align` tokens ends on a multiple of it
        (mixed_token_align). A chunk another chunk can follow in the same step is taken
        whole (the callers' `more`): under a queue of prompts the step then fills its
        budget instead of ending at the first multiple. A chunk that would be cut to
        nothing is taken whole: it must not wait behind decodes that alone pass a multiple."""
        if not align:
            return n
        used = sum(planned.values())
        if used + n <= align:
            return n
        cut = n - (used + n) % align
        return cut if cut > 0 else n

    def _mixed_budget(self, budget: int) -> int:
        """What is left of `budget` once the step carries decodes (max_mixed_batched_tokens)."""
        cap = self.limits.max_mixed_batched_tokens
        if cap is None:
            return budget
        used = self.limits.max_num_batched_tokens - budget
        return max(0, min(budget, cap - used))

    def _can_admit_another(self, but: Request | None, admitting: int) -> bool:
        """Could this step admit a waiting request other than `but`, with `admitting` more about
        to run (a sequence slot left and one ready to take it)?"""
        return len(self.running) + admitting < self.limits.max_num_seqs and any(
            r is not but and self._admittable(r) for r in self.waiting)

    @staticmethod
    def _admittable(req: Request) -> bool:
        """A waiting request that can be admitted now: its grammar compiled, and (preempted) its
        last token no longer on the device."""
        return (req.grammar is None or req.grammar.ready) and not req.num_pending

    def num_left_out(self, plan: SchedulerOutput) -> int:
        """Running requests past their prompt that `plan` leaves out though they could run
        (not waiting for their last token or for host feedback): each gets its next token a step
        later. Continuous batching plans every such request every step, so this stays 0 unless a
        limit (the token budget, blocks) cut the step."""
        if len(plan.seqs) == len(self.running):  # every planned request runs: none is left out
            return 0
        planned = {s.request_id for s in plan.seqs}
        return sum(1 for r in self.running
                   if r.request_id not in planned and not r.is_prefill and self._plannable(r))

    def _plannable(self, req: Request) -> bool:
        """False while its pending token is needed on the host first, or will be its last."""
        if not req.num_pending:
            return True
        p = req.params
        last = (req.num_tokens + req.num_pending >= self.limits.max_model_len
                or (p.max_tokens is not None and req.num_output_tokens + req.num_pending >= p.max_tokens))
        return not last and not self.waits_for_token(req)

    def waits_for_token(self, req: Request) -> bool:
        """Must `req`'s pending token reach the host before its next step is planned
        (`Request.needs_token_feedback`, under this scheduler's runner)?"""
        return req.needs_token_feedback(self.grammar_after_launch)

    def _plan(self, req: Request, n: int) -> ScheduledSeq:
        start = req.num_computed_tokens
        end = start + n
        known = req.num_tokens  # tokens the host has; the pending one is a placeholder
        sample = None
        if end == known + req.num_pending:
            # prompt/output ids are the request's own (read-only views, valid for this step):
            # copying them every step would cost O(length) per request per step
            sample = SamplingRow(params=req.params, seed=req.seed, position=end,
                                 sample_index=req.sample_index,
                                 prompt_token_ids=req.prompt_array,
                                 output_token_ids=req.output_array,
                                 golden_token=req.golden_token, grammar=req.grammar,
                                 eos_token_ids=tuple(req.eos_token_ids), pending=req.num_pending,
                                 mask_ids=req.mask_ids)
        k, lo, targets = 0, 0, ()
        if req.wants_prompt_logprobs:
            # row p predicts prompt token p + 1; rows already planned (before a preemption) are skipped
            lo = max(start, req.num_prompt_logprobs_planned)
            hi = min(end, req.num_prompt_tokens - 1)
            if hi > lo:
                k = req.params.prompt_logprobs
                targets = tuple(req.prompt_token_ids[lo + 1:hi + 1])
                req.num_prompt_logprobs_planned = hi
        ids = tuple(req.all_token_ids[start:end]) + (PLACEHOLDER,) * max(0, end - max(start, known))
        return ScheduledSeq(req.request_id, ids, start, tuple(req.block_ids), sample, k, lo, targets)

    # ------------------------------------------------------------ results
    def update(self, plan: SchedulerOutput, out: ModelOutput) -> list[Request]:
        """Advance the counters by the step's results and finish the requests
        that stop (EOS, stop token ids, max_tokens, max_model_len, grammar,
        stop strings); returns the requests that got a token (finished ones
        included, already freed)."""
        progressed = []
        for seq in plan.seqs:
            req = self.requests.get(seq.request_id)
            if req is None:  # finished (or aborted) after this step was launched: drop its row
                continue
            if seq.prompt_targets:
                req.prompt_logprobs.extend(out.prompt_logprobs[seq.request_id])
            if seq.sample is None:
                continue
            req.num_pending -= 1
            st = out.sampled[seq.request_id]
            accepted = None  # the grammar's verdict on the token, where the request has a grammar
            if req.grammar is not None:
                accepted = self._accept_or_none_in_common(req, st.token_id)
                if accepted is None:
                    progressed.append(req)
                    continue
            elif req.mask_ids is not None and req.mask_ids.kinds and self._none_left(req, st.token_id):
                progressed.append(req)
                continue
            req.append_output_token(st.token_id)
            req.output_logprobs.append(st.logprobs)
            stop = self._check_stop(req, st.token_id)
            if req.grammar is not None:
                stop = self._grammar_stop(req, st.token_id, accepted, stop)
            if stop is not None:
                self.finish(req, *stop)
            if self.stop_strings is not None:  # after the finish: a finished request flushes its text
                hit = self.stop_strings(req)
                if hit is not None:
                    self._stop_at_string(req, hit)
            progressed.append(req)
        return progressed

    def _stop_at_string(self, req: Request, stop: str) -> None:
        """The text reached a stop string: the request stops for it, even when the
        same token also ended it (length, EOS): the string wins, as in vLLM."""
        if req.is_finished:
            req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
        else:
            self.finish(req, RequestStatus.FINISHED_STOPPED, stop)

    def retract(self, plan: SchedulerOutput) -> None:
        """Undo a step that raised before its results came back: its requests
        return to the front of the queue to recompute, as after a preemption
        (which gives the same bits; not counted as one), and the blocks the step
        was to fill leave the prefix cache, since their KV may not be written.
        The requests it said finished are said so again by the next plan."""
        self.finished_ids[:0] = plan.finished_ids
        for seq in reversed(plan.seqs):
            req = self.requests.get(seq.request_id)
            if req is None:
                continue
            self.bm.uncache_from(req, seq.start)
            if seq.sample is not None:
                req.num_pending -= 1
            if seq.prompt_targets:  # never computed: planned again
                req.num_prompt_logprobs_planned = seq.prompt_rows_start
            if req.status == RequestStatus.RUNNING:
                self.running.remove(req)
                self.bm.free_request(req)
                req.num_computed_tokens = 0
                req.status = RequestStatus.PREEMPTED
                self.waiting.appendleft(req)

    def fail_grammar_errors(self) -> list[Request]:
        """Finish (status error) the waiting requests whose grammar failed to compile or timed out."""
        failed = [r for r in self.waiting if r.grammar is not None and r.grammar.error is not None]
        for req in failed:
            req.error = req.grammar.error
            self.finish(req, RequestStatus.FINISHED_ERROR)
        return failed

    def _accept_or_none_in_common(self, req: Request, tok: int) -> bool | None:
        """The grammar's verdict on the sampled token (it advances when True), or None where the
        request failed here because its grammar, with its allowed_token_ids where it lists some,
        left no token to sample.

        Both are hard masks (as in vLLM): the sampler draws from their intersection, and its
        fallbacks drop truncation and the soft request masks (bad words, logit_bias, min_tokens'
        bans), never these. So a drawn token outside allowed_token_ids, or one the grammar
        refuses, means the intersection was empty at this position: whatever the sampler drew
        from a row with no token left (token 0, which may be an allowed id the grammar refuses,
        or a grammar that allows nothing, as `root ::= root`). The request fails there, its
        token not emitted, naming the masks. A golden token is forced, not drawn: only the
        grammar judges it (`_grammar_stop`)."""
        allowed = req.allowed_token_set
        drawn = self._drawn(req)
        if drawn and allowed is not None and tok not in allowed:
            accepted = False
        else:
            accepted = req.grammar.accept(tok)
        if accepted or not drawn:
            return accepted
        at = f"at output token {req.num_output_tokens}"
        req.error = (f"allowed_token_ids and the structured_outputs grammar have no token in common {at}: the "
                     "grammar allows none of the allowed ids there" if allowed is not None else
                     f"the structured_outputs grammar allows no token {at}")
        self.finish(req, RequestStatus.FINISHED_ERROR)
        return None

    def _none_left(self, req: Request, tok: int) -> bool:
        """Whether the request failed here because its own masks left no token to sample (a request
        without a grammar): allowed_token_ids, bad words and min_tokens' bans are hard masks
        without one, and a drawn token that one of them bans came from a row they emptied, whatever
        the sampler took there (token 0). Admission refuses the masks that empty every row
        (RequestMaskIds.check_some_token_left); a longer bad word's prefix bans a token only where
        the output has it, and can leave allowed_token_ids or the vocabulary none there. The token
        is not emitted. (Under a grammar the sampler's fallbacks drop bad words and min_tokens,
        so only allowed_token_ids can empty its row: `_accept_or_none_in_common`.)"""
        if not self._drawn(req) or not req.mask_ids.leaves_out(tok, req.output_token_ids):
            return False
        req.error = (f"no token left to sample at output token {req.num_output_tokens}: the request's "
                     f"{' and '.join(req.mask_ids.kinds)} ban every token there")
        self.finish(req, RequestStatus.FINISHED_ERROR)
        return True

    @staticmethod
    def _drawn(req: Request) -> bool:
        """The request's next token is drawn by the sampler (not one of its golden tokens, which are forced)."""
        golden = req.params.golden_token_ids
        return not (golden is not None and req.num_output_tokens < len(golden))

    @staticmethod
    def _grammar_stop(req: Request, tok: int, accepted: bool, stop):
        """The request's stop after its grammar judged the token (`_accept_or_none_in_common`):
        a refused token fails it: a golden one, since a drawn one the grammar refuses failed there
        (docs/architecture.md, Grammar in the scheduler)."""
        if not accepted:
            req.error = f"token {tok} is not allowed by the request's structured_outputs grammar"
            return RequestStatus.FINISHED_ERROR, None
        if stop is None and req.grammar.is_terminated():
            return RequestStatus.FINISHED_STOPPED, None
        return stop

    def _check_stop(self, req: Request, tok: int):
        p = req.params
        if req.num_output_tokens >= max(p.min_tokens, 1):
            if not p.ignore_eos and tok in req.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED, None
            if tok in req.stop_token_set:
                return RequestStatus.FINISHED_STOPPED, tok
        if req.num_tokens >= self.limits.max_model_len or (
                p.max_tokens is not None and req.num_output_tokens >= p.max_tokens):
            return RequestStatus.FINISHED_LENGTH, None
        return None
