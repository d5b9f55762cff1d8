"""/v1/responses under a hostile-client campaign: the fields every response object repeats
(tools, the identifiers, max_tool_calls), each bounded as OpenAI bounds it, with the 400 expected
now. In process, over the fake engine: the route's checks, not the model, are under test."""
from __future__ import annotations

import pytest
from fake_engine import fake_state
from starlette.testclient import TestClient

from server_helpers import API_KEY, client_error as _error

from detent.server.app import build_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY = {"input": "hi", "max_output_tokens": 2}


@pytest.fixture(scope="module")
def client():
    with TestClient(build_app(fake_state(api_key=API_KEY))) as c:
        yield c


@pytest.mark.parametrize("value", [-1, 0, -2 ** 63])
def test_max_tool_calls_below_one_is_a_400(client, value):
    """max_tool_calls: -1 was taken and echoed in the response. OpenAI refuses a value below 1
    ("integer below minimum value"); so does Detent, naming the field. 1 and more are echoed."""
    err = _error(client.post("/v1/responses", headers=AUTH, json={**BODY, "max_tool_calls": value}))
    assert err["param"] == "max_tool_calls" and "greater than or equal to 1" in err["message"], err
    r = client.post("/v1/responses", headers=AUTH, json={**BODY, "max_tool_calls": 1})
    assert r.status_code == 200 and r.json()["max_tool_calls"] == 1, r.text


def _tools(n: int, responses: bool = True) -> list[dict]:
    if responses:  # Responses' flat function tools
        return [{"type": "function", "name": f"f{i}", "parameters": {"type": "object"}} for i in range(n)]
    return [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(n)]


def test_more_tools_than_openais_128_are_a_400_on_responses_which_echoes_them(client):
    """Every Responses object repeats the request's tools (three in a stream): 200,000 of them (a
    14 MB body) held /health for 1 s while a stream was written. OpenAI takes at most 128 tools
    there; more is a 400 naming tools, before any tool is read. 128 are served and echoed. The
    official client reads the 400. Chat, which repeats no tool, takes more, as vLLM does."""
    import openai
    err = _error(client.post("/v1/responses", headers=AUTH, json={**BODY, "tools": _tools(129), "tool_choice": "none"}))
    assert err["param"] == "tools" and "129 tools, more than OpenAI's limit of 128" in err["message"], err
    err = _error(client.post("/v1/responses", headers=AUTH, json={**BODY, "tools": _tools(20_000)}))
    assert err["param"] == "tools" and "20000 tools" in err["message"] and len(err["message"]) < 200, err
    r = client.post("/v1/responses", headers=AUTH, json={**BODY, "tools": _tools(128), "tool_choice": "none"})
    assert r.status_code == 200 and len(r.json()["tools"]) == 128, r.text
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key=API_KEY, http_client=client, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="more than OpenAI's limit of 128"):
        sdk.responses.create(model="m", input="hi", max_output_tokens=2, tools=_tools(129), tool_choice="none")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tools": _tools(300, False),
            "tool_choice": "none"}
    assert client.post("/v1/chat/completions", headers=AUTH, json=chat).status_code == 200


@pytest.mark.parametrize("field", ["user", "safety_identifier", "prompt_cache_key"])
def test_the_identifiers_a_response_repeats_have_openais_64_characters(client, field):
    """user, safety_identifier and prompt_cache_key were echoed in every response object however
    long (a 15 MB user was written back three times in a stream). OpenAI takes at most 64 characters
    for each (documented for safety_identifier; its 400 for the other two); more is a 400 naming the
    field. 64 are echoed. chat's `user`, which no response repeats, stays unbounded (as vLLM's)."""
    err = _error(client.post("/v1/responses", headers=AUTH, json={**BODY, field: "u" * 65}))
    assert err["param"] == field and "at most 64 characters" in err["message"], err
    err = _error(client.post("/v1/responses", headers=AUTH, json={**BODY, field: "u" * 15_000_000}))
    assert err["param"] == field and len(err["message"]) < 300, err["message"][:300]
    for stream in (False, True):
        r = client.post("/v1/responses", headers=AUTH, json={**BODY, field: "u" * 64, "stream": stream})
        assert r.status_code == 200 and r.text.count(f'"{field}":"{"u" * 64}"') == (3 if stream else 1), r.text[:300]
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "user": "u" * 1000}
    assert client.post("/v1/chat/completions", headers=AUTH, json=chat).status_code == 200


def test_the_settings_every_response_object_repeats_are_encoded_once_off_the_event_loop(client, monkeypatch):
    """Each response object (three in a stream) encoded the request's tools, tool_choice, metadata ...
    again, on the event loop: one tool whose parameters hold 900,000 keys (a 12 MB body, within every
    bound OpenAI documents) held /health for 1.7 s a stream. They are encoded once, where the body is
    validated (on the pool for a body over 64 KiB), and that text is spliced into every object."""
    import asyncio
    import json

    import openai
    from detent.server import responses
    on_loop, real = [], responses.request_settings

    def spy(req):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # a worker's thread
            on_loop.append(False)
        return real(req)
    monkeypatch.setattr(responses, "request_settings", spy)
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "x": {f"k{j}": j for j in range(8000)}}}
    body = {**BODY, "tools": [tool], "tool_choice": "none", "metadata": {"k": "v"}, "user": "u"}
    r = client.post("/v1/responses", headers=AUTH, json=body)
    assert r.status_code == 200 and r.headers["content-type"] == "application/json", r.text[:300]
    plain = r.json()
    assert plain["tools"] == [tool] and plain["metadata"] == {"k": "v"} and plain["status"] == "incomplete"
    r = client.post("/v1/responses", headers=AUTH, json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
    objects = [e["response"] for e in events if "response" in e]
    assert len(objects) == 3 and all(o["tools"] == [tool] and o["user"] == "u" for o in objects), len(objects)
    assert {k for k in objects[-1] if k != "id"} == {k for k in plain if k != "id"}
    assert on_loop == [False, False], on_loop
    r = client.post("/v1/responses", headers=AUTH, json={**BODY, "stream": True})  # a small body: no thread hop
    assert r.status_code == 200 and on_loop[2:] == [True], on_loop
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key=API_KEY, http_client=client, max_retries=0)
    assert sdk.responses.create(model="m", input="hi", max_output_tokens=2, user="u").user == "u"


@pytest.mark.parametrize("stream", [False, True])
def test_a_responses_logprob_body_is_built_off_the_event_loop(client, monkeypatch, stream):
    """A response with logprobs holds up to --max-logprob-entries entries, tens of MB: its items and
    JSON text were built on the event loop, holding /health and every stream, while chat built its
    body in a worker thread. Now the response object is built there too (a stream's last one, which
    repeats every token's logprobs; its deltas carry a step's each); one without logprobs stays on
    the loop (no thread hop on the common path)."""
    import asyncio
    import json

    from detent.server import responses_output
    on_loop, real = [], responses_output.chat_logprobs

    def spy(*a, **k):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # a worker's thread
            on_loop.append(False)
        return real(*a, **k)
    monkeypatch.setattr(responses_output, "chat_logprobs", spy)
    body = {**BODY, "max_output_tokens": 4, "include": ["message.output_text.logprobs"], "top_logprobs": 2,
            "stream": stream}
    r = client.post("/v1/responses", headers=AUTH, json=body)
    assert r.status_code == 200, r.text
    if stream:
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: ")]
        final = events[-1]["response"]
        assert on_loop[-1] is False and all(on_loop[:-1]), on_loop
    else:
        final = r.json()
        assert on_loop == [False], on_loop
    logprobs = final["output"][0]["content"][0]["logprobs"]
    assert len(logprobs) == 4 and all(len(e["top_logprobs"]) == 2 for e in logprobs), final
    hops, real_built = [], responses_output.built
    monkeypatch.setattr(responses_output, "built", lambda build, off_loop: hops.append(off_loop) or real_built(build, off_loop))
    assert client.post("/v1/responses", headers=AUTH, json={**BODY, "stream": stream}).status_code == 200
    assert hops == [False], hops
