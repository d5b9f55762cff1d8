"""Inputs a hostile-client campaign against the HTTP routes found mishandled, each with the
4xx (or behaviour) vLLM's OpenAI server gives it. In process, over the fake engine: the
routes' checks, not the model, are under test."""
from __future__ import annotations

import pytest
from fake_engine import FakeEngine, FakeTokenizer
from starlette.testclient import TestClient

from server_helpers import API_KEY

from detent.server.app import build_app
from detent.server.async_engine import AsyncEngine
from detent.server.serving import ServerState

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def client():
    state = ServerState(engine=AsyncEngine(FakeEngine()), tokenizer=FakeTokenizer(), served_model_names=["m"],
                        model_root="x", max_model_len=512, tuple_hash="a" * 64, deployment_hash="b" * 64,
                        api_key=API_KEY)
    with TestClient(build_app(state)) as c:
        yield c


def _error(r) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    return err


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_stream_options_without_stream_is_a_400(client, path, body):
    """vLLM: "Stream options can only be defined when `stream=True`." (a 400 naming stream_options);
    Detent answered 200 and dropped the options."""
    for extra in ({"stream_options": {"include_usage": True}},
                  {"stream_options": {"include_usage": True}, "stream": False},
                  {"stream_options": {"continuous_usage_stats": False}}):
        err = _error(client.post(path, headers=AUTH, json={**body, **extra}))
        assert err["param"] == "stream_options" and "stream" in err["message"], err
    # an empty object asks for nothing (vLLM lets it through too), and with stream: true they apply
    assert client.post(path, headers=AUTH, json={**body, "stream_options": {}}).status_code == 200
    r = client.post(path, headers=AUTH, json={**body, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and '"usage":{"prompt_tokens"' in r.text, r.text
