"""Detent's engine loop under Poisson arrivals on a simulated clock (CPU, no GPU).

The real `LLMEngine` (scheduler, async scheduling, outputs) runs a tiny model on
the CPU; only time is simulated. Each launched step lasts, on a simulated
device, `base_ms + per_token_us * tokens` (defaults: lease 25's H100 steps at
20 req/s, Llama-3.1-8B shapes: decode 9.19 ms at 27.6 rows, mixed 26.06 ms at
801 tokens). Steps run back to back; a step's tokens exist at its end; the host
plans step N+1 when step N-1's tokens are collected, and admits the requests
that arrived by then (async scheduling, as on CUDA).

It answers: does every running request advance every step (per request, the
simulated time per output token against the mean step), and what does the
mixed-step cap (`--max-mixed-batched-tokens`) do to TTFT, TPOT and end to end
at a given arrival rate, with the device's cost fixed. Its times are a model's,
not a GPU's; docs/performance.md says which lease calibrated them.

    python benchmarks/schedule_sim.py --rate 20 --requests 400 --caps 2048,0 --aligns 1024,0
"""
from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys

import torch

from detent.engine.llm import LLM
from detent.models.config import ModelConfig
from detent.models.loader import load_model
from detent.sampling.params import SamplingParams

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 1000, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
        "head_dim": 32, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 16384,
        "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2}


def simulate(*, rate: float, requests: int, prompt_len: int, output_len: int, cap: int | None, base_ms: float,
             per_token_us: float, seed: int = 0, max_num_batched_tokens: int = 8192, align: int | None = 1024,
             per_row_us: float | None = None) -> dict:
    """One load through the engine; per-request simulated latencies and the steps' composition.
    A step lasts base_ms + per_token_us a prompt token + per_row_us a decode row (None: per_token_us)."""
    per_row_us = per_token_us if per_row_us is None else per_row_us
    cfg = ModelConfig.from_hf(TINY)
    model = load_model(cfg, device="cpu", dtype=torch.float32, load_format="dummy", progress=False, seed=0)
    llm = LLM.from_model(model, cfg, max_model_len=prompt_len + output_len + 16, max_num_seqs=256,
                         max_num_batched_tokens=max_num_batched_tokens, max_mixed_batched_tokens=cap,
                         mixed_token_align=align, async_scheduling=True, enable_prefix_caching=False)
    eng = llm.llm_engine
    rng = random.Random(seed)
    t, arrivals = 0.0, []
    for i in range(requests):
        t += rng.expovariate(rate)
        arrivals.append((t, f"r{i}", [rng.randrange(3, 1000) for _ in range(prompt_len)]))
    params = SamplingParams(temperature=1.0, max_tokens=output_len, ignore_eos=True, seed=1)

    ends: dict[int, float] = {}  # id(handle) -> the simulated time its step ends
    steps: list[dict] = []
    device_free = 0.0
    host_now = 0.0
    launch = eng.runner.launch

    def timed_launch(plan, prev):
        nonlocal device_free
        handle = launch(plan, prev)
        rows = sum(1 for s in plan.seqs if len(s.token_ids) == 1)  # decode rows (a 1-token prompt chunk too)
        start = max(device_free, host_now)
        device_free = start + (base_ms + (per_token_us * (plan.num_batched_tokens - rows) + per_row_us * rows) / 1e3) / 1e3
        ends[id(handle)] = device_free
        steps.append({"tokens": plan.num_batched_tokens, "decode_rows": rows, "start": start, "end": device_free,
                      # past their prompt once planned: so a prompt's last chunk counts here, not as a row
                      "running": sum(1 for r in eng.scheduler.running if not r.is_prefill)})
        return handle

    eng.runner.launch = timed_launch
    collect = eng.runner.collect
    now_of_collect = {}

    def timed_collect(handle):
        nonlocal host_now
        host_now = max(host_now, ends.get(id(handle), host_now))  # the host waits for the step's end
        now_of_collect[id(handle)] = host_now
        return collect(handle)

    eng.runner.collect = timed_collect
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    arrived: dict[str, float] = {}
    nxt = 0
    while nxt < len(arrivals) or eng.has_unfinished_requests():
        while nxt < len(arrivals) and arrivals[nxt][0] <= host_now:
            at, rid, ids = arrivals[nxt]
            eng.add_request(rid, ids, params)
            arrived[rid] = at
            nxt += 1
        if not eng.has_unfinished_requests():
            host_now = max(host_now, arrivals[nxt][0])  # idle until the next arrival
            continue
        outs = eng.step()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n and o.request_id not in first:
                first[o.request_id] = host_now
            if n:
                last[o.request_id] = host_now
    ttft = [first[r] - arrived[r] for r in arrived]
    e2e = [last[r] - arrived[r] for r in arrived]
    tpot = [(last[r] - first[r]) / (output_len - 1) for r in arrived]
    busy = sum(s["end"] - s["start"] for s in steps)
    mixed = [s for s in steps if s["tokens"] > s["decode_rows"] > 0]
    decode = [s for s in steps if s["tokens"] == s["decode_rows"]]
    prefill = [s for s in steps if s["decode_rows"] == 0]
    return {
        "cap": cap, "align": align, "rate": rate, "requests": requests, "base_ms": base_ms,
        "per_token_us": per_token_us, "per_row_us": per_row_us, "steps": len(steps),
        "mean_step_ms": 1e3 * busy / len(steps),
        "decode_steps": len(decode), "mixed_steps": len(mixed), "prefill_steps": len(prefill),
        "mixed_tokens_per_step": statistics.mean(s["tokens"] for s in mixed) if mixed else 0.0,
        "decode_rows_per_step": statistics.mean(s["decode_rows"] for s in steps),
        "decode_rows_per_decode_step": statistics.mean(s["decode_rows"] for s in decode) if decode else 0.0,
        "decode_rows_per_mixed_step": statistics.mean(s["decode_rows"] for s in mixed) if mixed else 0.0,
        # a request's time per output token is the mean of its steps' durations, so the mean over
        # requests weighs each step by its rows
        "row_weighted_step_ms": 1e3 * sum(s["decode_rows"] * (s["end"] - s["start"]) for s in steps)
        / max(1, sum(s["decode_rows"] for s in steps)),
        "rows_short_of_running": sum(s["running"] - s["decode_rows"] for s in steps) / len(steps),
        "ttft_ms": {"mean": 1e3 * statistics.mean(ttft), "p50": 1e3 * statistics.median(ttft)},
        "tpot_ms": {"mean": 1e3 * statistics.mean(tpot), "p50": 1e3 * statistics.median(tpot)},
        "e2e_ms": {"mean": 1e3 * statistics.mean(e2e), "p50": 1e3 * statistics.median(e2e)},
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser("schedule_sim")
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--caps", default="2048,0", help="max_mixed_batched_tokens values (0: one budget, as vLLM's)")
    ap.add_argument("--aligns", default="1024,0", help="mixed_token_align values (0: off, as vLLM's)")
    ap.add_argument("--base-ms", type=float, default=8.6)
    ap.add_argument("--per-token-us", type=float, default=21.8, help="a prompt token's cost")
    ap.add_argument("--per-row-us", type=float, default=None, help="a decode row's cost (default: a token's)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    rows = []
    for cap, align in itertools.product((int(c) for c in a.caps.split(",")), [int(x) for x in a.aligns.split(",")]):
        r = simulate(rate=a.rate, requests=a.requests, prompt_len=a.prompt_len, output_len=a.output_len,
                     cap=cap or None, base_ms=a.base_ms, per_token_us=a.per_token_us, align=align or None,
                     per_row_us=a.per_row_us)
        rows.append(r)
        print(json.dumps(r), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"args": vars(a), "runs": rows}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1:])
