"""`detent-serve` with the engine core in its own process (the default).

The server tests elsewhere (aborts, disconnects with KV back to 0, errors in
OpenAI's shape, seeded bits alone and among 16) run against this layout
already; here: the wire format between the two processes, the process
itself (it exists, it dies visibly, it never outlives the server) and
SIGTERM draining open streams."""
from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import pytest

from detent.engine.core_process import DeltaDecoder, DeltaEncoder
from detent.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput

from server_helpers import API_KEY, launch, real_argv

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _cumulative(rid: str, texts: list[list[str]], finished_at: int, with_logprobs: bool) -> list[RequestOutput]:
    """The cumulative outputs an engine emits for a request with len(texts[0]) steps, n = len(texts)."""
    outs = []
    for step in range(len(texts[0])):
        samples = []
        for i, t in enumerate(texts):
            ids = list(range(100 * i, 100 * i + step + 1))
            lps = [{tok: Logprob(-0.5 * k, 1 + k % 3, f"w{tok}")} for k, tok in enumerate(ids)] if with_logprobs else None
            done = step >= finished_at
            samples.append(CompletionOutput(i, t[step], ids, -float(step) if with_logprobs else None, lps,
                                            "stop" if done else None, "###" if done else None, seed=7 + i))
        fin = step >= finished_at
        outs.append(RequestOutput(rid, "prompt text", [1, 2, 3], [None, {2: Logprob(-1.0, 1)}], samples, fin,
                                  num_cached_tokens=16, metrics=RequestMetrics(1.0, 2.0, 3.0 if fin else None),
                                  error=None))
    return outs


@pytest.mark.parametrize("with_logprobs", [False, True])
def test_deltas_rebuild_the_cumulative_outputs(with_logprobs):
    # sample 1's text is cut back at the end (a stop string found across two steps)
    texts = [["He", "Hell", "Hello", "Hello w", "Hello world"],
             ["A", "A #", "A ##", "A ###x", "A "]]
    enc, dec = DeltaEncoder(), DeltaDecoder()
    for want in _cumulative("r1", texts, finished_at=4, with_logprobs=with_logprobs):
        d = enc.encode(want)
        assert len(d.samples[0].new_token_ids) <= 1 or want is not None  # only what is new travels
        assert dec.decode(d) == want
    assert enc.sent == {} and dec.outs == {}  # finished requests leave no state behind


def test_only_new_tokens_travel():
    texts = [["a", "ab", "abc"]]
    enc = DeltaEncoder()
    ds = [enc.encode(o) for o in _cumulative("r", texts, finished_at=9, with_logprobs=True)]
    assert [d.samples[0].new_token_ids for d in ds] == [(0,), (1,), (2,)]
    assert [d.samples[0].text_add for d in ds] == ["a", "b", "c"]
    assert ds[0].prompt_token_ids == (1, 2, 3) and ds[1].prompt_token_ids is None


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as f:
            out += [int(x) for x in f.read().split()]
    return out


def _core_pid(server_pid: int) -> int:
    """The engine core: the child multiprocessing spawned (not its resource tracker)."""
    cores = []
    for k in _children(server_pid):
        with open(f"/proc/{k}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                cores.append(k)
    assert len(cores) == 1, cores
    return cores[0]


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


@pytest.fixture()
def own_server(tiny_model):
    """A server of this test's own (these tests kill or stop it)."""
    with launch(real_argv("--model", tiny_model, "--api-key", API_KEY, "--max-model-len", "1024",
                          "--graceful-timeout", "2", "--served-model-name", "smollm2")) as s:
        yield s


def test_engine_runs_in_a_child_and_none_outlives_the_server(own_server):
    kids = _children(own_server.proc.pid)
    core = _core_pid(own_server.proc.pid)
    assert core in kids  # the engine core is a child process of the server
    r = httpx.post(own_server.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "Hi", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    # a structured request starts the core's grammar compile workers: they must not outlive it either
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    r = httpx.post(own_server.url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "Hi", "max_tokens": 8, "temperature": 0,
                         "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    assert r.status_code == 200
    # the step loop's host time reaches /metrics by part, the core's pipe traffic included
    deadline, seen = time.time() + 10, {}
    while time.time() < deadline and not (seen.get("schedule", 0) > 0 and seen.get("ipc_out", 0) > 0):
        time.sleep(0.2)
        text = httpx.get(own_server.url + "/metrics", headers=AUTH, timeout=10).text
        seen = {m.group(1): float(m.group(2)) for m in re.finditer(
            r'^detent:engine_host_seconds_total\{[^}]*part="(\w+)"[^}]*\} (\S+)$', text, re.M)}
    assert seen.get("schedule", 0) > 0 and seen.get("outputs", 0) > 0 and seen.get("ipc_out", 0) > 0, seen
    kids += _children(core)
    t0 = time.time()
    assert own_server.stop() == 0
    assert time.time() - t0 < 15, "the server (its engine core) took too long to stop"
    deadline = time.time() + 10
    while time.time() < deadline and any(_alive(k) for k in kids):
        time.sleep(0.1)
    assert not any(_alive(k) for k in kids), "the engine core outlived the server"


def test_a_dead_core_is_reported_short_and_requests_get_503(own_server):
    os.kill(_core_pid(own_server.proc.pid), signal.SIGKILL)
    deadline = time.time() + 10
    while time.time() < deadline and httpx.get(own_server.url + "/health").status_code == 200:
        time.sleep(0.1)
    h = httpx.get(own_server.url + "/health")
    assert h.status_code == 503
    reason = h.json()["reason"]
    assert "exited" in reason and "\n" not in reason and len(reason) < 300
    r = httpx.post(own_server.url + "/v1/completions", headers=AUTH, timeout=30,
                   json={"prompt": "Hi", "max_tokens": 3})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"


def test_sigterm_ends_open_streams_with_done(own_server):
    """A stream longer than --graceful-timeout (2 s) ends with an error event and [DONE]
    when the server is stopped, and the server exits 0."""
    events: list[str] = []
    started = threading.Event()

    def stream():
        body = {"prompt": "Count:", "max_tokens": 1000, "temperature": 0, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", own_server.url + "/v1/completions", headers=AUTH, json=body, timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60)
    t0 = time.time()
    assert own_server.stop() == 0
    t.join(30)
    assert time.time() - t0 < 10
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    if "error" in last:  # cut by the drain: said so in-band
        assert last["error"]["code"] == "shutting_down"
    else:  # it finished within the grace period
        assert last["choices"][0]["finish_reason"] is not None
