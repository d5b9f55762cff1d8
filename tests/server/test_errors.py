"""Every bad input gets its status and OpenAI's error body, and the server keeps serving."""
from __future__ import annotations

import httpx
import openai
import pytest

from server_helpers import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]


def _post(server, path, body=None, content=None, headers=AUTH):
    return httpx.post(server.url + path, json=body, content=content, headers=headers, timeout=60)


def _good(server):
    r = _post(server, CMPL, {"prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


def _check(r, status, *needles, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    for n in needles:
        assert n in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param, err
    assert "x-detent-tuple-hash" in r.headers
    return err


def test_malformed_json_400(server):
    for content in (b'{"prompt": "x", ', b"not json", b"[1, 2]", b"\xff\xfe"):
        err = _check(_post(server, CMPL, content=content), 400)
        assert err["type"] == "invalid_request_error"
        _good(server)


@pytest.mark.parametrize("path,body,param", [
    (CMPL, {"prompt": 5}, "prompt"),
    (CMPL, {"prompt": "x", "max_tokens": "5"}, "max_tokens"),
    (CMPL, {"prompt": "x", "temperature": "hot"}, "temperature"),
    (CMPL, {"prompt": "x", "stream": "yes"}, "stream"),
    (CMPL, {"prompt": "x", "seed": 1.5}, "seed"),
    (CMPL, {"prompt": "x", "stop": [1, 2]}, "stop"),
    (CMPL, {"prompt": "x", "logprobs": True}, "logprobs"),
    (CMPL, {"max_tokens": 3}, "prompt"),
    (CHAT, {"messages": "hi"}, "messages"),
    (CHAT, {"messages": MSG, "logprobs": 3}, "logprobs"),
    (CHAT, {"messages": [{"content": "no role"}]}, "messages[0].role"),
    (CHAT, {"messages": MSG, "response_format": {"type": "yaml"}}, "response_format.type"),
])
def test_wrong_field_types_400_naming_the_field(server, path, body, param):
    err = _check(_post(server, path, body), 400, param=param)
    assert param.split(".")[0].split("[")[0] in err["message"]
    _good(server)


def test_context_limits_400_naming_the_limit(server):
    err = _check(_post(server, CMPL, {"prompt": "hello " * 1100, "max_tokens": 4}), 400, "1024")
    assert err["code"] == "context_length_exceeded"
    _check(_post(server, CMPL, {"prompt": "hello", "max_tokens": 5000}), 400, "1024", param="max_tokens")
    _check(_post(server, CHAT, {"messages": MSG, "max_completion_tokens": 4000}), 400, "1024")
    _check(_post(server, CMPL, {"prompt": [10 ** 9], "max_tokens": 2}), 400, "vocabulary", param="prompt")
    _good(server)


@pytest.mark.parametrize("field,value", [("temperature", -1.0), ("top_p", 1.5), ("top_k", -5), ("n", 0),
                                         ("min_p", 2.0), ("max_tokens", 0), ("logprobs", 50),
                                         ("repetition_penalty", 0.0), ("presence_penalty", 5.0)])
def test_invalid_sampling_400(server, field, value):
    _check(_post(server, CMPL, {"prompt": "x", "max_tokens": 3, field: value}), 400, field, param=field)
    _good(server)


@pytest.mark.parametrize("extra,needle", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "JSON Schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
    ({"guided_regex": "(unclosed"}, "regex"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "grammar"),
    ({"guided_choice": []}, "choice"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, "only one"),
    # each of these was a 500 (OverflowError, RecursionError) found by fuzzing
    ({"guided_regex": "a{4294967295}"}, "does not compile"),
    ({"guided_regex": "(" * 1000 + ")" * 1000}, "does not compile"),
    ({"guided_json": "[" * 50_000}, "nested too deeply"),  # JSON text in a string: no body depth bound
    ({"guided_json": '{"items": ' * 300 + "{}" + "}" * 300}, "nested too deeply"),
])
def test_invalid_structured_outputs_400(server, extra, needle):
    _check(_post(server, CHAT, {"messages": MSG, "max_tokens": 3, **extra}), 400, needle)
    _good(server)


@pytest.mark.parametrize("extra,param", [
    ({"guided_json": {"type": "nonsense", "description": "x" * 70_000}}, "guided_json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "nonsense", "description": "x" * 70_000}}}], "tool_choice": "required"}, "tools"),
])
def test_a_structured_output_spec_over_the_size_bound_is_refused_before_it_is_validated(server, extra, param):
    """Validating a spec runs on the event loop (a 5 MB schema's meta-schema check took 18 s,
    every route waiting): the engine's size bound (max_spec_bytes) is checked first. This spec
    is invalid too; the size is what the 400 names."""
    _check(_post(server, CHAT, {"messages": MSG, "max_tokens": 3, **extra}), 400, "max_spec_bytes", param=param)
    _good(server)


def _deep(levels: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(levels):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("extra,field,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _deep(12)}}},
     "response_format.json_schema.schema", "response_format.json_schema.schema"),
    ({"guided_json": _deep(12)}, "guided_json", "guided_json"),
    ({"structured_outputs": {"json": _deep(12)}}, "structured_outputs.json", "structured_outputs.json"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _deep(12)}}], "tool_choice": "required"},
     "the tools' parameters schema", "tools"),
])
def test_a_spec_over_the_engines_grammar_limits_is_a_400_naming_the_field_the_client_sent(server, extra, field, param):
    """The engine's grammar limits (here max_schema_depth) were checked only at the engine's
    admission, whose 400 named structured_outputs for a schema sent as response_format or as a
    tool's parameters; the server checks them where it validates the spec, under the client's name."""
    err = _check(_post(server, CHAT, {"messages": MSG, "max_tokens": 3, **extra}), 400, param=param)
    assert err["message"] == f"{field} nests deeper than 16 levels; the limit is max_schema_depth = 16", err
    _good(server)


@pytest.mark.parametrize("extra,message", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strng"}}}},
     "response_format.json_schema.schema is not a valid JSON Schema at type"),
    ({"guided_regex": "(unclosed"}, "guided_regex does not compile"),
    ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs.grammar is not valid EBNF"),
])
def test_an_invalid_spec_is_said_of_the_field_the_client_sent(server, extra, message):
    """The spec's own check says "structured_outputs.json is not a valid JSON Schema"; the 400 said
    it after "invalid response_format.json_schema.schema: ", naming two fields for one."""
    err = _check(_post(server, CHAT, {"messages": MSG, "max_tokens": 3, **extra}), 400)
    assert err["message"].startswith(message), err


def test_a_content_part_that_is_not_text_is_a_400_naming_it(server):
    parts = [{"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": "http://x"}}]
    err = _check(_post(server, CHAT, {"messages": [{"role": "user", "content": parts}], "max_tokens": 3}), 400,
                 param="messages[0].content")
    assert err["message"] == "messages[0].content[1]: only text parts are supported (type 'text' with a string 'text')"
    r = _post(server, CHAT, {"messages": [{"role": "user", "content": parts[:1]}], "max_tokens": 3})
    assert r.status_code == 200, r.text


def test_unknown_model_404(client, server):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert "gpt-4" in e.value.body["message"] and e.value.status_code == 404
    _good(server)


def test_api_key_401(server):
    bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    _check(_post(server, CMPL, {"prompt": "x"}, headers={}), 401, "API key")
    _check(_post(server, CHAT, {"messages": MSG}, headers={"Authorization": "Basic abc"}), 401)
    assert httpx.get(server.url + "/health").status_code == 200  # health and metrics stay open
    assert httpx.get(server.url + "/metrics").status_code == 200
    _good(server)


def test_body_too_large_413(server):
    _check(_post(server, CMPL, {"prompt": "x" * 1_100_000, "max_tokens": 2}), 413, "1000000 bytes")
    # a chunked upload (no Content-Length) is counted as it arrives
    chunks = iter([b'{"prompt": "', b"y" * 600_000, b"y" * 600_000, b'"}'])
    _check(_post(server, CMPL, content=chunks), 413, "1000000 bytes")
    _good(server)


def test_errors_counted_as_rejected(server):
    before = _rejected(server)
    _post(server, CMPL, {"prompt": "x", "temperature": -1})
    assert _rejected(server) == before + 1


def _rejected(server):
    return server.metric("detent:requests_rejected_total")
