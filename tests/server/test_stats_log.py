"""The periodic stats line (vLLM's), timestamps on log lines, and --disable-log-stats."""
from __future__ import annotations

import re
import time

import httpx

from server_helpers import API_KEY, launch, real_argv

AUTH = {"Authorization": f"Bearer {API_KEY}"}
STAMP = re.compile(r"^\d\d-\d\d \d\d:\d\d:\d\d (INFO|WARNING|ERROR)", re.M)


def _serve_and_wait(tiny_model, *flags):
    argv = real_argv("--model", tiny_model, "--api-key", API_KEY, "--max-model-len", "512", *flags)
    argv[argv.index("--log-level") + 1] = "info"
    with launch(argv, env={"DETENT_LOG_STATS_INTERVAL": "0.5"}) as s:
        r = httpx.post(s.url + "/v1/completions", headers=AUTH, timeout=60,
                       json={"prompt": "Hello there", "max_tokens": 6, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200
        time.sleep(1.5)
        return s.output()


def test_stats_line_with_timestamps_and_its_off_switch(tiny_model):
    out = _serve_and_wait(tiny_model)
    lines = [ln for ln in out.splitlines() if "Avg generation throughput" in ln]
    assert lines, out[-2000:]
    m = re.search(r"Avg prompt throughput: ([\d.]+) tokens/s, Avg generation throughput: ([\d.]+) tokens/s, "
                  r"Running: \d+ reqs, Waiting: \d+ reqs, KV cache usage: [\d.]+%, Prefix cache hit rate: [\d.]+%",
                  "\n".join(lines))
    assert m and (float(m.group(1)) > 0 or float(m.group(2)) > 0)
    assert STAMP.search(out), "log lines carry a timestamp"
    assert "Avg generation throughput" not in _serve_and_wait(tiny_model, "--disable-log-stats")
