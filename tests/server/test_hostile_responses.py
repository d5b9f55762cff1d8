"""/v1/responses under a hostile-client campaign: the fields every response object repeats
(tools, the identifiers, max_tool_calls), each bounded as OpenAI bounds it, with the 400 expected
now. In process, over the fake engine: the route's checks, not the model, are under test."""
from __future__ import annotations

import pytest
from fake_engine import FakeEngine, FakeTokenizer
from starlette.testclient import TestClient

from server_helpers import API_KEY, client_error as _error

from detent.server.app import build_app
from detent.server.async_engine import AsyncEngine
from detent.server.serving import ServerState

AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY = {"input": "hi", "max_output_tokens": 2}


@pytest.fixture(scope="module")
def client():
    state = ServerState(engine=AsyncEngine(FakeEngine()), tokenizer=FakeTokenizer(), served_model_names=["m"],
                        model_root="x", max_model_len=512, tuple_hash="a" * 64, deployment_hash="b" * 64,
                        api_key=API_KEY)
    with TestClient(build_app(state)) as c:
        yield c


@pytest.mark.parametrize("value", [-1, 0, -2 ** 63])
def test_max_tool_calls_below_one_is_a_400(client, value):
    """max_tool_calls: -1 was taken and echoed in the response. OpenAI refuses a value below 1
    ("integer below minimum value"); so does Detent, naming the field. 1 and more are echoed."""
    err = _error(client.post("/v1/responses", headers=AUTH, json={**BODY, "max_tool_calls": value}))
    assert err["param"] == "max_tool_calls" and "greater than or equal to 1" in err["message"], err
    r = client.post("/v1/responses", headers=AUTH, json={**BODY, "max_tool_calls": 1})
    assert r.status_code == 200 and r.json()["max_tool_calls"] == 1, r.text
