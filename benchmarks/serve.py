"""TTFT and time per output token, p50/p90/p99, at several concurrencies:
through `detent-serve` (HTTP, streaming) and through the offline engine
(`LLMEngine.add_request/step` in process), on the same workload, so the
HTTP overhead is visible side by side.

    python benchmarks/serve.py                       # embedded SmolLM2, concurrency 1 16 64
    python benchmarks/serve.py --model PATH --concurrency 1 8 --max-tokens 32
    python benchmarks/serve.py --url http://127.0.0.1:8000   # an already running server
    python benchmarks/serve.py --tiny                # a tiny random Llama: the HTTP overhead stands out

Modes alternate run by run (server, offline, offline, server, ...) so both
see the same machine load; samples of the repeats are pooled.

Workload: closed loop, C clients each sending its next request when the
previous one ends; prompts of --prompt-len tokens of seeded random text;
greedy, `ignore_eos`, exactly --max-tokens tokens each. TTFT is measured
from sending (server) or add_request (offline) to the first token; TPOT
is (last token time - first token time) / (tokens - 1) per request.

Dependencies: the package and its `bench` extra (`pip install -e ".[bench]"`:
httpx). Whatever happens (an error, Ctrl-C), the server it started, with its
engine core, and the --tiny model's temp folder are gone when it exits.
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

WORDS = ("river stone light garden window music paper cloud forest silver engine harbor "
         "winter market orange yellow quiet bright simple number letter summer mountain").split()


def prompts(n: int, words: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(mode: str, c: int, ttft: list[float], tpot: list[float], tokens: int, wall: float) -> dict:
    return {"mode": mode, "concurrency": c, "requests": len(ttft),
            **{f"ttft_p{p}_ms": 1e3 * pct(ttft, p) for p in (50, 90, 99)},
            **{f"tpot_p{p}_ms": 1e3 * pct(tpot, p) for p in (50, 90, 99)},
            "tokens_per_s": tokens / wall}


# ---------------------------------------------------------------- server
async def _one_http(client, url: str, prompt: str, max_tokens: int) -> tuple[float, float, int]:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = 0
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
            if any(ch.get("text") for ch in ev.get("choices", [])):
                now = time.perf_counter()
                first = first or now
                last = now
    return first - t0, (last - first) / max(tokens - 1, 1), tokens


async def bench_server(url: str, c: int, ps: list[str], max_tokens: int) -> dict:
    import httpx
    queue = list(ps)
    ttft, tpot, total = [], [], 0
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=c + 4)) as client:
        async def worker():
            nonlocal total
            while queue:
                a, b, n = await _one_http(client, url, queue.pop(), max_tokens)
                ttft.append(a)
                tpot.append(b)
                total += n
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(c)))
        wall = time.perf_counter() - t0
    return ttft, tpot, total, wall


@contextlib.contextmanager
def running_server(a):
    """`detent-serve` in a process group of its own for the duration of the block (yields its URL).
    On the way out, whatever happened: SIGTERM (it stops its engine core), then SIGKILL to
    whatever of the group is left, so no server or core outlives the benchmark."""
    import httpx
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "detent.server.cli", "--port", str(port), "--log-level", "warning",
            "--max-num-seqs", str(max(a.concurrency)), "--max-queue-len", "100000", *a.engine_args]
    if a.model:
        argv += ["--model", a.model]
    env = dict(os.environ)
    if a.threads:
        env["OMP_NUM_THREADS"] = str(a.threads)  # torch's intra-op threads in the server process
    proc = subprocess.Popen(argv, env=env, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(3000):
            if proc.poll() is not None:
                raise SystemExit(f"server exited with {proc.returncode}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        else:
            raise SystemExit("server did not become ready")
        yield url
    finally:
        stop_group(proc)


def stop_group(proc: subprocess.Popen, timeout: float = 60) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    try:  # the server leads its group (start_new_session): its core and workers are in it
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


# ---------------------------------------------------------------- offline
def bench_offline(engine, tok, c: int, ps: list[str], max_tokens: int) -> dict:
    from detent.sampling.params import SamplingParams
    sp = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    queue = [tok.encode(p) for p in ps]
    t_add, t_first, t_last, ntok = {}, {}, {}, {}
    seq = 0

    def add():
        nonlocal seq
        rid = f"b{c}-{seq}"
        seq += 1
        t_add[rid] = time.perf_counter()
        engine.add_request(rid, queue.pop(), sp)

    t0 = time.perf_counter()
    for _ in range(min(c, len(queue))):
        add()
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            n = len(out.outputs[0].token_ids)
            if n and out.request_id not in t_first:
                t_first[out.request_id] = now
            if n:
                t_last[out.request_id], ntok[out.request_id] = now, n
            if out.finished and queue:
                add()
    wall = time.perf_counter() - t0
    ttft = [t_first[r] - t_add[r] for r in t_first]
    tpot = [(t_last[r] - t_first[r]) / max(ntok[r] - 1, 1) for r in t_first]
    return ttft, tpot, sum(ntok.values()), wall


def table(rows: list[dict]) -> str:
    head = ("| mode | C | requests | TTFT p50 | p90 | p99 (ms) | TPOT p50 | p90 | p99 (ms) | tok/s |\n"
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['concurrency']} | {r['requests']} | "
                     + " | ".join(f"{r[k]:.1f}" for k in ("ttft_p50_ms", "ttft_p90_ms", "ttft_p99_ms",
                                                           "tpot_p50_ms", "tpot_p90_ms", "tpot_p99_ms"))
                     + f" | {r['tokens_per_s']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--tiny", action="store_true", help="build and use a tiny random Llama (in a temp dir)")
    p.add_argument("--url", default=None, help="benchmark this running server instead of starting one")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--requests-per-client", type=int, default=2)
    p.add_argument("--min-requests", type=int, default=8)
    p.add_argument("--prompt-words", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=2, help="runs per (mode, concurrency), alternating modes")
    p.add_argument("--skip-offline", action="store_true")
    p.add_argument("--skip-server", action="store_true")
    p.add_argument("--threads", type=int, default=None,
                   help="torch CPU threads for both the server and the offline engine (same for both)")
    p.add_argument("--json", default=None, help="also write the rows here")
    p.add_argument("engine_args", nargs="*", help="after --: extra detent-serve / LLM flags for the server")
    a = p.parse_args(argv)
    n_for = lambda c: max(a.min_requests, c * a.requests_per_client)  # noqa: E731
    modes = [m for m, skip in (("server", a.skip_server), ("offline", a.skip_offline)) if not skip]
    url, eng, tok = a.url, None, None
    with contextlib.ExitStack() as cleanup:  # undone in reverse order, on any exit
        if a.tiny:
            from detent.models.tiny import write_tiny_llama
            a.model = write_tiny_llama(cleanup.enter_context(tempfile.TemporaryDirectory(prefix="detent-tiny-")))
        if "server" in modes and url is None:
            url = cleanup.enter_context(running_server(a))
        if "offline" in modes:
            if a.threads:
                import torch
                torch.set_num_threads(a.threads)
            from detent.engine import LLM
            llm = LLM(model=a.model, max_num_seqs=max(a.concurrency))
            cleanup.callback(llm.shutdown)
            eng, tok = llm.llm_engine, llm.get_tokenizer()

        def once(mode: str, c: int, ps: list[str]):
            if mode == "server":
                return asyncio.run(bench_server(url, c, ps, a.max_tokens))
            return bench_offline(eng, tok, c, ps, a.max_tokens)

        for mode in modes:  # warm-up
            once(mode, 1, prompts(2, a.prompt_words, 99))
        rows = []
        for c in a.concurrency:
            acc = {m: ([], [], 0, 0.0) for m in modes}
            for rep in range(a.repeats):  # alternate, so both modes see the same machine load
                for mode in (modes if rep % 2 == 0 else modes[::-1]):
                    t1, t2, n, w = once(mode, c, prompts(n_for(c), a.prompt_words, 1000 * rep + c))
                    x = acc[mode]
                    acc[mode] = (x[0] + t1, x[1] + t2, x[2] + n, x[3] + w)
            for mode in modes:
                rows.append(summarize(mode, c, *acc[mode]))
                print(table(rows[-1:]), flush=True)
    rows.sort(key=lambda r: (r["concurrency"], r["mode"]))
    print(f"\n{os.cpu_count()} CPUs, {a.threads or 'default'} torch threads; prompt {a.prompt_words} words, "
          f"{a.max_tokens} tokens per request\n")
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
