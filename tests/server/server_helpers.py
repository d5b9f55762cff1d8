"""Real server processes on 127.0.0.1, on free ports (the helpers the server tests import;
the fixtures are in conftest.py, whose module name other test folders share).

`launch(args)` starts `python plain_install.py ARGS` (what `detent-serve`
runs, unable to import anything but the runtime dependencies), waits for /health and stops it with SIGTERM at the end, checking
that it exits cleanly. Most tests use a tiny random Llama with the
embedded model's tokenizer (the real engine, fast steps); one test serves
the embedded SmolLM2 itself.
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
API_KEY = "sk-detent-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
STARTUP_TIMEOUT_S = float(os.environ.get("DETENT_TEST_SERVER_STARTUP_S", "300"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, argv: list[str], env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="detent-serve-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv + ["--port", str(self.port)], stdout=self.log, stderr=subprocess.STDOUT,
                                     env={**os.environ, "DETENT_TEST_THREADS": "2", **(env or {})})

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name) as f:
            return f.read()

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> "Server":
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()[-4000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.proc.kill()
        raise RuntimeError(f"server not ready after {timeout}s:\n{self.output()[-4000:]}")

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(f"server ignored SIGTERM for {timeout}s:\n{self.output()[-3000:]}")
        return self.proc.returncode

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in httpx.get(self.url + "/metrics", timeout=10).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out

    def metric(self, prefix: str) -> float:
        return sum(v for k, v in self.metrics().items() if k.split("{")[0] == prefix)


def real_argv(*args: str) -> list[str]:
    """`detent-serve ARGS`, run as a plain install would run it (plain_install.py:
    nothing outside the runtime dependencies can be imported)."""
    launcher = os.environ.get("DETENT_TEST_SERVE_SCRIPT")  # a dev override
    cmd = [launcher] if launcher else [os.path.join(HERE, "plain_install.py")]
    return [sys.executable, *cmd, "--log-level", "warning", *args]


@contextlib.contextmanager
def launch(argv: list[str], env: dict | None = None):
    s = Server(argv, env).wait_ready()
    try:
        yield s
    finally:
        rc = s.stop()
        assert rc == 0, f"server exited with {rc} after SIGTERM:\n{s.output()[-3000:]}"


# a Qwen3 deployment's chat flags: reasoning split out, tool calls the model writes read out
AGENT_FLAGS = ("--reasoning-parser", "qwen3", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")


def openai_client(server: Server):
    import openai
    return openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def token_ids(server: Server, text: str) -> list[int]:
    """`text`'s token ids, no special tokens added (an output to force with golden_token_ids)."""
    r = httpx.post(server.url + "/v1/tokenize", json={"prompt": text, "add_special_tokens": False},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)
    return r.json()["tokens"]


def make_tiny_model(path: str, hidden: int = 64, layers: int = 2) -> str:
    """A small random Llama with the embedded SmolLM2's tokenizer and chat template
    (`detent.models.tiny`). Real engine, real tokenizer, fast steps: the server's
    behaviour (not the model's knowledge) is what most tests check."""
    from detent.models.tiny import write_tiny_llama
    return write_tiny_llama(path, hidden, layers)


def sse_events(r) -> list[dict]:
    """A 200 stream's JSON events (an httpx or test-client response), checked to end with [DONE]."""
    assert r.status_code == 200, r.text
    data = [line.removeprefix("data: ") for line in r.text.splitlines() if line.startswith("data: ")]
    assert data[-1] == "[DONE]"
    return [json.loads(d) for d in data[:-1]]


def client_error(r) -> dict:
    """A 4xx response's OpenAI-shaped error object (message, type, param, code), checked."""
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err
