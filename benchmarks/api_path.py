"""Can `detent-serve`'s API process keep up with a token rate? (CPU, no model)

The real app (FastAPI, the completions endpoint, SSE, metrics) serves streams
from the test double `tests/server/fake_engine.FakeEngine` (no model: a step
sleeps `--step-ms`, then appends a token to every running request) through
`AsyncEngine`, the in-process step thread. A client in this process streams
`--streams` completions of `--tokens` tokens at once (httpx) and compares each
stream's time per output token with the engine's step interval: a client
TPOT above the step interval means the API path delivered late. The server's
CPU per token counts the fake engine's work too, so it is an upper bound.

    python benchmarks/api_path.py --streams 50 --tokens 128 --step-ms 15

Not covered there: the engine core in its own process (`AsyncCoreEngine`:
pickled deltas through a pipe, rebuilt in a reader thread), and prompt
tokenization. `--url` covers them: it drives a running server (any model
whose tokenizer reads words "t<i>", e.g. benchmarks/wordlevel_model.py's) with
Poisson arrivals of `--prompt-words`-word prompts and prints the client's
mean TTFT, TPOT and end to end beside the server's own (/metrics, as
serve_load.py reads them). Equal means: the server delivered each token when
it had it.

    python benchmarks/api_path.py --url http://127.0.0.1:8000 --requests 300 --rate 50 --tokens 128
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def serve(port: int, step_s: float) -> None:
    sys.path.insert(0, os.path.join(HERE, "..", "tests", "server"))
    import uvicorn
    from fake_engine import FakeEngine, FakeTokenizer

    from detent.server.app import build_app
    from detent.server.async_engine import AsyncEngine
    from detent.server.serving import ServerState

    eng = FakeEngine(max_num_seqs=256, step_s=step_s, max_model_len=8192, num_blocks=1 << 20)
    steps = [0]
    step = eng.step

    def counted():
        steps[0] += 1
        return step()

    eng.step = counted
    state = ServerState(engine=AsyncEngine(eng), tokenizer=FakeTokenizer(), served_model_names=["m"],
                        model_root="x", max_model_len=8192, tuple_hash="a" * 64, deployment_hash="b" * 64)
    app = build_app(state)

    @app.fastapi.get("/bench_cpu")
    async def cpu():
        r = resource.getrusage(resource.RUSAGE_SELF)
        return {"cpu": r.ru_utime + r.ru_stime, "steps": steps[0]}

    uvicorn.run(app, port=port, log_level="warning")


async def _event_times(c, url: str, body: dict) -> list[float]:
    """Stream one completion; the client's clock at each SSE event that carries a chunk."""
    times = []
    async with c.stream("POST", url + "/v1/completions", json=body) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:") and "[DONE]" not in line:
                times.append(time.perf_counter())
    return times


def _tpot(times: list[float]) -> float:
    """A stream's time per output token (s): first to last event over the gaps between them."""
    return (times[-1] - times[0]) / (len(times) - 1)


async def drive(port: int, streams: int, tokens: int) -> dict:
    import httpx
    url = f"http://127.0.0.1:{port}"
    body = {"model": "m", "prompt": "hello world " * 20, "max_tokens": tokens, "stream": True,
            "ignore_eos": True, "temperature": 1.0}

    async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=streams + 8)) as c:
        a = (await c.get(url + "/bench_cpu")).json()
        t0 = time.perf_counter()
        res = await asyncio.gather(*[_event_times(c, url, body) for _ in range(streams)])
        wall = time.perf_counter() - t0
        b = (await c.get(url + "/bench_cpu")).json()
    events = sum(len(t) for t in res)
    steps = b["steps"] - a["steps"]
    return {"streams": streams, "tokens": tokens, "events": events, "wall_s": wall, "engine_steps": steps,
            "step_ms": 1e3 * wall / steps, "tokens_per_s": events / wall,
            "client_tpot_ms": 1e3 * statistics.mean(_tpot(t) for t in res if len(t) > 1),
            "server_cpu_us_per_token": 1e6 * (b["cpu"] - a["cpu"]) / events}


async def drive_url(url: str, requests: int, rate: float, tokens: int, prompt_words: int, vocab: int,
                    model: str) -> dict:
    import random

    import httpx

    sys.path.insert(0, HERE)
    from serve_load import latency_means, request_latency

    rng = random.Random(0)
    starts, t = [], 0.0
    for _ in range(requests):
        t += rng.expovariate(rate)
        starts.append(t)
    prompts = [" ".join(f"t{rng.randrange(3, vocab)}" for _ in range(prompt_words)) for _ in range(requests)]

    async def one(c, delay: float, prompt: str) -> tuple[float, list[float]]:
        await asyncio.sleep(delay)
        body = {"model": model, "prompt": prompt, "max_tokens": tokens, "stream": True, "ignore_eos": True,
                "temperature": 1.0}
        t0 = time.perf_counter()
        return t0, await _event_times(c, url, body)

    before = request_latency(url)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=requests + 8)) as c:
        res = await asyncio.gather(*[one(c, d, p) for d, p in zip(starts, prompts)])
    await asyncio.sleep(1.0)
    server = latency_means(before, request_latency(url))
    done = [(t0, ts) for t0, ts in res if len(ts) > 1]
    return {"requests": requests, "rate": rate, "tokens": tokens, "prompt_words": prompt_words,
            "client_mean_ms": {"time_to_first_token": 1e3 * statistics.mean(ts[0] - t0 for t0, ts in done),
                               "request_time_per_output_token": 1e3 * statistics.mean(_tpot(ts) for _, ts in done),
                               "e2e_request_latency": 1e3 * statistics.mean(ts[-1] - t0 for t0, ts in done)},
            "server_mean_ms": server}


def main() -> None:
    ap = argparse.ArgumentParser("api_path")
    ap.add_argument("--streams", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--step-ms", type=float, default=15.0)
    ap.add_argument("--port", type=int, default=8751)
    ap.add_argument("--url", default="", help="drive this running server instead (Poisson arrivals)")
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--rate", type=float, default=20.0)
    ap.add_argument("--prompt-words", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=2000, help="prompt words are t3 .. t<vocab - 1>")
    ap.add_argument("--model", default="m")
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve(a.port, a.step_ms / 1e3)
    if a.url:
        r = asyncio.run(drive_url(a.url.rstrip("/"), a.requests, a.rate, a.tokens, a.prompt_words, a.vocab, a.model))
        print(json.dumps(r))
        return
    proc = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(a.port), "--step-ms", str(a.step_ms)])
    try:
        import urllib.request
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{a.port}/health", timeout=1)
                break
            except Exception:  # noqa: BLE001
                time.sleep(0.5)
        asyncio.run(drive(a.port, 4, 8))  # warm
        print(json.dumps(asyncio.run(drive(a.port, a.streams, a.tokens))))
    finally:
        proc.terminate()
        proc.wait(10)


if __name__ == "__main__":
    main()
