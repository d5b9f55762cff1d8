"""The server's plumbing (engine thread, aborts, overload, limits, SIGTERM)
over the FAKE engine of fake_engine.py (a test double: no model), so these
run in seconds. The same behaviours are checked against the real engine in
test_api.py / test_lifecycle.py."""
from __future__ import annotations

import asyncio
import json
import signal
import time

import httpx
import pytest

from conftest import Server, fake_argv, launch


def _sse_events(lines):
    for line in lines:
        if line.startswith("data: "):
            data = line[len("data: "):]
            if data == "[DONE]":
                return
            yield json.loads(data)


@pytest.fixture(scope="module")
def fake():
    with launch(fake_argv("--max-num-seqs", "4", "--max-queue-len", "3", "--max-request-bytes", "2000",
                          "--max-model-len", "512")) as s:
        yield s


def test_stream_concatenates_to_nonstream_with_stop_holdback(fake):
    body = {"prompt": "hello", "max_tokens": 40, "seed": 3, "stop": ["qz", "zz"], "logprobs": 1}
    full = httpx.post(fake.url + "/v1/completions", json=body).json()
    with httpx.stream("POST", fake.url + "/v1/completions", json={**body, "stream": True}) as r:
        events = list(_sse_events(r.iter_lines()))
    text = "".join(c["text"] for e in events for c in e["choices"])
    assert text == full["choices"][0]["text"]
    toks = [t for e in events for c in e["choices"] for t in c["logprobs"]["tokens"]]
    assert toks == full["choices"][0]["logprobs"]["tokens"]


def test_disconnect_mid_stream_aborts_and_frees_blocks(fake):
    async def one(i: int, disconnect: bool):
        async with httpx.AsyncClient(timeout=30) as c:
            body = {"prompt": f"p{i}", "max_tokens": 400 if disconnect else 5, "stream": True}
            async with c.stream("POST", fake.url + "/v1/completions", json=body) as r:
                n = 0
                async for line in r.aiter_lines():
                    n += line.startswith("data: ")
                    if disconnect and n >= 3:
                        return "left"
            return "done"

    async def main():
        sem = asyncio.Semaphore(3)  # stay under the queue limit

        async def gated(i):
            async with sem:
                return await one(i, i % 4 == 0)
        return await asyncio.gather(*(gated(i) for i in range(24)))

    aborted0 = _outcome(fake, "abort")
    res = asyncio.run(main())
    assert res.count("left") == 6
    deadline = time.time() + 10
    while time.time() < deadline and fake.metric("detent_kv_cache_usage_perc") != 0:
        time.sleep(0.1)
    assert fake.metric("detent_kv_cache_usage_perc") == 0
    assert _outcome(fake, "abort") - aborted0 == 6
    assert httpx.get(fake.url + "/health").status_code == 200


def _outcome(s: Server, outcome: str) -> float:
    return sum(v for k, v in s.metrics().items() if k.startswith("detent_requests_total{") and f'outcome="{outcome}"' in k)


def test_overload_503_with_retry_after_then_recovers(fake):
    async def main():
        async with httpx.AsyncClient(timeout=60) as c:
            rs = await asyncio.gather(*(c.post(fake.url + "/v1/completions",
                                               json={"prompt": f"x{i}", "max_tokens": 30}) for i in range(16)))
        return rs

    rs = asyncio.run(main())
    codes = [r.status_code for r in rs]
    assert 503 in codes and 200 in codes, codes
    r503 = next(r for r in rs if r.status_code == 503)
    assert int(r503.headers["retry-after"]) >= 1
    assert r503.json()["error"]["code"] == "overloaded" and "--max-queue-len=3" in r503.json()["error"]["message"]
    assert httpx.post(fake.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_body_too_large_413(fake):
    r = httpx.post(fake.url + "/v1/completions", json={"prompt": "x" * 5000, "max_tokens": 2})
    assert r.status_code == 413 and "2000 bytes" in r.json()["error"]["message"]
    # chunked upload without Content-Length is counted as it arrives
    r = httpx.post(fake.url + "/v1/completions", content=iter([b'{"prompt": "', b"y" * 3000, b'"}']))
    assert r.status_code == 413
    assert httpx.post(fake.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_sigterm_during_streams_exits_cleanly():
    s = Server(fake_argv("--graceful-timeout", "2")).wait_ready()
    try:
        with httpx.stream("POST", s.url + "/v1/completions",
                          json={"prompt": "x", "max_tokens": 400, "stream": True}) as r:
            next(r.iter_lines())
            s.proc.send_signal(signal.SIGTERM)
            t0 = time.time()
            rc = s.proc.wait(20)
        assert rc == 0 and time.time() - t0 < 15
        assert "detent-serve: stopped" in s.output()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
