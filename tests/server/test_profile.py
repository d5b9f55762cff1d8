"""`detent-serve --profiler-config`, `POST /start_profile` and `/stop_profile` (server/profile.py,
engine/profiler.py): a window opens after `delay_iterations` engine steps, records
`max_iterations` steps in the engine's process, and writes one Chrome trace; the routes are
behind the API key, a second start while a window is open is a 409, and a server without
the flag answers 404 saying how to turn profiling on."""
from __future__ import annotations

import glob
import gzip
import json
import time

import httpx
import pytest

from server_helpers import API_KEY, launch, real_argv

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def _complete(url: str, n: int) -> None:
    r = httpx.post(url + "/v1/completions", headers=AUTH, timeout=60,
                   json={"prompt": "Hello there", "max_tokens": n, "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text


def test_a_window_records_the_engine_steps_it_was_given_and_writes_one_trace(tiny_model, tmp_path):
    cfg = {"profiler": "torch", "torch_profiler_dir": str(tmp_path / "prof"), "delay_iterations": 2,
           "max_iterations": 3, "ignore_frontend": True}
    with launch(real_argv("--model", tiny_model, "--api-key", API_KEY, "--max-model-len", "256",
                          "--profiler-config", json.dumps(cfg))) as s:
        assert httpx.post(s.url + "/start_profile", timeout=30).status_code == 401  # behind the key
        r = httpx.post(s.url + "/start_profile", headers=AUTH, timeout=30, json={"prompt": "ignored"})
        assert r.status_code == 200 and r.json()["started"], r.text
        r = httpx.post(s.url + "/start_profile", headers=AUTH, timeout=30)
        assert r.status_code == 409 and r.json()["error"]["code"] == "profiler_running"
        _complete(s.url, 12)  # 12 steps: 2 skipped, 3 recorded, then the trace is written
        deadline = time.time() + 30
        while not glob.glob(str(tmp_path / "prof" / "*.json.gz")) and time.time() < deadline:
            time.sleep(0.2)
        r = httpx.post(s.url + "/stop_profile", headers=AUTH, timeout=30)
        assert r.status_code == 200 and r.json()["trace"] is None  # the window had closed by itself
        traces = r.json()["traces"]
        assert len(traces) == 1 and traces == glob.glob(str(tmp_path / "prof" / "*.json.gz"))
        with gzip.open(traces[0], "rt") as f:
            events = json.load(f)["traceEvents"]
        assert any(e.get("cat") == "cpu_op" for e in events)
        steps = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("detent.step.")]
        assert steps and {e["name"] for e in steps} <= {"detent.step.decode", "detent.step.mixed",
                                                         "detent.step.prefill"}
        # a window closed by /stop_profile before its steps ran out
        assert httpx.post(s.url + "/start_profile", headers=AUTH, timeout=30).json()["started"]
        _complete(s.url, 4)  # 4 steps: 2 skipped, 2 recorded
        r = httpx.post(s.url + "/stop_profile", headers=AUTH, timeout=30).json()
        assert r["trace"] and len(r["traces"]) == 2


def test_without_the_flag_the_routes_answer_404_naming_it(server):
    r = httpx.post(server.url + "/start_profile", headers=AUTH, timeout=30)
    assert r.status_code == 404 and "--profiler-config" in r.json()["error"]["message"]
    assert httpx.post(server.url + "/stop_profile", headers=AUTH, timeout=30).status_code == 404


@pytest.mark.parametrize("cfg, says", [
    ("{not json", "not JSON"),
    ('{"profiler": "cuda", "torch_profiler_dir": "/tmp/p"}', "only 'torch'"),
    ('{"profiler": "torch"}', "torch_profiler_dir"),
    ('{"torch_profiler_dir": "/tmp/p", "max_iterations": -1}', "max_iterations"),
    ('{"torch_profiler_dir": "/tmp/p", "delay_iteration": 3}', "unknown key"),
])
def test_a_bad_profiler_config_stops_startup_saying_why(cfg, says, capsys):
    from detent.server.cli import parse_args
    with pytest.raises(SystemExit) as e:
        parse_args(["--profiler-config", cfg])
    assert e.value.code == 2 and says in capsys.readouterr().err
