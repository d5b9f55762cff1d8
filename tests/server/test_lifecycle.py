"""Lifecycle on the real engine: disconnects free their blocks, overload is
a 503 with Retry-After, SIGTERM stops cleanly, a bad tuple refuses startup."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from server_helpers import API_KEY, Server, free_port, real_argv

AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.mark.parametrize("which", ["server", "async_server"])
def test_200_requests_quarter_disconnect_mid_stream(which, request):
    server = request.getfixturevalue(which)  # async_server: disconnects while a step is in flight

    async def one(c: httpx.AsyncClient, i: int) -> str:
        leave = i % 4 == 0
        body = {"prompt": f"Story {i}: once", "max_tokens": 64 if leave else 4, "stream": True,
                "temperature": 0}
        async with c.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH) as r:
            assert r.status_code == 200
            n = 0
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    n += 1
                    if leave and n >= 2:
                        return "left"  # closing the stream mid-generation
                    assert '"error"' not in line, line
        return "done"

    async def main():
        sem = asyncio.Semaphore(32)
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as c:
            async def gated(i):
                async with sem:
                    return await one(c, i)
            return await asyncio.gather(*(gated(i) for i in range(200)))

    aborted0 = _count(server, "abort")
    t0 = time.time()
    res = asyncio.run(main())
    assert res.count("left") == 50 and res.count("done") == 150
    deadline = time.time() + 30
    while time.time() < deadline and (server.metric("detent:kv_cache_usage_perc") != 0
                                      or server.metric("detent:num_requests_running") != 0):
        time.sleep(0.2)
    assert server.metric("detent:kv_cache_usage_perc") == 0.0
    assert server.metric("detent:num_requests_running") == 0
    assert _count(server, "abort") - aborted0 == 50
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}
    assert httpx.post(server.url + "/ping").json() == {"status": "ok"}
    print(f"200 requests (50 disconnecting) in {time.time() - t0:.1f}s")


def test_non_streaming_client_that_leaves_is_aborted(server):
    aborted0 = _count(server, "abort")
    for i in range(3):
        try:
            httpx.post(server.url + "/v1/completions", headers=AUTH, timeout=0.3,
                       json={"prompt": f"Long story {i}", "max_tokens": 900, "ignore_eos": True, "temperature": 0})
            raise AssertionError("the request should not have finished within 0.3 s")
        except httpx.TimeoutException:
            pass
    deadline = time.time() + 30
    while time.time() < deadline and (_count(server, "abort") - aborted0 < 3
                                      or server.metric("detent:kv_cache_usage_perc") != 0):
        time.sleep(0.2)
    assert _count(server, "abort") - aborted0 == 3
    assert server.metric("detent:kv_cache_usage_perc") == 0.0


def _count(server, outcome):
    return sum(v for k, v in server.metrics().items()
               if k.startswith("detent:request_success_total{") and f'finished_reason="{outcome}"' in k)


def test_embedded_default_model_overload_503_then_sigterm_clean():
    """No --model: the embedded SmolLM2 answers; a full queue is a 503; SIGTERM exits 0."""
    s = Server(real_argv("--max-num-seqs", "1", "--max-queue-len", "2", "--max-model-len", "256",
                         "--graceful-timeout", "3")).wait_ready()
    try:
        r = httpx.post(s.url + "/v1/chat/completions", timeout=120, json={
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 12, "temperature": 0})
        assert "Paris" in r.json()["choices"][0]["message"]["content"], r.text
        assert httpx.get(s.url + "/v1/models").json()["data"][0]["id"] == "smollm2-135m-instruct"
        async def burst():
            async with httpx.AsyncClient(timeout=120) as c:
                return await asyncio.gather(*(c.post(s.url + "/v1/completions",
                                                     json={"prompt": f"x{i}", "max_tokens": 8, "temperature": 0})
                                              for i in range(12)))
        rs = asyncio.run(burst())
        codes = [r.status_code for r in rs]
        assert 503 in codes and 200 in codes, codes
        r = next(r for r in rs if r.status_code == 503)
        assert int(r.headers["retry-after"]) >= 1 and r.json()["error"]["code"] == "overloaded"
        assert "--max-queue-len=2" in r.json()["error"]["message"]
        ok = httpx.post(s.url + "/v1/completions", timeout=120,
                        json={"prompt": "ok", "max_tokens": 2, "temperature": 0})
        assert ok.status_code == 200
        # SIGTERM with a stream open: the stream ends, the process exits 0
        with httpx.stream("POST", s.url + "/v1/completions", timeout=60,
                          json={"prompt": "x", "max_tokens": 200, "stream": True, "temperature": 0}) as st:
            next(st.iter_lines())
            t0 = time.time()
            s.proc.send_signal(signal.SIGTERM)
            rc = s.proc.wait(30)
        assert rc == 0, s.output()[-2000:]
        assert time.time() - t0 < 20
        assert "detent-serve: stopped" in s.output()
    finally:
        if s.proc.poll() is None:
            s.proc.kill()


def test_bad_tuple_refuses_startup(tmp_path, tiny_model):
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    mismatched = tmp_path / "mismatched.json"
    mismatched.write_text(json.dumps({"format_version": 1, "facts": {"device": "tpu", "tp": 3}, "families": {}}))
    for path in (bad, mismatched):
        s = Server(real_argv("--model", tiny_model, "--tuple", str(path)))
        deadline = time.time() + 120
        while s.proc.poll() is None and time.time() < deadline:
            try:
                started = httpx.get(s.url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                started = False
            if started:
                s.proc.kill()
                s.proc.wait()
                raise AssertionError(f"detent-serve started with the bad tuple {path}:\n{s.output()[-2000:]}")
            time.sleep(0.2)
        if s.proc.poll() is None:
            s.proc.kill()
        err = s.output()
        assert s.proc.wait() == 2, err[-2000:]
        assert "refusing to start" in err and path.name in err, err[-2000:]


def test_good_tuple_serves_and_reports_its_hash(tmp_path, tiny_model):
    t = tmp_path / "t.json"
    p = subprocess.run([sys.executable, "-m", "detent.cli", "tuple", "default", "--model", tiny_model,
                        "--max-context", "1024", "--max-num-seqs", "32", "-o", str(t)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    printed = re.search(r"tuple hash ([0-9a-f]+)", p.stdout + p.stderr).group(1)
    s = Server(real_argv("--model", tiny_model, "--tuple", str(t), "--max-model-len", "1024",
                         "--max-num-seqs", "32"))
    try:
        s.wait_ready(120)
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0})
        h = r.headers["x-detent-tuple-hash"]
        assert h.startswith(printed) and r.json()["detent"]["tuple_hash"] == h
    finally:
        s.stop()


def test_max_model_len_unlike_the_tuples_says_how_to_match(tmp_path, tiny_model):
    t = tmp_path / "t.json"
    p = subprocess.run([sys.executable, "-m", "detent.cli", "tuple", "default", "--model", tiny_model,
                        "--max-model-len", "512", "--max-num-seqs", "32", "-o", str(t)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    s = Server(real_argv("--model", tiny_model, "--tuple", str(t), "--max-model-len", "1024", "--max-num-seqs", "32"))
    try:
        assert s.proc.wait(300) == 2
    finally:
        if s.proc.poll() is None:
            s.proc.kill()
    err = s.output()
    assert "refusing to start" in err and "deployment fact 'max_context' differs" in err, err[-2000:]
    assert re.search(rf"detent tuple default --model {re.escape(tiny_model)} .*--max-model-len 1024 .*-o t\.json",
                     err), err[-2000:]
    assert "or run with the tuple's value: --max-model-len 512" in err


def test_missing_dependency_refuses_before_the_engine_starts(tiny_model):
    """An HTTP-side module that cannot be imported (a partial install) refuses startup with
    its name, before the model loads; it once surfaced only after the engine core had
    started, and the core (a child process the server waits for at exit) kept the failed
    server alive for good."""
    launcher = real_argv()[1]
    code = ("import runpy, sys; sys.modules['partial_json_parser'] = None; "
            f"sys.argv = [{launcher!r}, *sys.argv[1:]]; runpy.run_path({launcher!r}, run_name='__main__')")
    argv = [sys.executable, "-c", code, "--model", tiny_model, "--port", str(free_port())]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "DETENT_TEST_THREADS": "2"})
    try:
        out, _ = p.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        raise AssertionError(f"detent-serve kept running after a failed import:\n{out[-3000:]}")
    assert p.returncode == 2, out[-3000:]
    assert "refusing to start" in out and "partial_json_parser" in out, out[-3000:]
    assert "engine core" not in out.lower() and "warming" not in out.lower(), out[-3000:]
