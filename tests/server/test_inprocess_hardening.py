"""Issue 23 in process: template rendering off the loop and bounded, the
Connection header after a 500, /health on a dead engine, the metrics label,
and the JSON walk."""
from __future__ import annotations

import asyncio
import time

import pytest
from starlette.testclient import TestClient

from fake_engine import FakeEngine, fake_state

from detent.server.app import build_app
from detent.server.body import check_json
from detent.server.errors import APIError
from detent.server.limits import ServerLimits
from detent.server.preprocess import Preprocessor

LOOPS = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"
WRITES = "{% for i in range(100000) %}{{ messages[0].content }}{% endfor %}"
MSGS = [{"role": "user", "content": "hello there"}]


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    from detent.models import Tokenizer
    return Tokenizer(tiny_model)


def _render_while_ticking(pre: Preprocessor, template: str, content: str = "hello there"):
    """Renders `template` while a coroutine ticks every 10 ms: (error, seconds, longest gap between ticks)."""
    async def main():
        gaps, stop = [], False

        async def tick():
            last = time.monotonic()
            while not stop:
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        ticker = asyncio.ensure_future(tick())
        t0 = time.monotonic()
        try:
            await pre.render([{"role": "user", "content": content}], True, {"chat_template": template})
            err = None
        except APIError as e:
            err = e
        took = time.monotonic() - t0
        stop = True
        await ticker
        return err, took, max(gaps)

    return asyncio.run(main())


def test_a_looping_template_stops_at_its_deadline_off_the_event_loop(tokenizer):
    pre = Preprocessor(tokenizer, ServerLimits(chat_template_timeout_s=0.5), max_model_len=1024)
    err, took, gap = _render_while_ticking(pre, LOOPS)
    assert err is not None and err.status == 400 and "--chat-template-timeout" in err.message
    assert took < 2.0          # 10**10 iterations unbounded
    assert gap < 0.25          # the event loop kept running meanwhile (on the loop: one 0.5 s+ gap)
    pre.shutdown()


def test_a_template_looping_over_data_silently_is_answered_at_the_deadline(tokenizer):
    """Loops over the messages' text that write nothing are not seen by the thread's
    checks (no range, no output); the client still gets its 400 a second after the
    deadline, and the loop keeps running meanwhile."""
    pre = Preprocessor(tokenizer, ServerLimits(chat_template_timeout_s=0.2), max_model_len=1024)
    quadratic = "{% for a in messages[0].content %}{% for b in messages[0].content %}{% endfor %}{% endfor %}"
    # 15,000**2 empty iterations: ~5 s on the machine this was written on, well past the
    # 0.2 s deadline + 1 s on any CPU (6,000**2 rendered in 0.8 s there: a race, not a test)
    err, took, gap = _render_while_ticking(pre, quadratic, content="y" * 15000)
    assert err is not None and "--chat-template-timeout" in err.message
    assert took < 2.5 and gap < 0.25
    pre.shutdown()


def test_a_template_writing_too_much_stops_at_the_size_bound(tokenizer):
    pre = Preprocessor(tokenizer, ServerLimits(chat_template_timeout_s=30), max_model_len=64)
    err, took, _ = _render_while_ticking(pre, WRITES)
    assert err is not None and err.status == 400 and f"passed {64 * 32} characters" in err.message
    assert "--max-chars-per-token" in err.message and took < 5
    pre.shutdown()


def test_the_models_own_template_renders_as_before(tokenizer):
    pre = Preprocessor(tokenizer, ServerLimits(), max_model_len=1024)
    text = asyncio.run(pre.render(MSGS, True, {}))
    assert text == tokenizer.apply_chat_template(MSGS, True)
    ids = asyncio.run(pre.encode(text, "messages", add_special_tokens=False))
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    pre.shutdown()


def _state(engine=None, names=("m",)):
    return fake_state(engine, served_model_names=list(names))


def test_a_500_closes_the_connection_and_says_so():
    state = _state()
    app = build_app(state)

    @app.fastapi.get("/boom")
    async def boom():
        raise RuntimeError("kaput at /secret/path/file.py:12\nframe #0 ...")

    r = TestClient(app, raise_server_exceptions=False).get("/boom")
    assert r.status_code == 500 and r.headers["connection"] == "close"
    assert r.json()["error"]["message"] == "internal error: RuntimeError: kaput at <file>"
    assert TestClient(app).get("/v1/models").headers.get("connection") != "close"


def test_health_on_a_dead_engine_is_one_line_without_paths():
    class Dead(FakeEngine):
        def step(self):
            raise RuntimeError("CUDA error: an illegal memory access\nException raised from c10_cuda_check at "
                               "/pytorch/c10/cuda/CUDAException.cpp:43 (most recent call first):\nframe #0: ...")

    state = _state(Dead())
    with TestClient(build_app(state)) as c:
        c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        for _ in range(100):
            if state.engine.dead:
                break
            time.sleep(0.02)
        for r in (c.get("/health"), c.get("/ping"), c.post("/ping")):  # /ping: vLLM's name for it
            assert r.status_code == 503
            assert r.json()["reason"] == "RuntimeError: CUDA error: an illegal memory access"
        r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
        assert r.status_code == 503 and "\n" not in r.json()["error"]["message"]
        assert "CUDAException.cpp" not in r.text


def test_the_metrics_label_is_the_models_name_not_its_path(tmp_path):
    model_dir = tmp_path / "models" / "my-llama"
    model_dir.mkdir(parents=True)
    body = _state(names=(str(model_dir),)).metrics.render({}, True).decode()
    assert 'model_name="my-llama"' in body and str(tmp_path) not in body
    body = _state(names=("org/served-name",)).metrics.render({}, True).decode()
    assert 'model_name="org/served-name"' in body


@pytest.mark.parametrize("obj,needle", [
    ({"a": [[[[1]]]]}, None),
    ({"prompt": list(range(100_000))}, None),
    ({"prompt": [1, 2, 2**64]}, "prompt[2]: the integer"),
    ({"x": {"y": [0, -(2**63) - 1]}}, "x.y[1]"),
    ({"k\ud800": 1}, "surrogate"),
    ({"x": float("inf")}, "finite"),
])
def test_json_walk(obj, needle):
    if needle is None:
        check_json(obj)
    else:
        with pytest.raises(APIError, match=needle.replace("[", r"\[").replace("]", r"\]")):
            check_json(obj)


def test_client_templates_pass_only_when_trusted():
    from detent.server.chat import client_template
    from detent.server.protocol import ChatCompletionRequest
    req = ChatCompletionRequest.model_validate(
        {"messages": MSGS, "chat_template_kwargs": {"chat_template": WRITES, "flag": 1}})
    with pytest.raises(APIError, match="--trust-request-chat-template"):
        client_template(req, trusted=False)
    assert client_template(req, trusted=True) == {"chat_template": WRITES, "flag": 1}
    plain = ChatCompletionRequest.model_validate({"messages": MSGS, "chat_template_kwargs": {"flag": 1}})
    assert client_template(plain, trusted=False) == {"flag": 1}


def test_continue_final_message_through_a_template_that_drops_the_text_is_a_400(tokenizer):
    state = fake_state(tokenizer=tokenizer, limits=ServerLimits(trust_request_chat_template=True))
    client = TestClient(build_app(state))
    msgs = [*MSGS, {"role": "assistant", "content": "the answer is"}]
    body = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True}
    ok = client.post("/v1/tokenize", json=body)
    assert ok.status_code == 200
    assert tokenizer.decode(ok.json()["tokens"], skip_special_tokens=False).endswith("the answer is")
    upper = "{% for m in messages %}{{ m.content | upper }}{% endfor %}"
    for path, extra in (("/v1/tokenize", {}), ("/v1/chat/completions", {"model": "m", "max_tokens": 1})):
        r = client.post(path, json={**body, **extra, "chat_template": upper})
        assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message", r.text
        assert "drops or changes it" in r.json()["error"]["message"]


def test_limit_flags_build_the_servers_limits():
    from detent.server.cli import parse_args
    a = parse_args(["--max-n", "4", "--request-timeout", "2.5", "--trust-request-chat-template",
                    "--max-logprob-entries", "10"])
    assert a.limits == ServerLimits(max_n=4, request_timeout_s=2.5, trust_request_chat_template=True,
                                    max_logprob_entries=10)
    assert parse_args([]).limits == ServerLimits()
    for bad in (["--max-n", "0"], ["--chat-template-timeout", "-1"], ["--max-request-bytes", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
