"""Drive a workload (benchmarks/workloads/, `detent.workloads`) over HTTP
against any OpenAI-compatible server — `detent-serve` or `vllm serve`, the
same client for both — and measure each request's TTFT and TPOT.

Requests go to /v1/completions, streamed, with `ignore_eos` (exact output
lengths) and the prompt as token ids (`--prompt-format ids`, both servers
take them) or as words "t<id>" for the word-level tokenizer of
benchmarks/wordlevel_model.py (`--prompt-format words`). A chat turn waits
for the turn before it (`Request.after`). Loads: Poisson arrivals at a
fraction of `--lambda-max` (stock's maximum request throughput, which
`--measure-max` measures: every request at once, at `--seed`), or a closed
loop. Each load sends its own prompts (`for_load`: the workload drawn at
`detent.workloads.load_seed`), so no load hits the prefix cache with what an
earlier one sent.

    python3 benchmarks/workload_client.py --url http://127.0.0.1:8000 --workload W-C --measure-max
    python3 benchmarks/workload_client.py --url ... --workload W-A --load A2 --lambda-max 3.1
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from loadgen import pct  # noqa: E402


def body(model: str, req, prompt_format: str) -> dict:
    ids = list(req.prompt_token_ids)
    prompt = ids if prompt_format == "ids" else " ".join(f"t{i}" for i in ids)
    return {"model": model, "prompt": prompt, "max_tokens": req.max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}


async def one(client, url: str, b: dict) -> dict:
    """One streamed completion: TTFT, TPOT (time between the first and the last token over
    the tokens after the first), and the output token count from the usage chunk."""
    t0 = time.perf_counter()
    times: list[float] = []  # when each chunk with text arrived
    tokens = 0  # from the usage chunk; a server without one is counted by chunks
    try:
        async with client.stream("POST", url + "/v1/completions", json=b) as r:
            if r.status_code != 200:
                return {"error": f"{r.status_code}: {(await r.aread())[:200]!r}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                d = json.loads(line[6:])
                if d.get("usage"):
                    tokens = d["usage"]["completion_tokens"]
                if any(c.get("text") for c in d.get("choices", [])):
                    times.append(time.perf_counter())
    except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
        return {"error": repr(e)}
    if not times:
        return {"error": "no tokens"}
    tokens = tokens or len(times)
    return {"ttft": times[0] - t0, "tpot": (times[-1] - times[0]) / max(tokens - 1, 1), "tokens": tokens,
            "latency": times[-1] - t0}


async def drive(url: str, model: str, workload, *, rate: float | None = None, concurrency: int | None = None,
                seed: int = 0, prompt_format: str = "ids", api_key: str | None = None, timeout: float = 3600):
    """Send every request of `workload`: Poisson arrivals at `rate` req/s, or a closed loop of
    `concurrency` in flight, or (neither) all at once. Returns (per-request results, wall seconds)."""
    import httpx

    reqs = workload.requests
    done = [asyncio.Event() for _ in reqs]
    sem = asyncio.Semaphore(concurrency) if concurrency else None
    rng = random.Random(seed)
    starts, t = [], 0.0
    for _ in reqs:
        starts.append(t)
        if rate:
            t += rng.expovariate(rate)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=timeout, headers=headers, limits=limits) as client:
        t0 = time.perf_counter()

        async def go(i: int) -> dict:
            try:
                delay = starts[i] - (time.perf_counter() - t0)
                if delay > 0:
                    await asyncio.sleep(delay)
                if reqs[i].after is not None:
                    await done[reqs[i].after].wait()
                if sem is None:
                    return await one(client, url, body(model, reqs[i], prompt_format))
                async with sem:
                    return await one(client, url, body(model, reqs[i], prompt_format))
            finally:
                done[i].set()
        results = await asyncio.gather(*(go(i) for i in range(len(reqs))))
        wall = time.perf_counter() - t0
    return list(results), wall


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    out = {"requests": len(ok), "errors": len(errors), "first_error": errors[0] if errors else None, "wall_s": wall,
           "request_throughput": len(ok) / wall if wall else float("nan"),
           "output_tok_s": sum(r["tokens"] for r in ok) / wall if wall else float("nan")}
    for name in ("tpot", "ttft"):
        xs = [r[name] for r in ok]
        for p in (50, 90, 99):
            out[f"{name}_p{p}_ms"] = 1e3 * pct(xs, p)
        out[f"{name}_mean_ms"] = 1e3 * statistics.fmean(xs) if xs else float("nan")
    return out


def served_model(url: str, api_key: str | None = None) -> str:
    import httpx
    r = httpx.get(url.rstrip("/") + "/v1/models", headers={"Authorization": f"Bearer {api_key}"} if api_key else {},
                  timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def max_throughput(url: str, model: str, workload, **kw) -> float:
    """Requests per second with every request sent at once (chat turns still wait for their turn)."""
    results, wall = asyncio.run(drive(url, model, workload, **kw))
    s = summarize(results, wall)
    if s["errors"]:
        raise RuntimeError(f"{s['errors']} requests failed while measuring the maximum throughput: {s['first_error']}")
    return s["request_throughput"]


def warm_up(url: str, model: str, prompt_format: str = "ids", api_key: str | None = None) -> None:
    """One short request, not counted, before a server's first load (as `vllm bench serve`'s
    test run): the first requests of a load then do not pay a fresh server's first call.
    Its prompt (ids 10..41) shares no page with a workload's random ids."""
    from detent.workloads import Request, Workload
    w = Workload("warm-up", (Request(tuple(range(10, 42)), 8),), (), 0)
    (r,), _ = asyncio.run(drive(url, model, w, prompt_format=prompt_format, api_key=api_key, timeout=600))
    if "error" in r:
        raise RuntimeError(f"the warm-up request failed: {r['error']}")


def for_load(name: str, load, seed: int = 0, **wargs):
    """The requests one load sends: workload `name` drawn at the load's own prompt seed
    (`detent.workloads.load_seed`), so a load never replays what an earlier one cached."""
    from detent.workloads import load_seed, make
    return make(name, seed=load_seed(seed, load.name), **wargs)


def run_load(url: str, model: str, workload, load, lambda_max: float | None, seed: int = 0, **kw) -> dict:
    """One load (`Load`: a fraction of `lambda_max`, or a concurrency) of `workload` (the load's
    own requests: `for_load`); its summary, and each request's TTFT and TPOT in request order
    (`per_request`, ms, None where a request failed), for pairing arms request by request."""
    if load.fraction is not None:
        if not lambda_max:
            raise ValueError(f"load {load.name} is a fraction of stock's maximum throughput: give lambda_max")
        rate, conc = load.fraction * lambda_max, None
    else:
        rate, conc = None, load.concurrency
    results, wall = asyncio.run(drive(url, model, workload, rate=rate, concurrency=conc, seed=seed, **kw))
    per = {f"{k}_ms": [None if "error" in r else round(1e3 * r[k], 3) for r in results] for k in ("ttft", "tpot")}
    return {"load": load.name, "rate": rate, "concurrency": conc, "prompt_seed": workload.seed,
            **summarize(results, wall), "per_request": per}


def main(argv=None) -> None:
    from detent.workloads import make
    p = argparse.ArgumentParser("workload_client")
    p.add_argument("--url", required=True)
    p.add_argument("--api-key", default=None)
    p.add_argument("--workload", required=True, help="W-A, W-B or W-C")
    p.add_argument("--load", default=None, help="one of the workload's loads (A1..A4, B1..B3, C1, C2); default all")
    p.add_argument("--lambda-max", type=float, default=None, help="stock's maximum request throughput (req/s)")
    p.add_argument("--measure-max", action="store_true", help="measure the maximum request throughput and print it")
    p.add_argument("--num-requests", type=int, default=None)
    p.add_argument("--max-len", type=int, default=None, help="prompt + output at most this many tokens")
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt-format", choices=("ids", "words"), default="ids")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    wargs = {"num_requests": a.num_requests, "max_len": a.max_len, "vocab": a.vocab}
    w = make(a.workload, seed=a.seed, **wargs)
    model = served_model(a.url, a.api_key)
    kw = {"prompt_format": a.prompt_format, "api_key": a.api_key}
    if a.measure_max:
        print(json.dumps({"workload": w.name, "lambda_max": max_throughput(a.url, model, w, **kw)}), flush=True)
        return
    for load in w.loads:
        if a.load in (None, load.name):
            r = run_load(a.url, model, for_load(a.workload, load, a.seed, **wargs), load, a.lambda_max, a.seed, **kw)
            print(json.dumps({k: v for k, v in r.items() if k != "per_request"}), flush=True)


if __name__ == "__main__":
    main()
