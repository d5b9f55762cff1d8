"""Turns request state into `RequestOutput`s: detokenization (and finding
stop strings in the text, for the scheduler to stop on), logprob dicts, and
the grouping of `n > 1` samples under one request id."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from detent.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from detent.scheduler.request import Request


@dataclass
class _Sample:
    req: Request
    detok: Any = None  # IncrementalDetokenizer (None without a tokenizer)
    num_decoded: int = 0  # output tokens fed to detok
    text: str = ""
    frozen: bool = False  # text cut at a stop string
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    # the chosen tokens' logprobs summed in order, one addition per new token (as vLLM's)
    cumulative_logprob: float = 0.0


@dataclass
class _Group:
    request_id: str
    prompt: str | None
    samples: list[_Sample]
    # one list for every output of the group (never copied per step: a 1k-token
    # prompt at batch 128 would cost 128k element copies a step); do not mutate
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: list | None = None
    finished_time: float | None = None


def _earliest(times) -> float | None:
    return min((t for t in times if t is not None), default=None)


class OutputProcessor:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # True: an output's token ids and logprobs are the request's own lists, which later steps
        # extend (no O(length) copy per step); for a caller that reads each output before the next
        # step, as the engine core does when it encodes the step's deltas. False: every output owns
        # its lists
        self.share_lists = False
        self.groups: dict[str, _Group] = {}
        self.parent_of: dict[str, str] = {}  # child request id -> group id

    def add(self, request_id: str, prompt: str | None, children: list[Request]) -> None:
        samples = [_Sample(r) for r in children]
        if self.tokenizer is not None:
            from detent.models.tokenizer import IncrementalDetokenizer
            for s in samples:
                s.detok = IncrementalDetokenizer(self.tokenizer, s.req.prompt_token_ids,
                                                 skip_special_tokens=s.req.params.skip_special_tokens)
        self.groups[request_id] = _Group(request_id, prompt, samples, list(children[0].prompt_token_ids))
        for r in children:
            self.parent_of[r.request_id] = request_id

    def children(self, request_id: str) -> list[Request]:
        g = self.groups.get(request_id)
        return [s.req for s in g.samples] if g else []

    def _decode(self, ids, skip_special: bool) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special)

    def update_text(self, req: Request) -> str | None:
        """Re-detokenize `req`'s output and cut its text at the first stop string;
        return that stop string, if any (the scheduler finishes the request for it)."""
        g = self.groups[self.parent_of[req.request_id]]
        s = next(x for x in g.samples if x.req is req)
        self._extend_logprobs(s)
        if s.frozen or self.tokenizer is None:
            return None
        p = req.params
        prev = len(s.text)
        for tok in req.output_token_ids[s.num_decoded:]:  # incremental: O(new tokens) per step
            s.text += s.detok.step(tok)
        s.num_decoded = req.num_output_tokens
        if req.is_finished:
            s.text += s.detok.finish()  # flush text held back for an incomplete character
        if not p.stop or req.num_output_tokens < max(p.min_tokens, 1):
            return None
        best = None
        for stop in p.stop:
            i = s.text.find(stop, max(0, prev - len(stop) + 1))
            if i >= 0 and (best is None or i < best[0]):
                best = (i, stop)
        if best is None:
            return None
        i, stop = best
        s.text = s.text[:i + len(stop)] if p.include_stop_str_in_output else s.text[:i]
        s.frozen = True
        return stop

    def _extend_logprobs(self, s: _Sample) -> None:
        req = s.req
        if req.params.logprobs is None:
            return
        for j in range(len(s.logprobs), req.num_output_tokens):
            tok = req.output_token_ids[j]
            lp, rank, ids, vals = req.output_logprobs[j]
            s.logprobs.append(self._position(tok, lp, rank, ids, vals))
            s.cumulative_logprob += lp

    def _position(self, tok, lp, rank, ids, vals) -> dict[int, Logprob]:
        d = {tok: Logprob(lp, rank, self._decode([tok], False) or None)}
        for r, (i, v) in enumerate(zip(ids, vals), start=1):
            if i not in d:
                d[i] = Logprob(v, r, self._decode([i], False) or None)
        return d

    def _prompt_logprobs(self, g: _Group) -> list | None:
        req = g.samples[0].req
        if not req.wants_prompt_logprobs:
            return None
        if g.prompt_logprobs is None or len(g.prompt_logprobs) < req.num_prompt_tokens:
            g.prompt_logprobs = [None] + [self._position(req.prompt_token_ids[p + 1], *row)
                                          for p, row in enumerate(req.prompt_logprobs)]
        return g.prompt_logprobs

    def make_output(self, request_id: str) -> RequestOutput:
        g = self.groups[request_id]
        outs = []
        own = list if not self.share_lists else (lambda xs: xs)
        for i, s in enumerate(g.samples):
            r = s.req
            want_lp = r.params.logprobs is not None
            self._extend_logprobs(s)  # a no-op once update_text has seen the step
            outs.append(CompletionOutput(
                index=i, text=s.text, token_ids=own(r.output_token_ids),
                cumulative_logprob=s.cumulative_logprob if want_lp else None,
                logprobs=own(s.logprobs) if want_lp else None,
                finish_reason=r.status.value if r.is_finished else None,
                stop_reason=r.stop_reason, seed=r.seed))
        finished = all(s.req.is_finished for s in g.samples)
        first = g.samples[0].req
        if finished and g.finished_time is None:
            g.finished_time = time.monotonic()
        errors = [s.req.error for s in g.samples if s.req.error]
        return RequestOutput(
            request_id=request_id, prompt=g.prompt, prompt_token_ids=g.prompt_token_ids,
            prompt_logprobs=self._prompt_logprobs(g), outputs=outs, finished=finished,
            num_cached_tokens=max(first.num_cached_tokens, 0),
            metrics=RequestMetrics(first.arrival_time, _earliest(s.req.first_token_time for s in g.samples),
                                   g.finished_time, sum(s.req.num_preemptions for s in g.samples),
                                   _earliest(s.req.scheduled_time for s in g.samples),
                                   max((t for s in g.samples if (t := s.req.last_token_time) is not None),
                                       default=None)),
            error=errors[0] if errors else None)

    def release(self, request_id: str) -> None:
        g = self.groups.pop(request_id, None)
        if g:
            for s in g.samples:
                self.parent_of.pop(s.req.request_id, None)
