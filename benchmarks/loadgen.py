"""A small OpenAI-completions load generator (aiohttp, streaming), for profiling
a server on a machine where vLLM's own generator (`vllm bench serve`) is not
installed. The numbers reported in docs/performance.md come from
`vllm bench serve` (benchmarks/serve_load.py); this client is for finding where
the time goes, and is checked against that one in the same lease.

Prompts are exact-length word lists for a word-level tokenizer
(benchmarks/wordlevel_model.py: word "t<i>" is token i), seeded.

    python3 benchmarks/loadgen.py --url http://127.0.0.1:8100 --rate 20 --num-prompts 400
    python3 benchmarks/loadgen.py --url ... --concurrency 64 --num-prompts 256 --lengths sharegpt
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time

from detent.workloads import sharegpt_like  # one recipe for both; serve_load.py imports it from here


def workload(kind: str, n: int, input_len: int, output_len: int, seed: int, vocab: int = 128000):
    rng = random.Random(seed)
    lens = sharegpt_like(n, seed) if kind == "sharegpt" else [(input_len, output_len)] * n
    return [(" ".join(f"t{rng.randrange(10, vocab)}" for _ in range(p)), o) for p, o in lens]


async def one(session, url: str, model: str, prompt: str, max_tokens: int, extra: dict | None = None) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, **(extra or {})}
    t0 = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with session.post(url + "/v1/completions", json=body) as r:
        if r.status != 200:
            return {"error": f"{r.status}: {(await r.text())[:200]}"}
        buf = b""
        async for chunk in r.content.iter_any():
            buf += chunk
            while b"\n\n" in buf:
                ev, buf = buf.split(b"\n\n", 1)
                if not ev.startswith(b"data: {"):
                    continue
                d = json.loads(ev[6:])
                if d.get("usage"):
                    tokens = d["usage"]["completion_tokens"]
                if any(c.get("text") for c in d.get("choices", [])):
                    times.append(time.perf_counter())
    if not times:
        return {"error": "no tokens"}
    ttft = times[0] - t0
    tpot = (times[-1] - times[0]) / max(tokens - 1, 1)
    itl = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": ttft, "tpot": tpot, "itl": itl, "tokens": tokens, "latency": times[-1] - t0}


def pct(xs, p):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


async def run(a) -> dict:
    import aiohttp

    work = workload(a.lengths, a.num_prompts, a.input_len, a.output_len, a.seed)
    rng = random.Random(a.seed + 1)
    sem = asyncio.Semaphore(a.concurrency) if a.concurrency else None
    conn = aiohttp.TCPConnector(limit=0)
    timeout = aiohttp.ClientTimeout(total=6 * 3600)
    async with aiohttp.ClientSession(connector=conn, timeout=timeout) as s:
        async def go(p, o):
            if sem is None:
                return await one(s, a.url, a.model, p, o, a.extra_body)
            async with sem:
                return await one(s, a.url, a.model, p, o, a.extra_body)

        t0 = time.perf_counter()
        tasks = []
        for p, o in work:
            tasks.append(asyncio.create_task(go(p, o)))
            if a.rate:
                await asyncio.sleep(rng.expovariate(a.rate))
        res = await asyncio.gather(*tasks)
        wall = time.perf_counter() - t0
    ok = [r for r in res if "error" not in r]
    errors = [r["error"] for r in res if "error" in r]
    itl = [x for r in ok for x in r["itl"]]
    out = {"rate": a.rate, "concurrency": a.concurrency, "lengths": a.lengths, "requests": len(ok),
           "errors": len(errors), "first_error": errors[0] if errors else None, "wall_s": wall,
           "output_tok_s": sum(r["tokens"] for r in ok) / wall}
    for name, xs in (("ttft", [r["ttft"] for r in ok]), ("tpot", [r["tpot"] for r in ok]), ("itl", itl)):
        for p in (50, 90, 99):
            out[f"{name}_p{p}_ms"] = 1e3 * pct(xs, p)
        out[f"{name}_mean_ms"] = 1e3 * statistics.fmean(xs) if xs else float("nan")
    return out


def parse(argv=None):
    p = argparse.ArgumentParser("loadgen")
    p.add_argument("--url", required=True)
    p.add_argument("--model", default="m")
    p.add_argument("--rate", type=float, default=0.0, help="Poisson arrivals per second (0: all at once)")
    p.add_argument("--concurrency", type=int, default=0, help="closed loop with this many clients (0: unbounded)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--lengths", choices=("fixed", "sharegpt"), default="fixed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--extra-body", type=json.loads, default=None, metavar="JSON",
                   help='fields merged into every request body, e.g. \'{"structured_outputs": {"json": '
                        '{"type": "string"}}}\' (as vllm bench serve\'s --extra-body)')
    return p.parse_args(argv)


if __name__ == "__main__":
    print(json.dumps(asyncio.run(run(parse()))), flush=True)
    sys.exit(0)
