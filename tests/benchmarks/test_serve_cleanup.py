"""benchmarks/serve.py never leaves a server, its engine core or the --tiny model's temp folder behind,
even when the benchmark fails after the server started (CPU, a tiny random Llama)."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "benchmarks")
sys.path.insert(0, BENCH)


def test_a_failure_after_the_server_started_leaves_nothing_behind(monkeypatch, tmp_path):
    import serve

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where --tiny's TemporaryDirectory goes
    tiny_dirs = lambda: [n for n in os.listdir(tmp_path) if n.startswith("detent-tiny-")]  # noqa: E731
    started = []
    real_popen = subprocess.Popen

    def popen(*args, **kw):
        started.append(real_popen(*args, **kw))
        return started[-1]

    children = []

    async def fails_mid_run(url, c, ps, max_tokens):
        assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}  # the server is up
        children.extend(children_of(started[0].pid))
        assert children  # its engine core
        assert tiny_dirs()  # and the model folder exists
        raise RuntimeError("the benchmark failed mid-run")

    monkeypatch.setattr(serve.subprocess, "Popen", popen)
    monkeypatch.setattr(serve, "bench_server", fails_mid_run)
    with pytest.raises(RuntimeError, match="mid-run"):
        serve.main(["--tiny", "--skip-offline", "--concurrency", "1", "--", "--max-model-len", "256"])
    [proc] = started
    assert proc.poll() is not None
    deadline = time.time() + 20
    while True:  # nothing of the server's process group (server, engine core, workers) is left
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            break
        assert time.time() < deadline, "a process of the server's group outlived the benchmark"
        time.sleep(0.2)
    for pid in children:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert tiny_dirs() == []


def children_of(pid: int) -> list[int]:
    """Processes whose parent is `pid` (Linux /proc)."""
    out = []
    for d in os.listdir("/proc"):
        try:
            with open(f"/proc/{d}/stat") as f:
                if d.isdigit() and int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d))
        except (OSError, ValueError, IndexError):
            pass
    return out
