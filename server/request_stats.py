"""Per-request metrics from the outputs as they stream (vLLM's IterationStats
and FinishedRequestStats, vllm/v1/metrics/stats.py, computed the same way).

`AsyncEngine` calls `begin` before it hands a request to the engine, `step`
with every engine step's outputs (on the event loop, before they reach the
streams), and `ended` when a stream stops before its request finished (the
client left, the server is shutting down): its unfinished samples count as
aborted. Each of a request's `n` samples counts as one request, as each of
vLLM's child requests does; `request_params_n` and
`request_max_num_generation_tokens` are observed once per request.

Clocks, as vLLM's: time to first token and end-to-end latency run from
`begin` to when the server handles the output (this process's
`time.monotonic()`); queue, prefill, decode, inference and inter-token times
are differences of the engine's own timestamps (`RequestMetrics`: queued,
first scheduled, token times). A prompt's tokens are counted when its first
token arrives (its prefill is done), split by source: computed, or a
prefix-cache hit.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("detent.server.metrics")


@dataclass
class _Sample:
    num_tokens: int = 0
    first_ts: float | None = None  # engine clock
    last_ts: float | None = None
    done: bool = False


@dataclass
class _Request:
    prompt_len: int
    n: int
    max_tokens: int | None
    arrival: float  # this process's clock
    metrics: Any = None  # the latest RequestMetrics seen
    num_cached_tokens: int = 0
    samples: dict[int, _Sample] = field(default_factory=dict)

    def sample(self, index: int) -> _Sample:
        return self.samples.setdefault(index, _Sample())


class RequestStats:
    def __init__(self, metrics: Any):
        self.m = metrics
        self.reqs: dict[str, _Request] = {}

    def begin(self, request_id: str, prompt_len: int, params: Any) -> None:
        self.reqs[request_id] = _Request(prompt_len, int(getattr(params, "n", 1) or 1),
                                         getattr(params, "max_tokens", None), time.monotonic())

    def forget(self, request_id: str) -> None:
        """Refused at admission, or lost with a dead engine: nothing to count."""
        self.reqs.pop(request_id, None)

    def ended(self, request_id: str) -> None:
        """The stream stopped before the request finished: its unfinished samples were aborted."""
        r = self.reqs.pop(request_id, None)
        if r is None:
            return
        now = time.monotonic()
        for i in range(r.n):
            s = r.sample(i)
            if not s.done:
                self._finish_sample(r, s, "abort", now)
        self._finish_request(r)

    def step(self, outputs: list[Any]) -> None:
        """One engine step's outputs (cumulative RequestOutputs)."""
        try:
            self._step(outputs)
        except Exception:  # noqa: BLE001  (metrics never fail a request)
            log.exception("could not record the metrics of a step")

    def _step(self, outputs: list[Any]) -> None:
        now = time.monotonic()
        prompt = generated = 0
        for out in outputs:
            r = self.reqs.get(out.request_id)
            if r is None:
                continue
            r.metrics = out.metrics if out.metrics is not None else r.metrics
            r.num_cached_tokens = max(int(out.num_cached_tokens or 0), 0)
            ts = getattr(out.metrics, "last_token_time", None)
            ts = now if ts is None else ts
            for c in out.outputs:
                s = r.sample(c.index)
                new = len(c.token_ids) - s.num_tokens
                if new > 0:
                    if s.num_tokens == 0:  # the prefill is done: count the prompt, once per sample
                        prompt += r.prompt_len
                        self._prompt_sources(r.prompt_len, r.num_cached_tokens)
                        self.m.h["time_to_first_token_seconds"].observe(now - r.arrival)
                        s.first_ts = ts
                    else:
                        self.m.h["inter_token_latency_seconds"].observe(ts - s.last_ts)
                    s.last_ts = ts
                    s.num_tokens += new
                    generated += new
                if c.finish_reason is not None and not s.done:
                    self._finish_sample(r, s, c.finish_reason, now)
            if out.finished:
                self.reqs.pop(out.request_id, None)
                self._finish_request(r)
        self.m.c["prompt_tokens"].inc(prompt)
        self.m.c["generation_tokens"].inc(generated)
        if prompt or generated:
            self.m.h["iteration_tokens_total"].observe(prompt + generated)

    def _prompt_sources(self, prompt_len: int, cached: int) -> None:
        # the engine computes at least one prompt token; when all the others were cached, vLLM
        # counts that one as a recomputed cache hit
        recomputed = 1 if cached + 1 == prompt_len else 0
        self.m.prompt_by_source["local_compute"].inc(prompt_len - cached)
        self.m.prompt_by_source["local_cache_hit"].inc(cached + recomputed)
        self.m.c["prompt_tokens_cached"].inc(cached)
        self.m.c["prompt_tokens_recomputed"].inc(recomputed)

    def _finish_sample(self, r: _Request, s: _Sample, reason: str, now: float) -> None:
        s.done = True
        h = self.m.h
        if reason in self.m.success:
            self.m.success[reason].inc()
        h["e2e_request_latency_seconds"].observe(now - r.arrival)
        h["request_prompt_tokens"].observe(r.prompt_len)
        h["request_generation_tokens"].observe(s.num_tokens)
        h["request_prefill_kv_computed_tokens"].observe(r.prompt_len - r.num_cached_tokens)
        if r.max_tokens:
            h["request_params_max_tokens"].observe(r.max_tokens)
        m = r.metrics
        scheduled = getattr(m, "scheduled_time", None)
        if scheduled is None:  # never scheduled: no phase times
            return
        h["request_queue_time_seconds"].observe(scheduled - m.arrival_time)
        if s.first_ts is None:  # scheduled, but no token
            return
        h["request_prefill_time_seconds"].observe(s.first_ts - scheduled)
        h["request_decode_time_seconds"].observe(s.last_ts - s.first_ts)
        h["request_inference_time_seconds"].observe(s.last_ts - scheduled)
        if s.num_tokens > 1:  # the first token is the prefill's
            h["request_time_per_output_token_seconds"].observe((s.last_ts - s.first_ts) / (s.num_tokens - 1))

    def _finish_request(self, r: _Request) -> None:
        self.m.h["request_params_n"].observe(r.n)
        self.m.h["request_max_num_generation_tokens"].observe(
            max((s.num_tokens for s in r.samples.values()), default=0))
