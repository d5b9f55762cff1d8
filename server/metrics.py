"""Prometheus metrics for /metrics (one registry per server).

Counters and histograms are fed per request by `RequestTimer`; gauges
(KV usage, prefix-cache hit rate, queue lengths) are read from the engine
thread's latest stats snapshot at scrape time.
"""
from __future__ import annotations

import os
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

OUTCOMES = ("stop", "length", "abort", "error", "rejected")
_LATENCY = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4,
         0.5, 0.75, 1.0, 2.5)


def stat(stats: dict[str, Any], *names: str, default: float = 0.0) -> float:
    for n in names:
        if n in stats and stats[n] is not None:
            return float(stats[n])
    return default


def kv_usage(stats: dict[str, Any]) -> float:
    """Fraction of KV blocks held by requests (cached, unreferenced blocks count as free)."""
    if "kv_cache_usage" in stats or "kv_usage" in stats:
        return stat(stats, "kv_cache_usage", "kv_usage")
    total = stat(stats, "num_total_blocks", "num_blocks", "num_gpu_blocks")
    free = stat(stats, "num_free_blocks", default=total)
    return 0.0 if total <= 0 else (total - free) / total


def metric_label(served_name: str) -> str:
    """The `model_name` label: a served name as given, but a model directory
    (the default served name when --served-model-name is unset) by its last
    component, so no file path of the host reaches a metrics scraper. A hub
    id ("org/name") is not a path and stays as it is."""
    if os.path.isabs(served_name) or served_name.startswith((".", "~")) or os.path.exists(served_name):
        return os.path.basename(os.path.normpath(served_name)) or served_name
    return served_name


class Metrics:
    def __init__(self, model_name: str):
        self.registry = r = CollectorRegistry()
        lab = {"model_name": model_name}
        self.requests = Counter("detent_requests", "Requests finished, by outcome",
                                ["model_name", "outcome"], registry=r)
        for o in OUTCOMES:
            self.requests.labels(model_name=model_name, outcome=o)
        self.prompt_tokens = Counter("detent_prompt_tokens", "Prompt tokens processed",
                                     ["model_name"], registry=r).labels(**lab)
        self.generation_tokens = Counter("detent_generation_tokens", "Tokens generated",
                                         ["model_name"], registry=r).labels(**lab)
        self.ttft = Histogram("detent_time_to_first_token_seconds", "Time to first token",
                              ["model_name"], buckets=_LATENCY, registry=r).labels(**lab)
        self.tpot = Histogram("detent_time_per_output_token_seconds", "Time per output token after the first",
                              ["model_name"], buckets=_TPOT, registry=r).labels(**lab)
        self.e2e = Histogram("detent_e2e_request_latency_seconds", "Request latency",
                             ["model_name"], buckets=_LATENCY, registry=r).labels(**lab)
        self.step = Histogram("detent_engine_step_seconds", "Duration of one engine step",
                              ["model_name"], buckets=_TPOT, registry=r).labels(**lab)
        g = lambda name, doc: Gauge(name, doc, ["model_name"], registry=r).labels(**lab)  # noqa: E731
        self.kv_usage = g("detent_kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0..1)")
        self.prefix_hit_rate = g("detent_prefix_cache_hit_rate", "Prefix-cache hit rate over queried tokens (0..1)")
        self.waiting = g("detent_num_requests_waiting", "Requests waiting to be scheduled (incl. not yet admitted)")
        self.running = g("detent_num_requests_running", "Requests running in the engine")
        self.engine_up = g("detent_engine_up", "1 while the engine step loop is alive")
        self.model_name = model_name

    def token_totals(self) -> tuple[float, float]:
        """(prompt tokens, generated tokens) counted so far (the stats line's source)."""
        lab = {"model_name": self.model_name}
        return (self.registry.get_sample_value("detent_prompt_tokens_total", lab) or 0.0,
                self.registry.get_sample_value("detent_generation_tokens_total", lab) or 0.0)

    def outcome(self, outcome: str) -> None:
        self.requests.labels(model_name=self.model_name, outcome=outcome).inc()

    def render(self, stats: dict[str, Any], alive: bool, step_times: Any = ()) -> bytes:
        self.kv_usage.set(kv_usage(stats))
        self.prefix_hit_rate.set(stat(stats, "prefix_cache_hit_rate"))
        self.waiting.set(stat(stats, "num_waiting") + stat(stats, "num_pending"))
        self.running.set(stat(stats, "num_running"))
        self.engine_up.set(1.0 if alive else 0.0)
        while step_times:
            self.step.observe(step_times.popleft())
        return generate_latest(self.registry)


class RequestTimer:
    """One request's timeline; reports it to the metrics once, at the end."""

    def __init__(self, metrics: Metrics):
        self.m = metrics
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.num_tokens = 0
        self.done = False

    def tokens(self, total_generated: int) -> None:
        if total_generated > self.num_tokens:
            now = time.perf_counter()
            if self.t_first is None:
                self.t_first = now
                self.m.ttft.observe(now - self.t0)
            self.t_last = now
            self.num_tokens = total_generated

    def finish(self, outcome: str, prompt_tokens: int) -> None:
        if self.done:
            return
        self.done = True
        self.m.outcome(outcome)
        self.m.prompt_tokens.inc(prompt_tokens)
        self.m.generation_tokens.inc(self.num_tokens)
        self.m.e2e.observe(time.perf_counter() - self.t0)
        if self.t_first is not None and self.num_tokens > 1:
            self.m.tpot.observe((self.t_last - self.t_first) / (self.num_tokens - 1))
