"""Prometheus metrics for /metrics: vLLM's metric stems under `detent:`.

The names, types, label names and buckets are those of vLLM's v1 engine
(`vllm:num_requests_running` is `detent:num_requests_running`, ...), so a
dashboard built for `vllm serve` works by changing the prefix. Every series
has the labels `model_name` and `engine` ("0": Detent runs one engine core).
The values come from two places:

- the engine's stats snapshot (`LLMEngine.stats()`, which crosses the core
  process boundary with each step's outputs): the gauges, and the prefix-cache
  and preemption counters, advanced by the engine's cumulative counts;
- each request's outputs as they stream (`server/request_stats.py`): token
  counters, per-request histograms, finish reasons.

`detent:cache_config_info` is vLLM's `cache_config_info` (the KV cache's
settings as labels, a gauge at 1) with the keys Detent has.

Detent's own series: `detent:tuple_info` (the tuple and deployment hashes,
an info metric), `detent:engine_up`, `detent:engine_step_seconds`,
`detent:requests_rejected` (requests refused before reaching the engine), and
per step kind (`kind` = decode: one-token rows only; mixed: prompt chunks
beside them; prefill: prompt chunks only) `detent:engine_steps_total`,
`detent:engine_step_time_seconds_total` (the time the step pipeline spent on
them), `detent:engine_step_tokens_total`,
`detent:engine_step_wait_seconds_total` (the host's wait for their results),
`detent:engine_step_launch_seconds_total` (the host's time launching them) and,
of that, `detent:engine_step_launch_prepare_seconds_total` (the inputs) and
`detent:engine_step_launch_forward_seconds_total` (the model call).
"""
from __future__ import annotations

import os
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest

from detent.engine import HOST_PARTS, STEP_KIND_FIELDS, STEP_KINDS

PREFIX = "detent:"
ENGINE = "0"
LABELS = ("model_name", "engine")
FINISH_REASONS = ("stop", "length", "abort", "error")  # the finish reasons Detent's engine gives
PROMPT_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
WAITING_REASONS = ("capacity", "deferred")

# vLLM's bucket lists (vllm/v1/metrics/loggers.py, PrometheusStatLogger)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
N_BUCKETS = (1, 2, 5, 10, 20)
STEP_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


def buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `max_value` (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


# stem -> documentation (gauges, counters) or (documentation, buckets); "1-2-5": up to max_model_len
GAUGES = {
    "num_requests_running": "Number of requests in model execution batches.",
    "num_requests_waiting": "Number of requests waiting to be processed.",
    "kv_cache_usage_perc": "KV-cache usage. 1 means 100 percent usage.",
}
COUNTERS = {
    "prefix_cache_queries": "Prefix cache queries, in terms of number of queried tokens.",
    "prefix_cache_hits": "Prefix cache hits, in terms of number of cached tokens.",
    "num_preemptions": "Cumulative number of preemption from the engine.",
    "prompt_tokens": "Number of prefill tokens processed.",
    "prompt_tokens_cached": "Number of cached prompt tokens (local + external).",
    "prompt_tokens_recomputed": "Number of cached tokens recomputed for forward pass.",
    "generation_tokens": "Number of generation tokens processed.",
}
HISTOGRAMS = {
    "request_prompt_tokens": ("Number of prefill tokens processed.", "1-2-5"),
    "request_generation_tokens": ("Number of generation tokens processed.", "1-2-5"),
    "iteration_tokens_total": ("Histogram of number of tokens per engine_step.", ITERATION_TOKEN_BUCKETS),
    "request_max_num_generation_tokens": ("Histogram of maximum number of requested generation tokens.",
                                          "1-2-5"),
    "request_params_n": ("Histogram of the n request parameter.", N_BUCKETS),
    "request_params_max_tokens": ("Histogram of the max_tokens request parameter.", "1-2-5"),
    "time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", TOKEN_LATENCY_BUCKETS),
    "request_time_per_output_token_seconds": ("Histogram of time_per_output_token_seconds per request.",
                                              TOKEN_LATENCY_BUCKETS),
    "e2e_request_latency_seconds": ("Histogram of e2e request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    "request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request.",
                                   REQUEST_LATENCY_BUCKETS),
    "request_inference_time_seconds": ("Histogram of time spent in RUNNING phase for request.",
                                       REQUEST_LATENCY_BUCKETS),
    "request_prefill_time_seconds": ("Histogram of time spent in PREFILL phase for request.",
                                     REQUEST_LATENCY_BUCKETS),
    "request_decode_time_seconds": ("Histogram of time spent in DECODE phase for request.",
                                    REQUEST_LATENCY_BUCKETS),
    "request_prefill_kv_computed_tokens": ("Histogram of new KV tokens computed during prefill "
                                           "(excluding cached tokens).", "1-2-5"),
}
# engine field (`STEP_KIND_FIELDS`, the positions of stats()["steps_by_kind"][kind]) -> its series (stem, help)
STEP_KIND_SERIES = {
    "steps": ("engine_steps", "Engine steps by kind (decode, mixed, prefill)."),
    "seconds": ("engine_step_time_seconds", "Time the step pipeline spent on steps, by kind."),
    "tokens": ("engine_step_tokens", "Tokens computed in steps, by kind."),
    "wait_seconds": ("engine_step_wait_seconds", "Time the engine waited for steps' results, by kind "
                     "(near 0: the host set the pace)."),
    "launch_seconds": ("engine_step_launch_seconds", "Host time spent launching steps, by kind."),
    "prepare_seconds": ("engine_step_launch_prepare_seconds", "Of the launch time, preparing the step's inputs "
                        "(flattening, one host-to-device copy), by kind."),
    "forward_seconds": ("engine_step_launch_forward_seconds", "Of the launch time, the model call (graph replays, "
                        "eager kernels between pieces), by kind; the rest is sampling and prompt logprobs."),
    "whole_graph_steps": ("engine_step_whole_graph_steps", "Steps whose model call replayed one CUDA graph (a "
                          "decode graph or a whole-step graph), by kind."),
    "piecewise_steps": ("engine_step_piecewise_steps", "Steps whose model call replayed the piecewise CUDA graphs "
                        "(attention eager between them), by kind; the rest ran eagerly."),
    "device_seconds": ("engine_step_device_seconds", "CUDA: the device's span of the steps (from the stream "
                       "reaching a step's first work to its last, CUDA events), by kind."),
    "device_idle_seconds": ("engine_step_device_idle_seconds", "CUDA: the device's idle time before the steps (from "
                            "the previous step's end to the step's start), by kind."),
    "decode_rows": ("engine_step_decode_rows", "One-token rows that sampled (decode rows) in steps, by kind."),
    "decode_row_seconds": ("engine_step_decode_row_seconds", "Decode rows times their step's time, by kind: over "
                           "engine_step_decode_rows, the step time a generated token waited for on average."),
    "rows_left_out": ("engine_step_rows_left_out", "Running requests past their prompt that steps left out "
                      "though they could have run (each waits a step longer for its next token), by kind."),
}
# the series in the engine's field order, the i-th advanced by position i of a steps_by_kind tuple
# (a field without a series fails here; tests/engine/test_step_stats.py checks there is no other series)
STEP_KIND_COUNTERS = tuple(STEP_KIND_SERIES[f] for f in STEP_KIND_FIELDS)
# counters advanced by the engine's cumulative counts (LLMEngine.stats() keys of the same names)
ENGINE_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "num_preemptions")


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


def _advance(counter, seen: dict, key: str, now: float) -> None:
    """Advance `counter` by how much the cumulative count `now` grew since `seen[key]`; a count
    that went down was reset (reset_prefix_cache, a new engine): it advances by its new value."""
    last = seen[key]
    counter.inc(now - last if now >= last else now)
    seen[key] = now


class Metrics:
    """One registry per server; `m.c[stem]`, `m.h[stem]`, `m.g[stem]` are the labelled children."""

    def __init__(self, model_name: str, max_model_len: int = 4096, fingerprint: dict[str, str] | None = None,
                 cache_config: dict[str, str] | None = None):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name
        lab = {"model_name": model_name, "engine": ENGINE}
        self.g = {s: Gauge(PREFIX + s, doc, LABELS, registry=r).labels(**lab) for s, doc in GAUGES.items()}
        self.c = {s: Counter(PREFIX + s, doc, LABELS, registry=r).labels(**lab) for s, doc in COUNTERS.items()}
        self.h = {}
        for s, (doc, buckets) in HISTOGRAMS.items():
            b = buckets_1_2_5(max_model_len) if buckets == "1-2-5" else buckets
            self.h[s] = Histogram(PREFIX + s, doc, LABELS, buckets=b, registry=r).labels(**lab)
        success = Counter(PREFIX + "request_success", "Count of successfully processed requests.",
                          LABELS + ("finished_reason",), registry=r)
        self.success = {f: success.labels(**lab, finished_reason=f) for f in FINISH_REASONS}
        by_reason = Gauge(PREFIX + "num_requests_waiting_by_reason", "Number of waiting requests by reason. "
                          "Reason labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by "
                          "transient constraints (a grammar still compiling). Sum of all reasons equals "
                          "num_requests_waiting.", LABELS + ("reason",), registry=r)
        self.waiting_by_reason = {w: by_reason.labels(**lab, reason=w) for w in WAITING_REASONS}
        by_source = Counter(PREFIX + "prompt_tokens_by_source", "Number of prompt tokens by source.",
                            LABELS + ("source",), registry=r)
        self.prompt_by_source = {s: by_source.labels(**lab, source=s) for s in PROMPT_SOURCES}
        if cache_config:
            Gauge(PREFIX + "cache_config_info", "Information of the LLMEngine CacheConfig",
                  LABELS + tuple(cache_config), registry=r).labels(**lab, **cache_config).set(1)
        # Detent's own
        Info(PREFIX + "tuple", "The commitment tuple and deployment this server runs (hashes, selection mode)",
             LABELS, registry=r).labels(**lab).info(dict(fingerprint or {}))
        self.engine_up = Gauge(PREFIX + "engine_up", "1 while the engine step loop is alive", LABELS,
                               registry=r).labels(**lab)
        self.step = Histogram(PREFIX + "engine_step_seconds", "Duration of one engine step", LABELS,
                              buckets=STEP_BUCKETS, registry=r).labels(**lab)
        self.rejected = Counter(PREFIX + "requests_rejected", "Generation requests refused before reaching the "
                                "engine (4xx, 503)", LABELS, registry=r).labels(**lab)
        self._engine_seen = {k: 0.0 for k in ENGINE_COUNTERS}
        by_kind = [Counter(PREFIX + stem, doc, LABELS + ("kind",), registry=r) for stem, doc in STEP_KIND_COUNTERS]
        self.step_kinds = {k: [c.labels(**lab, kind=k) for c in by_kind] for k in STEP_KINDS}
        self._kinds_seen = {k: (0,) * len(STEP_KIND_COUNTERS) for k in STEP_KINDS}
        by_part = Counter(PREFIX + "engine_host_seconds", "The step loop's host time by part: inbox (new "
                          "requests), schedule, launch, wait (for the device's results), update (advancing the "
                          "requests), outputs (building them), ipc_in / ipc_out (the engine core's pipe, while "
                          "requests run).", LABELS + ("part",), registry=r)
        self.host_parts = {p: by_part.labels(**lab, part=p) for p in HOST_PARTS}
        self._host_seen = dict.fromkeys(HOST_PARTS, 0.0)

    def token_totals(self) -> tuple[float, float]:
        """(prompt tokens computed, tokens generated) so far: the stats line's throughputs
        (as vLLM's, the prompt side leaves out prefix-cache hits)."""
        lab = {"model_name": self.model_name, "engine": ENGINE}
        get = self.registry.get_sample_value
        return (get(PREFIX + "prompt_tokens_by_source_total", {**lab, "source": "local_compute"}) or 0.0,
                get(PREFIX + "generation_tokens_total", lab) or 0.0)

    def engine_stats(self, stats: dict[str, Any]) -> None:
        """Gauges from the latest snapshot; the engine's cumulative counts advance the counters
        (a count that went down was reset, e.g. by reset_prefix_cache: it advances by its new value)."""
        self.g["num_requests_running"].set(stat(stats, "num_running"))
        waiting, deferred = stat(stats, "num_waiting") + stat(stats, "num_pending"), stat(stats, "num_waiting_deferred")
        self.g["num_requests_waiting"].set(waiting)
        self.waiting_by_reason["capacity"].set(waiting - deferred)
        self.waiting_by_reason["deferred"].set(deferred)
        self.g["kv_cache_usage_perc"].set(kv_usage(stats))
        for key in ENGINE_COUNTERS:
            if stats.get(key) is not None:
                _advance(self.c[key], self._engine_seen, key, float(stats[key]))
        self._step_kind_counts(stats)
        for part, now in (stats.get("host_seconds") or {}).items():
            if part in self.host_parts:
                _advance(self.host_parts[part], self._host_seen, part, now)

    def _step_kind_counts(self, stats: dict[str, Any]) -> None:
        for kind, now in (stats.get("steps_by_kind") or {}).items():
            if kind not in self.step_kinds:
                continue
            seen = self._kinds_seen[kind]
            restarted = now[0] < seen[0]  # a new engine counts from zero
            for c, v, w in zip(self.step_kinds[kind], now, seen):
                c.inc(max(0.0, v if restarted or v < w else v - w))  # a counter never goes down
            self._kinds_seen[kind] = tuple(now) + seen[len(now):]

    def render(self, stats: dict[str, Any], alive: bool, step_times: Any = ()) -> bytes:
        self.engine_stats(stats)
        self.engine_up.set(1.0 if alive else 0.0)
        while step_times:
            self.step.observe(step_times.popleft())
        return generate_latest(self.registry)
