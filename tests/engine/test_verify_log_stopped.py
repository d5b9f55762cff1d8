"""`detent verify LOG` whose re-execution stops midway (an engine error, Ctrl-C), on the tiny
Llama: the records that finished keep their results, the others are errors saying they were
not re-executed, the engine keeps none of the requests, and the CLI prints that table and
exits non-zero (130 for Ctrl-C, 3 for an engine error) instead of a bare traceback."""
from __future__ import annotations

import json

import pytest

from detent.engine import SamplingParams, parse_record, request_record
from detent.verify_log import NOT_RUN, Interrupted, verify_log
from engine_helpers import bundle, make_llm, prompt

ARGS = dict(max_num_batched_tokens=32, max_model_len=256)


@pytest.fixture(scope="module")
def lines():
    """Four records as the request log writes them: greedy and seeded, with logprobs."""
    llm = make_llm(bundle("llama"), **ARGS)
    prompts = [prompt(200 + i, 5 + 3 * i, 160) for i in range(4)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=4, logprobs=2, ignore_eos=True)
              for i in range(4)]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    fp = llm.llm_engine.fingerprint()
    return [json.dumps(request_record(request_id=f"r{i}", endpoint="/v1/completions", model="tiny", fp=fp,
                                      prompt=None, prompt_token_ids=p, params=sp, output=o, arrival=0.0,
                                      finished=1.0))
            for i, (p, sp, o) in enumerate(zip(prompts, params, outs))]


def _stopping_llm(monkeypatch, exc):
    """A fresh LLM whose engine raises `exc` at the first step after two requests finished
    (with batch 2: the second batch's first step)."""
    llm = make_llm(bundle("llama"), **ARGS)
    eng = llm.llm_engine
    real, finished = eng.step, []

    def step():
        if len(finished) >= 2:
            raise exc
        outs = real()
        finished.extend(o for o in outs if o.finished)
        return outs

    monkeypatch.setattr(eng, "step", step)
    return llm


def _check(findings, reason):
    assert [f.status for f in findings] == ["equal", "equal", "error", "error"], [f.to_json() for f in findings]
    assert all(f.reason == NOT_RUN + reason for f in findings[2:]), findings[2].reason


@pytest.mark.parametrize("exc,reason", [(RuntimeError("device lost"), "the engine stopped: RuntimeError: device lost"),
                                        (KeyboardInterrupt(), "interrupted (Ctrl-C)")], ids=["error", "ctrl-c"])
def test_a_stopped_replay_keeps_what_ran_and_leaves_nothing_in_the_engine(monkeypatch, lines, exc, reason):
    """The replay loop re-raised with the second batch still in the engine (it ran on unseen in the
    next steps) and the first batch's results lost. Now an engine error returns the findings so far,
    Ctrl-C raises Interrupted (a KeyboardInterrupt) carrying them, and the engine is empty and
    verifies the same records equal afterwards."""
    records = [parse_record(json.loads(line)) for line in lines]
    llm = _stopping_llm(monkeypatch, exc)
    if isinstance(exc, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt) as info:
            verify_log(llm, records, {}, batch=2)
        assert isinstance(info.value, Interrupted)
        findings = info.value.findings
    else:
        findings = verify_log(llm, records, {}, batch=2)
    _check(findings, reason)
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests() and not eng.scheduler.requests
    monkeypatch.undo()
    assert [f.status for f in verify_log(llm, records, {}, batch=2)] == ["equal"] * 4


@pytest.mark.parametrize("exc,rc,said", [
    (RuntimeError("device lost"), 3, "error: 2 of 4 records not re-executed: the engine stopped: RuntimeError: "
     "device lost"),
    (KeyboardInterrupt(), 130, "verify: 2 of 4 records not re-executed: interrupted (Ctrl-C)"),
], ids=["error", "ctrl-c"])
def test_the_cli_reports_a_stopped_replay(monkeypatch, lines, tmp_path, capsys, exc, rc, said):
    """`detent verify LOG` let Ctrl-C out as a traceback with nothing of what it had verified, and
    an engine error the same. It prints the table so far and the summary, says how many records
    were not re-executed and why, writes a report whose `equal` is false, and exits 130 / 3."""
    from detent.cli import main
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(line + "\n" for line in lines))
    llm = _stopping_llm(monkeypatch, exc)
    monkeypatch.setattr("detent.engine.LLM", lambda **kw: llm)
    out = tmp_path / "report.json"
    try:
        got = main(["verify", str(log), "--batch", "2", "--json", str(out)])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left `detent verify` as a KeyboardInterrupt")
    std = capsys.readouterr()
    assert got == rc, std
    rows = std.out.splitlines()
    assert [r.split()[1] for r in rows[1:5]] == ["equal", "equal", "error", "error"], std.out
    assert rows[5] == "2 equal, 0 different, 0 refused, 0 skipped, 2 failed, of 4 records", std.out
    assert said in std.err, std.err
    rep = json.loads(out.read_text())
    assert rep["equal"] is False and rep["counts"]["error"] == 2 and rep["counts"]["equal"] == 2


def test_ctrl_c_during_verify_url_reports_the_batches_answered(monkeypatch, lines, tmp_path, capsys):
    """`detent verify LOG --url` let Ctrl-C out as a traceback, the batches the server had answered
    unsaid. It reports them, the records not sent as not re-executed, and exits 130."""
    import httpx

    from detent.cli import main
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(line + "\n" for line in lines))
    calls = []

    def post(url, json, headers, timeout):
        calls.append([r["request_id"] for r in json if r.get("type") == "request"])
        if len(calls) > 1:
            raise KeyboardInterrupt
        return httpx.Response(200, json={"tuple_hash": "t", "deployment_hash": "d", "selection": "pinned",
                                         "records": [{"request_id": i, "status": "equal"} for i in calls[0]]})

    monkeypatch.setattr(httpx, "post", post)
    try:
        got = main(["verify", str(log), "--url", "http://127.0.0.1:9", "--batch", "2"])
    except KeyboardInterrupt:
        pytest.fail("Ctrl-C left `detent verify --url` as a KeyboardInterrupt")
    std = capsys.readouterr()
    assert got == 130 and calls == [["r0", "r1"], ["r2", "r3"]], std
    rows = [r.split()[:2] for r in std.out.splitlines()[1:5]]
    assert rows == [["r0", "equal"], ["r1", "equal"], ["r2", "error"], ["r3", "error"]], std.out
    assert "verify: 2 of 4 records not re-executed: interrupted (Ctrl-C)" in std.err, std.err


@pytest.mark.parametrize("how", ["drops", "stops", "refuses"])
def test_verify_url_reports_the_batches_answered_when_the_server_goes_away(lines, tmp_path, capsys, how):
    """`detent verify LOG --url` whose server answered the first batch and then went away (closed
    the connection of the second call unanswered, or stopped listening) said only "no detent-serve
    answers" and exited 2, the answered batch unsaid; one that refused the second call (a 503,
    overloaded) exited 2 too. It reports that batch, the other records as not re-executed with
    the connection error or the refusal, and exits 3; a server gone before its first answer is
    still exit 2."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from detent.cli import main
    log = tmp_path / "requests.jsonl"
    log.write_text("".join(line + "\n" for line in lines))
    calls = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            calls.append([r["request_id"] for r in body if r.get("type") == "request"])
            if len(calls) > 1 and how == "refuses":
                data = b'{"error": {"message": "the server is overloaded"}}'
                self.send_response(503)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                return
            if len(calls) > 1:  # gone: the connection closes with no answer
                return
            if how == "stops":  # stops listening before it answers: the next call is refused
                self.server.socket.close()
            data = json.dumps({"equal": True, "tuple_hash": "t", "deployment_hash": "d", "selection": "pinned",
                               "records": [{"request_id": i, "status": "equal"} for i in calls[0]]}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    url = f"http://127.0.0.1:{server.server_address[1]}"

    def serve():
        for _ in range(1 if how == "stops" else 2):
            server.handle_request()
        server.server_close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    out = tmp_path / "report.json"
    got = main(["verify", str(log), "--url", url, "--batch", "2", "--json", str(out)])
    thread.join(10)
    std = capsys.readouterr()
    assert got == 3, std
    assert calls == ([["r0", "r1"]] if how == "stops" else [["r0", "r1"], ["r2", "r3"]]), calls
    rows = [r.split()[:2] for r in std.out.splitlines()[1:5]]
    assert rows == [["r0", "equal"], ["r1", "equal"], ["r2", "error"], ["r3", "error"]], std.out
    assert std.out.splitlines()[5] == "2 equal, 0 different, 0 refused, 0 skipped, 2 failed, of 4 records", std.out
    error = {"drops": "the connection to the server failed: RemoteProtocolError: Server disconnected",
             "stops": "the connection to the server failed: ConnectError: ",
             "refuses": "the server refused records 2..3 (503): {\"error\": {\"message\": \"the server is "
                        "overloaded\"}}"}[how]
    assert "error: 2 of 4 records not re-executed: " + error in std.err, std.err
    rep = json.loads(out.read_text())
    assert rep["equal"] is False and rep["counts"] == {"equal": 2, "different": 0, "refused": 0, "skipped": 0,
                                                       "error": 2}
    assert all(r["reason"].startswith(NOT_RUN + error) for r in rep["records"][2:]), rep["records"]
    # no answer at all: nothing was verified, a usage error as before
    assert main(["verify", str(log), "--url", url, "--batch", "2"]) == 2
    assert f"error: no detent-serve answers at {url}: " in capsys.readouterr().err
