"""`detent-serve --request-log`, `detent verify LOG` and `POST /v1/verify`
against real servers on the tiny Llama (tests/server/server_helpers.py).

A concurrent load with varied parameters (greedy, seeded and unseeded
sampling, n=2, logprobs, prompt logprobs, chat, streaming, token-id prompts)
is logged; the log then re-executes bit for bit offline and on the server,
a tampered log reports its first differing token, another tuple or model is
refused naming the difference, and a log written under `--selection stock`
is found to differ when re-executed (so verify can fail)."""
from __future__ import annotations

import asyncio
import copy
import json
import math
import os
import time

import httpx
import pytest

from server_helpers import API_KEY, launch, make_tiny_model, real_argv
from detent.cli import main

HEADERS = {"Authorization": f"Bearer {API_KEY}"}
SERVE = ("--max-model-len", "1024", "--max-num-seqs", "32")


def _bodies() -> list[tuple[str, dict]]:
    c, ch = "/v1/completions", "/v1/chat/completions"
    return [
        (c, {"prompt": "The log records", "max_tokens": 12, "temperature": 0, "logprobs": 5, "ignore_eos": True}),
        (c, {"prompt": "Seeded sampling", "max_tokens": 10, "temperature": 0.9, "top_p": 0.9, "seed": 7,
             "logprobs": 3, "ignore_eos": True}),
        (c, {"prompt": "No seed given", "max_tokens": 10, "temperature": 1.0, "top_k": 50, "logprobs": 2,
             "ignore_eos": True}),
        (c, {"prompt": [5, 6, 7, 8, 9, 10, 11], "max_tokens": 8, "temperature": 1.0, "n": 2, "logprobs": 1,
             "ignore_eos": True}),
        (c, {"prompt": ["two prompts", "in one body"], "max_tokens": 6, "temperature": 0.7, "seed": 3,
             "logprobs": 2, "prompt_logprobs": 1, "ignore_eos": True}),
        (c, {"prompt": "Penalties and bias", "max_tokens": 9, "temperature": 0.8, "seed": 11,
             "repetition_penalty": 1.3, "frequency_penalty": 0.5, "logit_bias": {"42": 5.0}, "logprobs": 4,
             "ignore_eos": True}),
        (c, {"prompt": "A longer prompt " * 12, "max_tokens": 14, "temperature": 0, "logprobs": 2,
             "ignore_eos": True}),
        (c, {"prompt": "Streamed", "max_tokens": 8, "temperature": 1.0, "seed": 5, "logprobs": 1, "stream": True,
             "ignore_eos": True}),
        (ch, {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8, "temperature": 1.0,
              "logprobs": True, "top_logprobs": 3, "ignore_eos": True}),
        (ch, {"messages": [{"role": "user", "content": "Greedy chat."}], "max_tokens": 6, "temperature": 0,
              "ignore_eos": True}),
    ]


async def _send_all(url: str) -> list[dict]:
    async with httpx.AsyncClient(timeout=300, headers=HEADERS) as client:
        async def one(path, body):
            r = await client.post(url + path, json={"model": "smollm2", **body})
            assert r.status_code == 200, r.text
            if body.get("stream"):
                return {"stream": r.text}
            return r.json()
        return await asyncio.gather(*(one(p, b) for p, b in _bodies()))


def _records(path: str, expected: int, timeout: float = 30) -> list[dict]:
    """The log's lines once `expected` request records are there (the writer runs behind the responses)."""
    deadline = time.time() + timeout
    while True:
        with open(path) as f:
            lines = [json.loads(x) for x in f if x.strip()]
        if sum(x["type"] == "request" for x in lines) >= expected or time.time() > deadline:
            return lines
        time.sleep(0.2)


ENGINE_REQUESTS = 11  # 10 bodies, one of them with two prompts


@pytest.fixture(scope="module")
def logged(tmp_path_factory, tiny_model):
    """A server writing --request-log, after one concurrent load: (server, log path, responses)."""
    log = str(tmp_path_factory.mktemp("reqlog") / "requests.jsonl")
    with launch(real_argv("--model", tiny_model, "--api-key", API_KEY, *SERVE, "--served-model-name", "smollm2",
                          "--request-log", log, "--max-verify-records", "4")) as s:
        responses = asyncio.run(_send_all(s.url))
        _records(log, ENGINE_REQUESTS)
        yield s, log, responses


def test_one_record_per_engine_request_with_the_seeds_responses_report(logged):
    _, log, responses = logged
    lines = _records(log, ENGINE_REQUESTS)
    assert lines[0]["type"] == "server" and lines[0]["tuple"]["families"]
    reqs = [x for x in lines if x["type"] == "request"]
    assert len(reqs) == ENGINE_REQUESTS
    assert len({r["request_id"] for r in reqs}) == ENGINE_REQUESTS
    by_id = {r["request_id"]: r for r in reqs}
    for resp in responses:
        if "stream" in resp:
            continue
        mine = sorted((r for rid, r in by_id.items() if rid.rsplit("-", 1)[0] == resp["id"]),
                      key=lambda r: r["request_id"])
        assert [o["seed"] for r in mine for o in r["outputs"]] == resp["detent"]["seeds"]
        assert all(r["tuple_hash"] == resp["detent"]["tuple_hash"] for r in mine)
        texts = [o["text"] for r in mine for o in r["outputs"]]
        got = [c.get("text", (c.get("message") or {}).get("content")) for c in resp["choices"]]
        assert texts == got
    unseeded = next(r for r in reqs if r["prompt"] == "No seed given")
    assert unseeded["seed_given"] is False and isinstance(unseeded["params"]["seed"], int)
    assert all(r["time_arrival"] <= r["time_finished"] for r in reqs)


def test_verify_offline_passes_on_the_servers_own_log(logged, tiny_model, tmp_path, capsys):
    _, log, _ = logged
    out = tmp_path / "report.json"
    rc = main(["verify", log, "--model", tiny_model, "--json", str(out)])
    rep = json.loads(out.read_text())
    assert rc == 0, capsys.readouterr().out
    assert rep["counts"]["equal"] == ENGINE_REQUESTS and rep["equal"]


def test_verify_offline_takes_the_deployments_tokenizer(logged, tiny_model, tmp_path, capsys):
    """`detent verify LOG --model M --tokenizer T`, for a deployment served with `--tokenizer`: here a
    copy of the model without its tokenizer files. Without the flag the engine has no tokenizer, so the
    tokens match and the text does not; with it every record is equal. With --url the server
    re-executes under its own, so the flag is refused there."""
    import shutil
    _, log, _ = logged
    bare = tmp_path / "bare"
    shutil.copytree(tiny_model, bare, ignore=shutil.ignore_patterns("tokenizer*", "chat_template*"))
    assert main(["verify", log, "--model", str(bare)]) == 1
    assert "text differ" in capsys.readouterr().out
    assert main(["verify", log, "--model", str(bare), "--tokenizer", tiny_model]) == 0, capsys.readouterr().out
    assert main(["verify", log, "--url", "http://127.0.0.1:9", "--tokenizer", tiny_model]) == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_a_line_that_is_not_utf8_fails_alone_and_a_log_with_no_record_builds_no_engine(logged, tmp_path,
                                                                                      monkeypatch, capsys):
    """A log line of bytes that are not UTF-8 stopped `detent verify` with Python's codec error and
    no report (exit 2 through the CLI's last resort); it is that line's error now, the others
    re-executed, and a last line cut inside a character is an unfinished line, as one cut inside
    its JSON. A log where no line is a request record is refused before any engine is built."""
    from detent.engine import Finding
    from detent.verify_log import read_log
    _, log, _ = logged
    good = open(log, "rb").read().split(b"\n")
    path = tmp_path / "bytes.jsonl"
    path.write_bytes(b"\n".join(good[:2] + [b'{"x": "\xff\xfe"}'] + good[2:-1]) + b"\n" + b'{"text": "\xc3')
    records, _, notes = read_log(str(path))
    bad = [r for r in records if isinstance(r, Finding)]
    assert [(f.request_id, f.reason) for f in bad] == [("line 3", "line 3 is not UTF-8 text (byte 8)")], bad
    assert len(records) == ENGINE_REQUESTS + 1 and notes == [
        f"line {len(good) + 1}: an unfinished last line (the server stopped while writing it), left out"], notes

    import detent.engine
    monkeypatch.setattr(detent.engine, "LLM", lambda *a, **k: pytest.fail("an engine was built"))
    junk = tmp_path / "junk.jsonl"
    junk.write_bytes(b"\xff\n[1]\n")
    assert main(["verify", str(junk)]) == 2
    out = capsys.readouterr()
    assert "line 1 is not UTF-8 text (byte 1)" in out.out and "holds no request record" in out.err, out


def _tampered(log: str, tmp_path) -> tuple[str, str]:
    lines = _records(log, ENGINE_REQUESTS)
    rec = next(x for x in lines if x["type"] == "request" and x["prompt"] == "Seeded sampling")
    lp = rec["outputs"][0]["logprobs"][6][0]
    lp[1] = math.nextafter(lp[1], -math.inf)  # one ulp
    path = tmp_path / "tampered.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return str(path), rec["request_id"]


def test_verify_offline_reports_the_first_differing_token_of_a_tampered_log(logged, tiny_model, tmp_path, capsys):
    _, log, _ = logged
    path, rid = _tampered(log, tmp_path)
    out = tmp_path / "report.json"
    assert main(["verify", path, "--model", tiny_model, "--json", str(out)]) == 1
    rep = json.loads(out.read_text())
    assert rep["counts"] == {"equal": ENGINE_REQUESTS - 1, "different": 1, "refused": 0, "skipped": 0, "error": 0}
    (bad,) = [r for r in rep["records"] if r["status"] == "different"]
    assert bad["request_id"] == rid and bad["differences"][0]["token_index"] == 6
    assert "sample 0, token 6: recorded" in capsys.readouterr().out


def test_verify_offline_refuses_another_tuple_naming_the_pin(logged, tiny_model, tmp_path, capsys):
    _, log, _ = logged
    server = _records(log, ENGINE_REQUESTS)[0]
    other = copy.deepcopy(server["tuple"])
    other["families"]["attention"]["pins"]["split_tokens"] = 128
    t = tmp_path / "t.json"
    t.write_text(json.dumps(other))
    assert main(["verify", log, "--model", tiny_model, "--tuple", str(t)]) == 3
    out = capsys.readouterr().out
    assert "tuple_hash differs" in out
    assert "tuple attention.pins.split_tokens differs: 256 in the request's tuple, 128 here" in out


def test_verify_offline_refuses_another_model_naming_the_fact(logged, tmp_path, capsys):
    _, log, _ = logged
    other = make_tiny_model(str(tmp_path / "wider"), hidden=96)
    assert main(["verify", log, "--model", other]) == 3
    assert "deployment fact 'hidden' differs: the request ran with 64, this deployment has 96" in \
        capsys.readouterr().out


def test_verify_offline_refuses_an_edited_tuple_hash(logged, tiny_model, tmp_path, capsys):
    _, log, _ = logged
    lines = _records(log, ENGINE_REQUESTS)
    lines[1]["tuple_hash"] = "0" * 64
    path = tmp_path / "edited.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines[:2]))
    assert main(["verify", str(path), "--model", tiny_model]) == 3
    assert "tuple_hash differs" in capsys.readouterr().out


def test_verify_a_log_through_the_servers_endpoint(logged, tmp_path, capsys):
    s, log, _ = logged
    base = ["--url", s.url, "--api-key", API_KEY, "--batch", "4"]  # the fixture allows 4 records per call
    assert main(["verify", log, *base]) == 0
    assert f"{ENGINE_REQUESTS} equal, 0 different" in capsys.readouterr().out
    path, rid = _tampered(log, tmp_path)
    out = tmp_path / "report.json"
    assert main(["verify", path, *base, "--json", str(out)]) == 1
    rep = json.loads(out.read_text())
    assert [r["request_id"] for r in rep["records"] if r["status"] == "different"] == [rid]
    assert main(["verify", log, *base, "--model", "x"]) == 2


def _post(server, body) -> httpx.Response:
    return httpx.post(server.url + "/v1/verify", json=body, headers=HEADERS, timeout=300)


def test_post_verify_passes_and_fails_like_the_cli(logged, tmp_path):
    s, log, _ = logged
    lines = _records(log, ENGINE_REQUESTS)
    reqs = [x for x in lines if x["type"] == "request"]
    r = _post(s, reqs[0])
    assert r.status_code == 200, r.text
    assert r.json()["equal"] and r.json()["counts"]["equal"] == 1
    path, rid = _tampered(log, tmp_path)
    tampered = [json.loads(x) for x in open(path)]
    body = [tampered[0]] + [x for x in tampered if x.get("request_id") == rid] + reqs[1:3]
    rep = _post(s, body).json()
    assert not rep["equal"] and rep["counts"]["different"] == 1 and rep["counts"]["equal"] == 2
    assert next(x for x in rep["records"] if x["request_id"] == rid)["differences"][0]["token_index"] == 6
    edited = copy.deepcopy(reqs[0])
    edited["tuple_hash"] = "0" * 64
    rep = _post(s, edited).json()
    assert rep["counts"]["refused"] == 1 and "tuple_hash differs" in rep["records"][0]["reason"]


@pytest.mark.parametrize("edit, param", [
    (lambda r: r.pop("prompt_token_ids"), "prompt_token_ids"),
    (lambda r: r["params"].update(temperature="hot"), "params"),
    (lambda r: r["outputs"][0].update(logprobs=[[["x"]]]), "outputs[0].logprobs[0]"),
    (lambda r: r.update(prompt_token_ids=[10 ** 9]), "prompt_token_ids"),
    (lambda r: r["params"].update(max_tokens=5000), "params.max_tokens"),
    (lambda r: (r["params"].update(n=200), r.update(outputs=r["outputs"] * 200)), "params.n"),
    (lambda r: r["params"].update(n=2), "outputs"),
])
def test_post_verify_malformed_record_is_a_400(logged, edit, param):
    s, log, _ = logged
    rec = copy.deepcopy(next(x for x in _records(log, ENGINE_REQUESTS) if x["type"] == "request"))
    rec["request_id"] = "x"
    edit(rec)
    r = _post(s, rec)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


@pytest.mark.parametrize("families, param", [
    ([1], "[0].tuple.families"),
    ({"gemm": [1]}, "[0].tuple.families.gemm"),
    ({"gemm": {"pins": [1]}}, "[0].tuple.families.gemm.pins"),
    ({"gemm": {"sites": {"k=1": 5}}}, "[0].tuple.families.gemm.sites.k=1"),
])
def test_post_verify_malformed_server_record_is_a_400(logged, families, param):
    """The fuzz found a server record whose tuple is not shaped like one a 500 (read to name
    the pins that differ from it, for a record of another tuple)."""
    s, log, _ = logged
    rec = copy.deepcopy(next(x for x in _records(log, ENGINE_REQUESTS) if x["type"] == "request"))
    rec["tuple_hash"] = "0" * 64
    r = _post(s, [{"type": "server", "tuple_hash": "0" * 64, "tuple": {"families": families}}, rec])
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and "server record" in r.json()["error"]["message"], r.json()


def test_post_verify_bounds_and_bodies(logged):
    s, log, _ = logged
    reqs = [x for x in _records(log, ENGINE_REQUESTS) if x["type"] == "request"]
    r = _post(s, reqs[:5])
    assert r.status_code == 400 and "--max-verify-records" in r.json()["error"]["message"]
    assert _post(s, []).status_code == 400
    assert _post(s, "a string").status_code == 400
    r = httpx.post(s.url + "/v1/verify", json=reqs[0], timeout=30)  # no API key
    assert r.status_code == 401


def test_post_verify_does_not_change_other_requests(logged):
    """A verification runs beside a seeded request: that request's bits are its solo run's."""
    s, log, _ = logged
    body = {"model": "smollm2", "prompt": "Beside a verify", "max_tokens": 12, "temperature": 1.0, "seed": 99,
            "logprobs": 3, "ignore_eos": True}
    solo = httpx.post(s.url + "/v1/completions", json=body, headers=HEADERS, timeout=300).json()["choices"]
    reqs = [x for x in _records(log, ENGINE_REQUESTS) if x["type"] == "request"][:4]

    async def both():
        async with httpx.AsyncClient(timeout=300, headers=HEADERS) as c:
            return await asyncio.gather(c.post(s.url + "/v1/verify", json=reqs),
                                        c.post(s.url + "/v1/completions", json=body))
    v, again = asyncio.run(both())
    assert v.status_code == 200 and v.json()["equal"], v.text
    assert again.json()["choices"] == solo


def test_the_in_process_engine_logs_the_same_way(tiny_model, tmp_path):
    """--no-engine-process: the outputs the log builds records from come from a thread of the server."""
    log = str(tmp_path / "inproc.jsonl")
    bodies = [{"prompt": "in process", "max_tokens": 8, "temperature": 0, "logprobs": 2},
              {"prompt": [9, 8, 7, 6], "max_tokens": 8, "temperature": 1.0, "n": 2, "logprobs": 3}]

    async def send(url):
        async with httpx.AsyncClient(timeout=300) as c:
            return await asyncio.gather(*(c.post(url + "/v1/completions", json=b) for b in bodies))
    with launch(real_argv("--model", tiny_model, *SERVE, "--no-engine-process", "--request-log", log)) as s:
        assert all(r.status_code == 200 for r in asyncio.run(send(s.url)))
        _records(log, 2)
    assert main(["verify", log, "--model", tiny_model]) == 0


def test_a_failing_disk_fails_no_request(tiny_model):
    """/dev/full accepts the open and fails every write: requests still succeed, the server logs why."""
    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full here")
    with launch(real_argv("--model", tiny_model, *SERVE, "--request-log", "/dev/full")) as s:
        for _ in range(3):
            r = httpx.post(s.url + "/v1/completions", json={"prompt": "disk full", "max_tokens": 4}, timeout=120)
            assert r.status_code == 200, r.text
        deadline = time.time() + 10
        while "write failed" not in s.output() and time.time() < deadline:
            time.sleep(0.2)
        assert "request log /dev/full: write failed" in s.output()
        assert httpx.get(s.url + "/health", timeout=10).status_code == 200


def test_an_unwritable_request_log_refuses_startup(tiny_model, tmp_path):
    import subprocess
    p = subprocess.run(real_argv("--model", tiny_model, "--request-log", str(tmp_path / "no" / "such" / "dir.log")),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--request-log" in p.stderr and "cannot be opened" in p.stderr


@pytest.mark.slow
def test_a_stock_log_differs_when_re_executed(tiny_model, tmp_path):
    """Under --selection stock the server's co-batched bits are not the bits each
    request gets alone: verify (stock against stock, same hashes) reports differences."""
    log = str(tmp_path / "stock.jsonl")
    with launch(real_argv("--model", tiny_model, "--api-key", API_KEY, *SERVE, "--served-model-name", "smollm2",
                          "--selection", "stock", "--request-log", log)) as s:
        asyncio.run(_send_all(s.url))
        _records(log, ENGINE_REQUESTS)
    out = tmp_path / "report.json"
    assert main(["verify", log, "--model", tiny_model, "--batch", "1", "--json", str(out)]) == 1
    rep = json.loads(out.read_text())
    assert rep["selection"] == "stock" and rep["counts"]["different"] >= 1, rep["counts"]
