"""`vllm serve` flags that shape the HTTP API (issue 22), on the app over the fake engine: CORS,
--root-path, the docs, token ids as tokens, usage in every stream, the logged prompt's length."""
from __future__ import annotations

import logging

import pytest

from server_helpers import API_KEY, AUTH, CHAT, sse_events

from detent.server.cli import parse_args

def _client(**state: object):
    """The app over the fake engine, behind the API key; ServerState fields from `state`."""
    from fake_engine import FakeEngine, FakeTokenizer
    from starlette.testclient import TestClient

    from detent.server.app import build_app
    from detent.server.async_engine import AsyncEngine
    from detent.server.serving import ServerState
    return TestClient(build_app(ServerState(
        engine=AsyncEngine(FakeEngine()), tokenizer=FakeTokenizer(), served_model_names=["m"], model_root="x",
        max_model_len=512, tuple_hash="a" * 64, deployment_hash="b" * 64, api_key=API_KEY, **state)))


def test_a_cors_preflight_needs_no_api_key_and_the_request_still_does():
    """A browser page on another origin: its preflight (OPTIONS, no key) is answered with vLLM's
    default CORS headers; the request itself still needs the key."""
    from detent.server.cli import app_options
    assert app_options(parse_args([]))["cors"] == dict(allow_origins=["*"], allow_methods=["*"], allow_headers=["*"],
                                                       allow_credentials=False)
    origin = {"Origin": "http://page.example"}
    with _client(**app_options(parse_args([]))) as c:
        r = c.options("/v1/chat/completions", headers={**origin, "Access-Control-Request-Method": "POST",
                                                       "Access-Control-Request-Headers": "authorization,content-type"})
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "*" and "POST" in r.headers["access-control-allow-methods"]
        assert r.headers["access-control-allow-headers"] == "authorization,content-type"
        r = c.post("/v1/chat/completions", headers=origin, json=CHAT)
        assert r.status_code == 401 and r.headers["access-control-allow-origin"] == "*"  # the page can read why
        r = c.post("/v1/chat/completions", headers={**origin, **AUTH}, json=CHAT)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
        assert {"x-detent-tuple-hash", "x-detent-deployment-hash"} <= \
            set(r.headers["access-control-expose-headers"].lower().split(", "))
        assert r.headers["x-detent-tuple-hash"] == "a" * 64


def test_cors_flags_choose_what_a_page_may_do():
    from detent.server.cli import app_options
    a = parse_args(["--allowed-origins", '["http://page.example"]', "--allowed-methods", '["POST"]',
                    "--allowed-headers", '["authorization"]', "--allow-credentials"])
    assert app_options(a)["cors"] == dict(allow_origins=["http://page.example"], allow_methods=["POST"],
                                          allow_headers=["authorization"], allow_credentials=True)
    with _client(**app_options(a)) as c:
        asks = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
        r = c.options("/v1/chat/completions", headers={"Origin": "http://page.example", **asks})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "http://page.example"
        assert r.headers["access-control-allow-credentials"] == "true"
        for other in ({"Origin": "http://other.example", **asks},
                      {"Origin": "http://page.example", **asks, "Access-Control-Request-Method": "DELETE"}):
            r = c.options("/v1/chat/completions", headers=other)
            assert r.status_code == 400, other
        r = c.post("/v1/chat/completions", headers={"Origin": "http://other.example", **AUTH}, json=CHAT)
        assert r.status_code == 200 and "access-control-allow-origin" not in r.headers
    for bad in (["--allowed-origins", "http://page.example"], ["--allowed-methods", '"POST"'],
                ["--allowed-headers", "[1]"]):
        with pytest.raises(SystemExit):
            parse_args(bad)


def test_root_path_serves_behind_a_path_prefix_and_keeps_the_api_key():
    from detent.server.cli import app_options
    assert app_options(parse_args(["--root-path", "/llm"]))["root_path"] == "/llm"
    with _client(root_path="/llm") as c:
        for path in ("/llm/v1/models", "/v1/models"):  # a proxy that passes the prefix on, one that strips it
            assert c.get(path).status_code == 401
            assert c.get(path, headers=AUTH).json()["data"][0]["id"] == "m"
        assert c.post("/llm/v1/chat/completions", headers=AUTH, json=CHAT).status_code == 200
        assert c.get("/llm/health").status_code == 200
    with _client() as c:
        assert c.get("/llm/v1/models", headers=AUTH).status_code == 404
    for bad in ("llm", "/llm/", "/"):
        with pytest.raises(SystemExit):
            parse_args(["--root-path", bad])


def test_disable_fastapi_docs():
    from detent.server.cli import app_options
    import warnings
    with _client(**app_options(parse_args([]))) as c, warnings.catch_warnings():
        warnings.simplefilter("error")  # FastAPI warns of a duplicate operation id (two methods of one route)
        schema = c.get("/openapi.json").json()
        assert schema["info"]["title"] == "Detent"
        ids = [op["operationId"] for ops in schema["paths"].values() for op in ops.values()]
        assert len(ids) == len(set(ids)) and {"get", "post"} <= set(schema["paths"]["/ping"])
        for path in ("/docs", "/redoc"):  # vLLM's two pages, each naming the schema
            page = c.get(path)
            assert page.status_code == 200 and "/openapi.json" in page.text, path
    with _client(**app_options(parse_args(["--disable-fastapi-docs"]))) as c:
        for path in ("/openapi.json", "/docs", "/redoc"):
            assert c.get(path).status_code == 404, path


def test_return_tokens_as_token_ids_sets_the_default_a_request_overrides():
    assert parse_args([]).return_tokens_as_token_ids is False
    flag = parse_args(["--return-tokens-as-token-ids"]).return_tokens_as_token_ids
    for server_default in (False, flag):
        with _client(return_tokens_as_token_ids=server_default) as c:
            for field in (None, False, True):
                extra = {} if field is None else {"return_tokens_as_token_ids": field}
                cmpl = c.post("/v1/completions", headers=AUTH,
                              json={"prompt": "ab", "max_tokens": 3, "logprobs": 1, **extra}).json()
                chat = c.post("/v1/chat/completions", headers=AUTH,
                              json={**CHAT, "logprobs": True, "top_logprobs": 1, **extra}).json()
                tokens = cmpl["choices"][0]["logprobs"]["tokens"] + \
                    [t["token"] for t in chat["choices"][0]["logprobs"]["content"]]
                as_ids = server_default if field is None else field
                assert len(tokens) == 5 and all(t.startswith("token_id:") == as_ids for t in tokens), \
                    (server_default, field, tokens)


def test_enable_force_include_usage_puts_usage_in_every_stream():
    """As vLLM: usage in every chunk and a last usage chunk, whatever stream_options say."""
    for flags, forced in (([], False), (["--enable-force-include-usage"], True)):
        with _client(force_include_usage=parse_args(flags).enable_force_include_usage) as c:
            for options in (None, {"include_usage": False}, {"include_usage": True}):
                extra = {} if options is None else {"stream_options": options}
                for path, body in (("/v1/completions", {"prompt": "ab", "max_tokens": 3}),
                                   ("/v1/chat/completions", CHAT)):
                    events = sse_events(c.post(path, headers=AUTH, json={**body, "stream": True, **extra}))
                    with_usage = forced or (options or {}).get("include_usage", False)
                    last = events[-1]
                    assert (last["choices"] == [] and last["usage"]["total_tokens"] > 0) == with_usage, (path, options)
                    assert all((e.get("usage") is not None) == forced for e in events[:-1]), (path, options, events)


def test_max_log_len_cuts_the_logged_prompt(caplog):
    """With --enable-log-requests, vLLM logs each prompt at DEBUG: its text and token ids, each
    cut to --max-log-len."""
    caplog.set_level(logging.DEBUG, logger="detent.server.requests")
    assert parse_args([]).max_log_len is None
    three = parse_args(["--max-log-len", "3"]).max_log_len
    for cut, want in ((None, "prompt: 'hello world', prompt_token_ids: [0, 107, 104, 111, 111, 114, 35, 122, 114, "
                             "117, 111, 103]"),
                      (three, "prompt: 'hel', prompt_token_ids: [0, 107, 104]")):
        caplog.clear()
        with _client(log_requests=True, max_log_len=cut) as c:
            r = c.post("/v1/completions", headers=AUTH,
                       json={"prompt": "hello world", "max_tokens": 1, "request_id": "r"})
            assert r.status_code == 200
        lines = [rec.getMessage() for rec in caplog.records if rec.name == "detent.server.requests"]
        assert f"request r-0 details: {want}" in lines, lines
    with pytest.raises(SystemExit):
        parse_args(["--max-log-len", "-1"])
