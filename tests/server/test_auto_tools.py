"""`tool_choice: "auto"` under `--enable-auto-tool-choice --tool-call-parser
hermes` with `--reasoning-parser qwen3`, and under `--tool-call-parser
qwen3_coder` (XML calls, values typed by the request's tools), through the
official openai client against a real server: outputs forced with
`golden_token_ids` come back as content, reasoning and `tool_calls`, the
stream's pieces adding up to the non-streamed message (OpenAI's own stream
accumulator); without the flags "auto" is a 400 naming them. A property test forces
outputs built from pieces of calls (complete, cut, repeated, inside the
reasoning, XML) under every tool_choice, streamed and not, beside a seeded
request: no 5xx, and the seeded request equal to its solo run
(DETENT_FUZZ_EXAMPLES / 6 examples per parser). Unit: when a
constraint binds after the reasoning block (`_output_shape`)."""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import httpx
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from server_helpers import AGENT_FLAGS, API_KEY, launch, openai_client, real_argv, token_ids

from detent.sampling.params import StructuredOutputs
from detent.server.chat import _output_shape
from detent.server.protocol import ChatCompletionRequest

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "smollm2"
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
EOS = 2  # the tiny model's end of sequence (models/tiny.py)


@pytest.fixture(scope="module")
def agent_server(tiny_model):
    with launch(real_argv("--model", tiny_model, "--api-key", API_KEY, "--max-model-len", "1024",
                          "--served-model-name", MODEL, *AGENT_FLAGS)) as s:
        yield s


@pytest.fixture(scope="module")
def agent(agent_server):
    return openai_client(agent_server)


def _ask(client, server, text: str, stream: bool = False, tools=TOOLS, **kw):
    ids = token_ids(server, text) + [EOS]  # ends as the model would: finish_reason "stop"
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=tools, max_tokens=len(ids),
        temperature=0, stream=stream, extra_body={"golden_token_ids": ids}, **kw)


def _accumulated(chunks):
    state = ChatCompletionStreamState()
    for ch in chunks:
        state.handle_chunk(ch)
    return state.get_final_completion().choices[0]


@pytest.mark.parametrize("text,content,reasoning", [
    ("</think>Let me check." + CALL, "Let me check.", ""),
    ("<think>\nThey want weather.\n</think>\n\n" + CALL, "\n\n", "\nThey want weather.\n"),
    ("</think>" + CALL + "\n" + CALL, None, ""),
], ids=["content-then-call", "reasoning-then-call", "two-calls"])
def test_auto_tool_calls_streamed_and_not(agent, agent_server, text, content, reasoning):
    choice = _ask(agent, agent_server, text).choices[0]
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert calls == [("get_weather", {"city": "Paris"})] * text.count("<tool_call>")
    assert choice.finish_reason == "tool_calls" and choice.message.content == content
    assert choice.message.model_extra["reasoning"] == reasoning
    chunks = list(_ask(agent, agent_server, text, stream=True))
    streamed = _accumulated(chunks)
    assert streamed.finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert (streamed.message.content or None) == (choice.message.content or None)
    thought = "".join(c.choices[0].delta.model_extra.get("reasoning") or "" for c in chunks if c.choices)
    assert thought == (choice.message.model_extra["reasoning"] or "")


def test_text_without_a_call_stays_content(agent, agent_server):
    """Also: a call written while still thinking (no </think>) is reasoning, not a call, as vLLM's qwen3."""
    thinking = _ask(agent, agent_server, "Let me check." + CALL).choices[0]
    assert thinking.message.tool_calls is None and thinking.message.content is None
    assert thinking.message.model_extra["reasoning"] == "Let me check." + CALL
    choice = _ask(agent, agent_server, "</think>I will use <tool but no call.").choices[0]
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == \
        ("I will use <tool but no call.", None, "stop")
    bad = _ask(agent, agent_server, "</think>" + CALL.replace('"city"', "city")).choices[0]
    assert bad.message.tool_calls is None and bad.message.content == CALL.replace('"city"', "city")


CODER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}, "required": ["city"]}}}]


def _xml_call(city: str, days: str) -> str:
    return (f"<tool_call>\n<function=get_weather>\n<parameter=city>\n{city}\n</parameter>\n"
            f"<parameter=days>\n{days}\n</parameter>\n</function>\n</tool_call>")


@pytest.fixture(scope="module")
def coder_server(tiny_model):
    with launch(real_argv("--model", tiny_model, "--api-key", API_KEY, "--max-model-len", "1024",
                          "--served-model-name", MODEL, "--enable-auto-tool-choice",
                          "--tool-call-parser", "qwen3_coder")) as s:
        yield s


def test_qwen3_coder_calls_streamed_and_not(coder_server):
    coder = openai_client(coder_server)
    text = "Let me check.\n" + _xml_call("Paris", "3") + "\n" + _xml_call("Lyon", "two")
    choice = _ask(coder, coder_server, text, tools=CODER_TOOLS).choices[0]
    assert (choice.message.content, choice.finish_reason) == ("Let me check.\n", "tool_calls")
    calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    # days: an integer by the tool's schema; "two" is not one, and stays a string
    assert calls == [("get_weather", '{"city": "Paris", "days": 3}'), ("get_weather", '{"city": "Lyon", "days": "two"}')]
    streamed = _accumulated(list(_ask(coder, coder_server, text, stream=True, tools=CODER_TOOLS)))
    assert (streamed.message.content, streamed.finish_reason) == ("Let me check.\n", "tool_calls")
    assert [(c.function.name, c.function.arguments) for c in streamed.message.tool_calls] == calls
    plain = _ask(coder, coder_server, "No call: <function=get_weather", tools=CODER_TOOLS).choices[0]
    assert (plain.message.content, plain.message.tool_calls, plain.finish_reason) == \
        ("No call: <function=get_weather", None, "stop")


# generated forced outputs: pieces of calls, complete, broken, repeated or inside the reasoning
PIECES = [CALL, CALL[:len(CALL) // 2], CALL[len(CALL) // 2:], "<tool_call>", "</tool_call>", "<think>", "</think>",
          "Let me check.", "\n", '{"name": "nowhere", "arguments": 5}', _xml_call("Paris", "3"),
          _xml_call("Oslo", "x")[:40], "<function=get_weather>", "<parameter=city>", "</parameter>", "é世"]
CHOICES = [None, "auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}]
GOOD_CHAT = {"messages": [{"role": "user", "content": "Say something."}], "max_tokens": 6, "temperature": 0.9,
             "seed": 21, "logprobs": True, "top_logprobs": 2}


def _chat(server, body: dict) -> tuple[int, str]:
    with httpx.Client(timeout=60) as c:
        r = c.post(server.url + "/v1/chat/completions", headers=AUTH, json={"model": MODEL, **body})
        return r.status_code, r.text


@pytest.mark.parametrize("which", ["agent", "coder"])
def test_generated_forced_outputs_never_fail_the_server_or_a_neighbour(which, request):
    """Each example forces an output built from pieces of tool calls (golden_token_ids) under a
    drawn tool_choice, stream and length, sent beside a seeded request: no 5xx (in the status or
    in a stream), and the seeded request's choices == its solo run."""
    from concurrent.futures import ThreadPoolExecutor

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
    server = request.getfixturevalue(f"{which}_server")
    tools = TOOLS if which == "agent" else CODER_TOOLS
    status, solo = _chat(server, GOOD_CHAT)
    assert status == 200, solo
    solo = json.loads(solo)["choices"]

    @settings(max_examples=int(os.environ.get("DETENT_FUZZ_EXAMPLES", "40")) // 6, deadline=None, derandomize=True,
              database=None,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(pieces=st.lists(st.sampled_from(PIECES), min_size=1, max_size=4), choice=st.sampled_from(CHOICES),
           stream=st.booleans(), cut=st.integers(0, 3), end=st.booleans())
    def check(pieces, choice, stream, cut, end):
        ids = token_ids(server, "".join(pieces)) + ([EOS] if end else [])
        body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": tools,
                "max_tokens": max(1, len(ids) - cut), "temperature": 0, "stream": stream,
                "golden_token_ids": ids[:max(1, len(ids) - cut)]}
        if choice is not None:
            body["tool_choice"] = choice
        with ThreadPoolExecutor(2) as pool:
            forced, good = pool.map(lambda b: _chat(server, b), [body, GOOD_CHAT])
        assert forced[0] < 500 and "internal_server_error" not in forced[1], (body, forced)
        assert good[0] == 200 and json.loads(good[1])["choices"] == solo, (body, good)

    check()


def test_auto_needs_the_flags(server):
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "tools": TOOLS, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
    assert "--enable-auto-tool-choice --tool-call-parser" in r.json()["error"]["message"]


class _Tok:
    def __init__(self, end_ids):
        self.end_ids = end_ids

    def encode(self, text, add_special_tokens=True):
        assert text == "</think>" and not add_special_tokens
        return self.end_ids


def test_a_constraint_binds_after_the_reasoning_block_when_think_end_is_one_token():
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    spec = StructuredOutputs(choice=["a", "b"])
    state = SimpleNamespace(reasoning_parser="qwen3", tool_parser=None, tokenizer=_Tok([151668]))
    shape, got = _output_shape(req, state, spec, None)
    assert got.start_after_token_ids == [151668] and got.choice == ["a", "b"] and shape.reasoner is not None
    state.tokenizer = _Tok([27, 14, 5])  # several tokens: constrained from the first token, all content
    shape, got = _output_shape(req, state, spec, None)
    assert got is spec and shape.reasoner is None and shape.reasoning_field
    off = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                chat_template_kwargs={"enable_thinking": False})
    state.tokenizer = _Tok([151668])
    shape, got = _output_shape(off, state, spec, None)
    assert got is spec and not shape.reasoner.thinking  # no reasoning block to wait for
    state.reasoning_parser = None
    shape, got = _output_shape(req, state, spec, None)
    assert got is spec and shape.reasoner is None and not shape.reasoning_field
