"""Forced tool calls with `stream: true` (issue 22), through the official openai
client against a real server: the streamed pieces add up to the non-streamed
`tool_calls` (names and arguments; ids are random) for the same seeded
request, choice by choice with n > 1 and logprobs, each call's arguments valid
under its function's schema (jsonschema); chunk shapes as vLLM streams them; a
client that leaves mid-call frees its request; errors keep OpenAI's shape."""
from __future__ import annotations

import json
import time
import warnings

import httpx
import jsonschema
import openai
import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState

from server_helpers import API_KEY

MODEL = "smollm2"
FREED_WITHIN_S = 90.0  # a request whose client left is freed by then, or the test fails
SLOW_FREE_S = 10.0  # a free that took longer is reported (a warning with the server's log)
AUTH = {"Authorization": f"Bearer {API_KEY}"}
WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]},
                                            "days": {"type": "integer", "minimum": 0, "maximum": 99}},
           "required": ["city", "unit", "days"], "additionalProperties": False}
TIME = {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
        "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": TIME}}]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MSGS = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def _create(client, choice, stream, **kw):
    return client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=choice, stream=stream, n=2, seed=1234,
        temperature=0.8, max_tokens=300, logprobs=True, top_logprobs=2,
        **({"stream_options": {"include_usage": True}} if stream else {}), **kw)


def _gather(chunks) -> tuple[dict, dict, dict, dict, list]:
    """Per choice: the calls the deltas add up to (with how many pieces their arguments came
    in), the logprob tokens, the finish reason, the first delta; and the usage chunks."""
    calls: dict[int, dict[int, dict]] = {}
    tokens: dict[int, list] = {}
    finish: dict[int, str] = {}
    first: dict[int, object] = {}
    usages = []
    for ch in chunks:
        if not ch.choices:
            usages.append(ch.usage)
            continue
        (c,) = ch.choices  # one choice per chunk, each index separate
        j, d = c.index, c.delta
        assert j not in finish, "nothing after a choice's finish"
        if j not in first:
            first[j] = d
            assert d.role == "assistant"
        assert not d.content, f"a forced call streams no content: {d}"
        for tc in d.tool_calls or []:
            got = calls.setdefault(j, {})
            if tc.id is not None:
                assert tc.index == len(got) and tc.type == "function" and tc.function.name in SCHEMAS
                got[tc.index] = {"name": tc.function.name, "arguments": tc.function.arguments or "", "pieces": 0}
            else:
                assert tc.index in got and tc.function.name is None, "arguments come after the call's name"
                got[tc.index]["arguments"] += tc.function.arguments
            got[tc.index]["pieces"] += bool(tc.function.arguments)
        if c.logprobs is not None:
            tokens.setdefault(j, []).extend((t.token, t.logprob) for t in c.logprobs.content)
        if c.finish_reason is not None:
            finish[j] = c.finish_reason
    return calls, tokens, finish, first, usages


@pytest.mark.parametrize("choice", [NAMED, "required"], ids=["named", "required"])
def test_streamed_tool_calls_add_up_to_the_non_streamed(client, choice):
    full = _create(client, choice, stream=False)
    chunks = list(_create(client, choice, stream=True))
    calls, tokens, finish, first, usages = _gather(chunks)
    state = ChatCompletionStreamState()  # the openai library's own accumulation of the chunks
    for ch in chunks:
        state.handle_chunk(ch)
    rebuilt = {c.index: c for c in state.get_final_completion().choices}
    assert sorted(calls) == sorted(finish) == [0, 1]
    for c in full.choices:
        j = c.index
        assert c.finish_reason == ("stop" if choice is NAMED else "tool_calls"), c  # complete calls, not cut short
        want = [{"name": t.function.name, "arguments": t.function.arguments} for t in c.message.tool_calls]
        assert [{k: v for k, v in calls[j][i].items() if k != "pieces"} for i in range(len(calls[j]))] == want
        assert [{"name": t.function.name, "arguments": t.function.arguments}
                for t in rebuilt[j].message.tool_calls] == want and not rebuilt[j].message.content
        # the arguments stream as they are generated, not in one piece at the end
        assert all(calls[j][i]["pieces"] >= 3 for i in range(len(calls[j]))), calls[j]
        for call in want:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        assert tokens[j] == [(t.token, t.logprob) for t in c.logprobs.content]
        assert finish[j] == "tool_calls"  # as vLLM's stream, named or required
        if choice is NAMED:  # the name is known at once: the first delta announces it, with no arguments yet
            (tc,) = first[j].tool_calls
            assert tc.index == 0 and tc.id and tc.function.name == "get_weather" and tc.function.arguments == ""
    assert calls[0] != calls[1] or tokens[0] != tokens[1], "n=2 choices sampled the same: the test shows nothing"
    (u,) = usages
    assert (u.prompt_tokens, u.completion_tokens) == (full.usage.prompt_tokens, full.usage.completion_tokens)


def test_raw_stream_ends_done_and_named_calls_say_so_from_the_start(server):
    body = {"model": MODEL, "messages": MSGS, "tools": TOOLS, "tool_choice": NAMED, "stream": True,
            "max_tokens": 300, "seed": 7}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(ln[len("data: "):]) for ln in lines[:-1]]
    head = events[0]["choices"][0]["delta"]
    assert head["role"] == "assistant" and head["content"] is None
    (tc,) = head["tool_calls"]
    assert set(tc) == {"index", "id", "type", "function"} and tc["function"] == {"name": "get_weather",
                                                                                 "arguments": ""}
    for ev in events[1:]:
        d = ev["choices"][0]["delta"]
        assert set(d) <= {"tool_calls"} and all(set(t) == {"index", "function"} and t["index"] == 0
                                                 for t in d.get("tool_calls", []))
    assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"


def _count(server, outcome):
    return sum(v for k, v in server.metrics().items()
               if k.startswith("detent:request_success_total{") and f'finished_reason="{outcome}"' in k)


def test_client_leaving_mid_call_frees_the_request(server):
    long_list = {"type": "object", "properties": {"xs": {"type": "array", "items": {"enum": ["a", "b"]},
                                                         "minItems": 300}}, "required": ["xs"]}
    body = {"model": MODEL, "messages": MSGS, "stream": True, "max_tokens": 900, "seed": 3,
            "tools": [{"type": "function", "function": {"name": "fill", "parameters": long_list}}],
            "tool_choice": {"type": "function", "function": {"name": "fill"}}}
    aborted0 = _count(server, "abort")
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        seen = 0
        for line in r.iter_lines():
            if '"arguments"' in line:
                seen += 1
            if seen >= 3:
                break  # leaving while the call is a few tokens in (300 items are far from done)
    t0 = time.time()
    # the two gauges need not reach 0 in the same stats snapshot (seen once under a full-suite
    # run: running 0, KV 0.0015): wait for both
    while time.time() < t0 + FREED_WITHIN_S and (_count(server, "abort") == aborted0
                                                 or server.metric("detent:num_requests_running") != 0
                                                 or server.metric("detent:kv_cache_usage_perc") != 0):
        time.sleep(0.2)
    took = time.time() - t0
    assert _count(server, "abort") - aborted0 == 1
    # what the engine still holds, and the server's log (its core logs a slow step or an idle engine
    # that holds requests; the server, a silent core). Alone the request is freed in about 0.6 s; in
    # one CI run running stayed 1 for 30 s, not reproduced since: a slow free is reported, a
    # request never freed fails
    state = {k: v for k, v in server.metrics().items()
             if k.startswith(("detent:num_requests", "detent:kv_cache_usage", "detent:request_success_total",
                              "detent:engine_steps_total"))}
    report = f"{state}\nthe server's log:\n{server.output()[-3000:]}"
    freed = server.metric("detent:num_requests_running") == 0 and server.metric("detent:kv_cache_usage_perc") == 0
    assert freed, f"not freed {took:.0f} s after the client left: {report}"
    if took > SLOW_FREE_S:
        warnings.warn(f"the request was freed {took:.1f} s after its client left: {report}")
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def test_bad_streaming_tool_requests_are_openai_errors(client, server):
    bad = [({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
           ({"tool_choice": "auto"}, "tool_choice"),
           ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice")]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, stream=True, max_tokens=4,
                                           **extra)
        err = e.value.body
        assert set(err) >= {"message", "type", "param", "code"} and err["param"] == param, err
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, "messages": MSGS, "stream": True, "tool_choice": "required",
        "tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]})
    assert r.status_code == 400 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    assert r.json()["error"]["param"] == "tools"


def test_a_choice_finishes_once_while_its_siblings_run(server):
    """n=2 choices stopping at different steps (a stop string): each sends one finish chunk,
    and none after it (the engine keeps reporting a finished choice; it must not be re-sent)."""
    body = {"model": MODEL, "messages": MSGS, "stream": True, "n": 2, "max_tokens": 40, "seed": 1, "stop": ["e"]}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
    order = [(ev["choices"][0]["index"], ev["choices"][0]["finish_reason"]) for ev in events]
    for j in (0, 1):
        mine = [f for i, f in order if i == j]
        assert mine[-1] is not None and all(f is None for f in mine[:-1]), order
    first_end = next(k for k, (_, f) in enumerate(order) if f is not None)
    assert first_end < len(order) - 1, f"the choices must finish at different steps to test this: {order}"


def test_an_error_after_the_stream_started_is_in_band_openai_shape(client, server):
    """A schema that passes validation but not the engine's grammar compiler fails once the
    stream has started: an in-band OpenAI error event, then [DONE]; the client raises it."""
    body = {"model": MODEL, "messages": MSGS, "stream": True, "max_tokens": 20, "tool_choice": "required",
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"$ref": "#/nope"}}, "required": ["a"]}}}]}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    err = json.loads(lines[-2][len("data: "):])["error"]
    assert set(err) == {"message", "type", "param", "code"} and "grammar" in err["message"], err
    with pytest.raises(openai.APIError, match="grammar"):
        list(client.chat.completions.create(**{k: v for k, v in body.items() if k != "stream"}, stream=True))
    # the server goes on serving forced calls
    calls, _, finish, _, _ = _gather(client.chat.completions.create(
        model=MODEL, messages=MSGS, tools=TOOLS, tool_choice=NAMED, stream=True, max_tokens=300, seed=5))
    assert finish == {0: "tool_calls"} and calls[0][0]["name"] == "get_weather"
    jsonschema.validate(json.loads(calls[0][0]["arguments"]), WEATHER)
