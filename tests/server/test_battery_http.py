"""`detent battery --url` and `detent verify` against a live `detent-serve`
on the tiny Llama (tests/server/server_helpers.py)."""
from __future__ import annotations

import json

import httpx
import pytest

from server_helpers import API_KEY, launch, real_argv
from detent.battery import HTTPBackend, run_battery
from detent.battery_cells import select
from detent.cli import main

HTTP_CELLS = "cobatch_7_mixed,row_0,split_cache_24"


def test_battery_over_http_passes_pinned(server, tmp_path):
    out = tmp_path / "b.json"
    # three cells, not `quick`: each HTTP request costs a CPU server more than an in-process call
    rc = main(["battery", "--url", server.url, "--api-key", API_KEY, "--cells", HTTP_CELLS, "--json", str(out)])
    rep = json.loads(out.read_text())
    assert rc == 0, [c for c in rep["cells"] if not c["passed"]]
    assert rep["passed"] == rep["total"] == 3
    assert rep["tuple_hash"] and rep["deployment_hash"]


@pytest.mark.slow
def test_battery_over_http_fails_under_stock(tiny_model):
    with launch(real_argv("--model", tiny_model, "--max-model-len", "1024", "--selection", "stock")) as s:
        results = run_battery(HTTPBackend(s.url), select(HTTP_CELLS))
    assert any(not r.passed for r in results), "stock passed every cell over HTTP: the battery cannot fail"


def _ask(server, body: dict) -> dict:
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    return r.json()


def _verify(server, tmp_path, request: dict, response: dict) -> int:
    (tmp_path / "req.json").write_text(json.dumps(request))
    (tmp_path / "resp.json").write_text(json.dumps(response))
    return main(["verify", "--url", server.url, "--api-key", API_KEY, "--request", str(tmp_path / "req.json"),
                 "--response", str(tmp_path / "resp.json")])


REQUEST = {"model": "smollm2", "prompt": "The battery checks", "max_tokens": 12, "temperature": 1.0,
           "logprobs": 3, "ignore_eos": True}  # no seed: the response's detent.seeds supplies it


def test_verify_passes_on_a_real_response(server, tmp_path, capsys):
    response = _ask(server, REQUEST)
    assert _verify(server, tmp_path, REQUEST, response) == 0
    assert "equal" in capsys.readouterr().out


def test_verify_fails_on_a_tampered_response(server, tmp_path, capsys):
    response = _ask(server, REQUEST)
    lp = response["choices"][0]["logprobs"]["token_logprobs"]
    lp[5] = lp[5] + 2 ** -20
    assert _verify(server, tmp_path, REQUEST, response) == 1
    assert "first difference at token 5" in capsys.readouterr().out


def test_verify_refuses_another_tuple(server, tmp_path, capsys):
    response = _ask(server, REQUEST)
    response["detent"]["tuple_hash"] = "0" * 64
    assert _verify(server, tmp_path, REQUEST, response) == 3
    assert "tuple_hash differs" in capsys.readouterr().err


def test_verify_a_chat_response(server, tmp_path, capsys):
    request = {"model": "smollm2", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 8,
               "temperature": 1.0, "logprobs": True, "top_logprobs": 2, "ignore_eos": True}
    r = httpx.post(server.url + "/v1/chat/completions", json=request, timeout=120,
                   headers={"Authorization": f"Bearer {API_KEY}"})
    assert r.status_code == 200, r.text
    response = r.json()
    assert _verify(server, tmp_path, request, response) == 0
    response["choices"][0]["logprobs"]["content"][3]["top_logprobs"][1]["logprob"] += 1.0
    assert _verify(server, tmp_path, request, response) == 1
    assert "first difference at token 3" in capsys.readouterr().out


def test_verify_a_responses_answer_and_a_tool_call(server, tmp_path, capsys):
    """/v1/responses bodies, and a chat tool call: the ids drawn at random (`id`, `call_id`)
    are not compared, every token and logprob is."""
    auth = {"Authorization": f"Bearer {API_KEY}"}
    request = {"model": "smollm2", "input": "Say something.", "max_output_tokens": 8, "temperature": 1.0,
               "include": ["message.output_text.logprobs"], "top_logprobs": 2, "ignore_eos": True}
    response = httpx.post(server.url + "/v1/responses", json=request, timeout=120, headers=auth).json()
    assert _verify(server, tmp_path, request, response) == 0
    response["output"][-1]["content"][0]["logprobs"][4]["logprob"] += 2 ** -20
    assert _verify(server, tmp_path, request, response) == 1
    assert "first difference at token 4" in capsys.readouterr().out
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"n": {"enum": [1, 2, 3]}}, "required": ["n"], "additionalProperties": False}}}
    request = {"model": "smollm2", "messages": [{"role": "user", "content": "Pick."}], "tools": [tool],
               "tool_choice": "required", "max_tokens": 64, "temperature": 1.0, "seed": 3}
    response = httpx.post(server.url + "/v1/chat/completions", json=request, timeout=120, headers=auth).json()
    assert response["choices"][0]["message"]["tool_calls"], response
    assert _verify(server, tmp_path, request, response) == 0
    response["choices"][0]["message"]["tool_calls"][0]["function"]["name"] = "other"
    assert _verify(server, tmp_path, request, response) == 1
