"""Issue 20's target for `detent verify` on the GPU (bf16, Triton candidates,
CUDA graphs, async scheduling): 100 requests of a concurrent load against
`detent-serve --request-log` re-execute with 100% equality; the same load
under `--selection stock` does not; an edited tuple hash is refused."""
from __future__ import annotations

import asyncio
import json
import random

import httpx
import pytest

from server_helpers import launch, make_tiny_model, real_argv
from detent.cli import main

pytestmark = pytest.mark.gpu
N = 100
SERVE = ("--device", "cuda", "--dtype", "bfloat16", "--gpu-memory-utilization", "0.5", "--max-model-len", "2048",
         "--max-num-seqs", "64")


def _body(i: int) -> dict:
    r = random.Random(i)
    body = {"prompt": [r.randrange(3, 49152) for _ in range(r.randrange(8, 600))], "max_tokens": r.randrange(8, 48),
            "logprobs": 5, "ignore_eos": True}
    kind = i % 3
    if kind == 0:
        body["temperature"] = 0
    elif kind == 1:
        body.update(temperature=0.8, top_p=0.95, seed=i)
    else:
        body.update(temperature=1.0, top_k=100)  # unseeded: the log keeps the drawn seed
    return body


async def _load(url: str) -> None:
    async with httpx.AsyncClient(timeout=600) as c:
        rs = await asyncio.gather(*(c.post(url + "/v1/completions", json=_body(i)) for i in range(N)))
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs if r.status_code != 200][:2]


def _logged(model: str, log: str, *extra: str) -> None:
    with launch(real_argv("--model", model, *SERVE, "--request-log", log, *extra)) as s:
        asyncio.run(_load(s.url))
    with open(log) as f:
        assert sum(json.loads(x)["type"] == "request" for x in f) == N


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("gpu-llama")), hidden=512, layers=4)


def test_a_hundred_logged_requests_re_execute_bit_for_bit(model, tmp_path):
    log = str(tmp_path / "pinned.jsonl")
    _logged(model, log)
    out = tmp_path / "report.json"
    assert main(["verify", log, "--model", model, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["counts"]["equal"] == N
    lines = open(log).read().splitlines()
    rec = json.loads(lines[1])
    rec["tuple_hash"] = "0" * 64
    edited = tmp_path / "edited.jsonl"
    edited.write_text(lines[0] + "\n" + json.dumps(rec) + "\n")
    assert main(["verify", str(edited), "--model", model]) == 3


def test_a_stock_log_differs(model, tmp_path):
    log = str(tmp_path / "stock.jsonl")
    _logged(model, log, "--selection", "stock")
    out = tmp_path / "report.json"
    assert main(["verify", log, "--model", model, "--batch", "1", "--json", str(out)]) == 1
    assert json.loads(out.read_text())["counts"]["different"] >= 1
