"""/metrics has vLLM's metrics under `detent:`, and they count what happened.

The list below is data copied from vLLM's source, vllm/v1/metrics/loggers.py
(`PrometheusStatLogger.__init__`; the 1-2-5 buckets from `build_1_2_5_buckets`
over max_model_len; recent releases, with `num_requests_waiting_by_reason`
and the prompt-token source counters): each metric's stem, Prometheus type,
extra label names and buckets. Left out, as Detent has none of what they measure: the
KV-connector and multimodal caches, LoRA, speculative decoding, sleep mode,
`corrupted_requests` (behind VLLM_COMPUTE_NANS_IN_LOGITS), the KV-block
residency histograms (behind --kv-cache-metrics) and `cache_config_info`
(vLLM's CacheConfig fields as labels).
"""
from __future__ import annotations

import time

import httpx
import pytest

from server_helpers import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
TTFT = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
        80.0, 160.0, 640.0, 2560.0]
PER_TOKEN = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
             80.0]
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0,
           960.0, 1920.0, 7680.0]
TOKENS_1024 = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]  # build_1_2_5_buckets(1024)

# (stem, type, label names besides model_name and engine, buckets)
VLLM_METRICS = [
    ("num_requests_running", "gauge", (), None),
    ("num_requests_waiting", "gauge", (), None),
    ("num_requests_waiting_by_reason", "gauge", ("reason",), None),
    ("kv_cache_usage_perc", "gauge", (), None),
    ("prefix_cache_queries", "counter", (), None),
    ("prefix_cache_hits", "counter", (), None),
    ("num_preemptions", "counter", (), None),
    ("prompt_tokens", "counter", (), None),
    ("prompt_tokens_by_source", "counter", ("source",), None),
    ("prompt_tokens_cached", "counter", (), None),
    ("prompt_tokens_recomputed", "counter", (), None),
    ("generation_tokens", "counter", (), None),
    ("request_success", "counter", ("finished_reason",), None),
    ("request_prompt_tokens", "histogram", (), TOKENS_1024),
    ("request_generation_tokens", "histogram", (), TOKENS_1024),
    ("iteration_tokens_total", "histogram", (), [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]),
    ("request_max_num_generation_tokens", "histogram", (), TOKENS_1024),
    ("request_params_n", "histogram", (), [1, 2, 5, 10, 20]),
    ("request_params_max_tokens", "histogram", (), TOKENS_1024),
    ("time_to_first_token_seconds", "histogram", (), TTFT),
    ("inter_token_latency_seconds", "histogram", (), PER_TOKEN),
    ("request_time_per_output_token_seconds", "histogram", (), PER_TOKEN),
    ("e2e_request_latency_seconds", "histogram", (), LATENCY),
    ("request_queue_time_seconds", "histogram", (), LATENCY),
    ("request_inference_time_seconds", "histogram", (), LATENCY),
    ("request_prefill_time_seconds", "histogram", (), LATENCY),
    ("request_decode_time_seconds", "histogram", (), LATENCY),
    ("request_prefill_kv_computed_tokens", "histogram", (), TOKENS_1024),
]


def families(text: str) -> dict[str, dict]:
    """name -> {"type", "samples": [(sample name, labels, value)]}, parsed by prometheus_client."""
    from prometheus_client.parser import text_string_to_metric_families
    return {f.name: {"type": f.type, "samples": [(s.name, s.labels, s.value) for s in f.samples]}
            for f in text_string_to_metric_families(text)}


def test_every_vllm_metric_with_its_type_labels_and_buckets(server):
    fams = families(httpx.get(server.url + "/metrics", timeout=10).text)
    for stem, kind, labels, buckets in VLLM_METRICS:
        name = "detent:" + stem
        assert name in fams, f"{name} missing from /metrics"
        f = fams[name]
        assert f["type"] == kind, (name, f["type"])
        for sample, lab, _ in f["samples"]:
            if sample.endswith("_created"):
                continue
            assert set(lab) - {"le"} == {"model_name", "engine", *labels}, (sample, lab)
            assert lab["model_name"] == "smollm2" and lab["engine"] == "0"
        if buckets is not None:
            les = [float(lab["le"]) for s, lab, _ in f["samples"] if s.endswith("_bucket")]
            assert les == [float(b) for b in buckets] + [float("inf")], name
    reasons = {lab["finished_reason"] for s, lab, _ in fams["detent:request_success"]["samples"]
               if s.endswith("_total")}
    assert reasons == {"stop", "length", "abort", "error"}
    sources = {lab["source"] for s, lab, _ in fams["detent:prompt_tokens_by_source"]["samples"]
               if s.endswith("_total")}
    assert sources == {"local_compute", "local_cache_hit", "external_kv_transfer"}


def test_the_tuple_hash_and_the_cache_config_are_info_metrics(server):
    version = httpx.get(server.url + "/version", timeout=10).json()
    fams = families(httpx.get(server.url + "/metrics", timeout=10).text)
    # an info metric: in the text format a gauge `<name>_info` that is 1 (as vLLM's cache_config_info)
    assert fams["detent:tuple_info"]["type"] == "gauge"
    [(_, lab, value)] = fams["detent:tuple_info"]["samples"]
    assert value == 1.0
    assert lab["tuple_hash"] == version["tuple_hash"] and lab["deployment_hash"] == version["deployment_hash"]
    assert lab["selection"] == "pinned"
    # vLLM's cache_config_info, with the keys Detent has
    [(_, lab, value)] = fams["detent:cache_config_info"]["samples"]
    assert value == 1.0 and fams["detent:cache_config_info"]["type"] == "gauge"
    assert lab["block_size"] == "16" and lab["enable_prefix_caching"] == "True" and int(lab["num_gpu_blocks"]) > 0
    assert lab["model_name"] == "smollm2" and lab["engine"] == "0"


# ---------------------------------------------------------------- the values
def snapshot(server) -> dict[str, float]:
    """Every sample as `name{labels sorted}` -> value, once nothing moves: the idle engine core sends
    its stats at least every 0.5 s, so two reads 0.7 s apart that agree have the engine's latest."""
    deadline = time.time() + 60
    prev = server.metrics()
    while True:
        time.sleep(0.7)
        now = server.metrics()
        if now == prev or time.time() > deadline:
            return now
        prev = now


def delta(before: dict, after: dict, name: str, **labels: str) -> float:
    lab = {"engine": "0", "model_name": "smollm2", **labels}
    key = name + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(lab.items())) + "}"
    return after.get(key, 0.0) - before.get(key, 0.0)


def complete(server, **body) -> dict:
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=120,
                   json={"model": "smollm2", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture
def unique_prompt():
    """Token ids no other test sends (a prefix-cache hit must come from this test's own request)."""
    base = int(time.time() * 1000) % 5000
    return lambda n, salt=0: [1000 + (base + 7 * i + 13 * salt) % 20000 for i in range(n)]


def test_token_counters_and_histograms_move_by_what_the_requests_did(server, unique_prompt):
    p1, p2 = unique_prompt(21, 1), unique_prompt(9, 2)
    b = snapshot(server)
    complete(server, prompt=p1, max_tokens=5, ignore_eos=True)
    complete(server, prompt=p2, max_tokens=3, ignore_eos=True, n=2, seed=1)
    a = snapshot(server)
    assert delta(b, a, "detent:prompt_tokens_total") == 21 + 2 * 9  # each of n samples counts its prompt, as vLLM
    assert delta(b, a, "detent:generation_tokens_total") == 5 + 2 * 3
    assert delta(b, a, "detent:request_success_total", finished_reason="length") == 3
    assert delta(b, a, "detent:request_prompt_tokens_count") == 3
    assert delta(b, a, "detent:request_prompt_tokens_sum") == 21 + 9 + 9
    assert delta(b, a, "detent:request_generation_tokens_sum") == 5 + 3 + 3
    assert delta(b, a, "detent:request_params_n_count") == 2 and delta(b, a, "detent:request_params_n_sum") == 3
    assert delta(b, a, "detent:request_params_max_tokens_sum") == 5 + 3 + 3
    assert delta(b, a, "detent:request_max_num_generation_tokens_sum") == 5 + 3
    assert delta(b, a, "detent:iteration_tokens_total_sum") == 21 + 18 + 5 + 6
    for stem in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds",
                 "request_time_per_output_token_seconds"):
        assert delta(b, a, f"detent:{stem}_count") == 3, stem
        assert delta(b, a, f"detent:{stem}_sum") >= 0, stem
    assert delta(b, a, "detent:inter_token_latency_seconds_count") == 4 + 2 * 2  # one per token after the first
    assert delta(b, a, "detent:e2e_request_latency_seconds_sum") > delta(b, a, "detent:request_decode_time_seconds_sum")


def test_finished_reason_stop(server, unique_prompt):
    prompt = unique_prompt(12, 3)
    first = complete(server, prompt=prompt, max_tokens=1, logprobs=0, return_tokens_as_token_ids=True)
    tid = int(first["choices"][0]["logprobs"]["tokens"][0].removeprefix("token_id:"))  # the greedy first token
    b = snapshot(server)
    out = complete(server, prompt=prompt, max_tokens=8, stop_token_ids=[tid])
    a = snapshot(server)
    assert out["choices"][0]["finish_reason"] == "stop"
    assert delta(b, a, "detent:request_success_total", finished_reason="stop") == 1
    assert delta(b, a, "detent:request_success_total", finished_reason="length") == 0


def test_prefix_cache_hits_after_a_repeated_prompt(server, unique_prompt):
    prompt = unique_prompt(40, 4)  # 2 full blocks of 16 can hit (at least one token is always computed)
    complete(server, prompt=prompt, max_tokens=1)
    b = snapshot(server)
    complete(server, prompt=prompt, max_tokens=1)
    a = snapshot(server)
    assert delta(b, a, "detent:prefix_cache_queries_total") == 40
    assert delta(b, a, "detent:prefix_cache_hits_total") == 32
    assert delta(b, a, "detent:prompt_tokens_cached_total") == 32
    assert delta(b, a, "detent:prompt_tokens_by_source_total", source="local_cache_hit") == 32
    assert delta(b, a, "detent:prompt_tokens_by_source_total", source="local_compute") == 8
    assert delta(b, a, "detent:request_prefill_kv_computed_tokens_sum") == 8


def test_refused_requests_are_counted_as_rejected_not_as_requests(server):
    b = snapshot(server)
    r = httpx.post(server.url + "/v1/completions", headers=AUTH, json={"model": "smollm2", "prompt": "x",
                                                                      "temperature": -1})
    assert r.status_code == 400
    a = snapshot(server)
    assert delta(b, a, "detent:requests_rejected_total") == 1
    assert sum(delta(b, a, "detent:request_success_total", finished_reason=f)
               for f in ("stop", "length", "abort", "error")) == 0


# ---------------------------------------------------------------- in process (--no-engine-process's AsyncEngine)
def test_in_thread_engine_counts_finished_aborted_and_not_refused_requests():
    import asyncio

    from fake_engine import FakeEngine
    from detent.sampling.params import SamplingParams
    from detent.server.async_engine import AsyncEngine
    from detent.server.errors import APIError
    from detent.server.metrics import Metrics
    from detent.server.request_stats import RequestStats

    m = Metrics("m", 512)
    count = lambda name, **lab: m.registry.get_sample_value(  # noqa: E731
        "detent:" + name, {"model_name": "m", "engine": "0", **lab}) or 0.0

    async def main():
        ae = AsyncEngine(FakeEngine(max_model_len=64, step_s=0.001))
        ae.observer = RequestStats(m)
        ae.start(asyncio.get_running_loop())
        with pytest.raises(APIError):  # refused at admission: not a request
            await ae.add("long", list(range(3, 100)), SamplingParams(temperature=0))
        stream = await ae.add("a", [5, 6, 7], SamplingParams(temperature=0, max_tokens=50))
        n = 0
        async for _ in stream:  # the client leaves after 3 outputs
            n += 1
            if n == 3:
                break
        await stream.aclose()
        done = [o async for o in await ae.add("b", [5, 6], SamplingParams(temperature=0, max_tokens=3))]
        ae.shutdown()
        return done

    done = asyncio.run(main())
    assert done[-1].outputs[0].finish_reason == "length"
    assert count("request_success_total", finished_reason="abort") == 1
    assert count("request_success_total", finished_reason="length") == 1
    assert count("request_prompt_tokens_sum") == 3 + 2 and count("request_prompt_tokens_count") == 2
    assert count("prompt_tokens_total") == 3 + 2
    assert count("request_generation_tokens_sum") == count("generation_tokens_total") >= 3 + 3


def test_engine_counters_advance_by_the_engines_cumulative_counts():
    from detent.server.metrics import Metrics
    m = Metrics("m", 512)
    get = lambda name: m.registry.get_sample_value(name, {"model_name": "m", "engine": "0"})  # noqa: E731
    m.engine_stats({"prefix_cache_queries": 40, "prefix_cache_hits": 32, "num_preemptions": 1, "num_running": 2,
                    "num_waiting": 1, "num_pending": 2, "kv_cache_usage": 0.5})
    m.engine_stats({"prefix_cache_queries": 80, "prefix_cache_hits": 32, "num_preemptions": 3})
    assert get("detent:prefix_cache_queries_total") == 80 and get("detent:prefix_cache_hits_total") == 32
    assert get("detent:num_preemptions_total") == 3
    m.engine_stats({"prefix_cache_queries": 10, "prefix_cache_hits": 5})  # reset_prefix_cache zeroed the engine's
    assert get("detent:prefix_cache_queries_total") == 90 and get("detent:prefix_cache_hits_total") == 37
    m.engine_stats({"num_running": 2, "num_waiting": 1, "num_pending": 2, "num_waiting_deferred": 1,
                    "kv_cache_usage": 0.5})
    assert get("detent:num_requests_running") == 2 and get("detent:num_requests_waiting") == 3
    by_reason = lambda w: m.registry.get_sample_value(  # noqa: E731
        "detent:num_requests_waiting_by_reason", {"model_name": "m", "engine": "0", "reason": w})
    assert (by_reason("capacity"), by_reason("deferred")) == (2, 1)
    assert get("detent:kv_cache_usage_perc") == 0.5


def test_step_kind_counters_advance_by_the_engines_cumulative_counts():
    from detent.server.metrics import Metrics
    m = Metrics("m", 512)
    get = lambda stem, kind: m.registry.get_sample_value(  # noqa: E731
        f"detent:{stem}_total", {"model_name": "m", "engine": "0", "kind": kind})
    m.engine_stats({"steps_by_kind": {"decode": (10, 0.05, 40, 0.04), "mixed": (2, 0.06, 2048, 0.05),
                                      "prefill": (0, 0.0, 0, 0.0)}})
    m.engine_stats({"steps_by_kind": {"decode": (15, 0.08, 60, 0.06), "mixed": (2, 0.06, 2048, 0.05),
                                      "prefill": (1, 0.02, 9, 0.01)}})
    assert (get("engine_steps", "decode"), get("engine_step_tokens", "decode")) == (15, 60)
    assert abs(get("engine_step_wait_seconds", "decode") - 0.06) < 1e-12
    assert abs(get("engine_step_time_seconds", "decode") - 0.08) < 1e-12
    assert (get("engine_steps", "mixed"), get("engine_steps", "prefill")) == (2, 1)
    m.engine_stats({"steps_by_kind": {"decode": (3, 0.01, 3, 0.0)}})  # a new engine counts from zero
    assert get("engine_steps", "decode") == 18
    # which graphs the steps replayed: one whole graph, or the pieces
    m.engine_stats({"steps_by_kind": {"decode": (5, 0.02, 5, 0.0, 0.01, 0.0, 0.0, 5, 0, 0.018, 0.001),
                                      "mixed": (4, 0.08, 2100, 0.06, 0.02, 0.0, 0.0, 3, 1, 0.07, 0.004)}})
    assert (get("engine_step_whole_graph_steps", "decode"), get("engine_step_whole_graph_steps", "mixed"),
            get("engine_step_piecewise_steps", "mixed")) == (5, 3, 1)
    assert abs(get("engine_step_device_seconds", "mixed") - 0.07) < 1e-12
    assert abs(get("engine_step_device_idle_seconds", "decode") - 0.001) < 1e-12
