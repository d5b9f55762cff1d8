"""`POST /v1/responses` (server/responses.py), OpenAI's Responses API on the chat
path, through the official openai client against real servers on the tiny
Llama: the same conversation through /v1/chat/completions gives the same
prompt, tokens, text and logprobs (the oracle: a Responses request is the chat
request it means); outputs forced with `golden_token_ids` under
`--reasoning-parser qwen3 --enable-auto-tool-choice --tool-call-parser hermes`
come back as reasoning, message and function_call items; the stream's events
arrive in a valid order (the SDK's own accumulator, `client.responses.stream`)
and add up to the non-streamed output; what Detent cannot honour is a 400
naming the field."""
from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pytest

from server_helpers import AGENT_FLAGS, API_KEY, launch, openai_client, real_argv, token_ids

from detent.server.chat_output import ChatOutput
from detent.server.protocol import ResponsesRequest
from detent.server.reasoning import ReasoningParser
from detent.server.responses_input import to_chat_request
from detent.server.responses_output import OutputEvents, output_items, tokens_within
from detent.server.vllm_fields import REFUSED_RESPONSES

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "smollm2"
EOS = 2  # the tiny model's end of sequence (models/tiny.py)
LOGPROBS = ["message.output_text.logprobs"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
TOOLS = [{"type": "function", "name": "get_weather", "parameters": WEATHER}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
THOUGHT = "<think>\nThey want weather.\n</think>\n\n"


@pytest.fixture(scope="module")
def agent_server(tiny_model, tmp_path_factory):
    """Reasoning and auto tool calls as a Qwen3 deployment runs them, writing a request log."""
    log = tmp_path_factory.mktemp("responses-log") / "requests.jsonl"
    with launch(real_argv("--model", tiny_model, "--api-key", API_KEY, "--max-model-len", "1024",
                          "--served-model-name", MODEL, *AGENT_FLAGS, "--request-log", str(log))) as s:
        s.request_log = log
        yield s


@pytest.fixture(scope="module")
def agent(agent_server):
    return openai_client(agent_server)


def _logprob_ids(logprobs) -> list[int]:
    return [int(lp.token.removeprefix("token_id:")) for lp in logprobs]


def _events(stream) -> list:
    """Every event of a `client.responses.stream(...)`, checked for a valid order by the SDK's
    accumulator and here: increasing sequence numbers, items added before their pieces and
    closed before the next opens, the response's lifecycle first and last."""
    events = list(stream)
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type in ("response.completed", "response.incomplete")
    open_item = None
    for e in events[2:-1]:
        if e.type == "response.output_item.added":
            assert open_item is None, f"{e.type} while item {open_item} is open"
            open_item = e.output_index
        elif e.type == "response.output_item.done":
            assert e.output_index == open_item
            open_item = None
        else:
            assert getattr(e, "output_index", None) == open_item and open_item is not None, e
    assert open_item is None
    return events


def _same_output(streamed, plain) -> None:
    """Items equal but for their ids (and call ids, which are random)."""
    def key(item):
        d = item.model_dump(exclude={"id", "call_id", "parsed_arguments"})
        for part in d.get("content") or []:
            part.pop("parsed", None)
        return d
    assert [key(i) for i in streamed.output] == [key(i) for i in plain.output]


def test_text_and_tokens_equal_the_chat_completions(client, server):
    """A string input is a user turn: the same tokens, text, logprobs and counts as chat;
    cut by max_output_tokens, the response is incomplete."""
    r = client.responses.create(model=MODEL, input="Name a colour.", max_output_tokens=8, temperature=0,
                                include=LOGPROBS, top_logprobs=2, metadata={"k": "v"},
                                extra_body={"seed": 7, "ignore_eos": True, "return_tokens_as_token_ids": True})
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                          max_tokens=8, temperature=0, seed=7, logprobs=True, top_logprobs=2,
                                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert (r.status, r.incomplete_details.reason) == ("incomplete", "max_output_tokens")
    (msg,) = r.output
    assert msg.type == "message" and msg.role == "assistant" and msg.status == "incomplete"
    assert r.output_text == chat.choices[0].message.content
    assert _logprob_ids(msg.content[0].logprobs) == _logprob_ids(chat.choices[0].logprobs.content)
    assert [(lp.logprob, [t.logprob for t in lp.top_logprobs]) for lp in msg.content[0].logprobs] == \
        [(lp.logprob, [t.logprob for t in lp.top_logprobs]) for lp in chat.choices[0].logprobs.content]
    u = r.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == \
        (chat.usage.prompt_tokens, 8, chat.usage.prompt_tokens + 8)
    assert u.output_tokens_details.reasoning_tokens == 0 and u.input_tokens_details.cached_tokens >= 0
    assert (r.store, r.metadata, r.max_output_tokens, r.temperature, r.top_logprobs) == (False, {"k": "v"}, 8, 0, 2)
    assert r.model_extra["detent"]["seeds"] == [7] and r.model_extra["detent"]["tuple_hash"]


def test_items_history_and_instructions_render_as_chat(client, server):
    """instructions, a developer item (system for this template, folded into the one system
    message), a function_call and its function_call_output and a reasoning item (dropped):
    the prompt chat renders from the same conversation, so the same output."""
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    items = [{"role": "developer", "content": "Answer in French."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
             {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "x"}]},
             call, {"type": "function_call_output", "call_id": "call_1", "output": "sunny, 21 C"},
             {"role": "user", "content": "And tomorrow?"}]
    r = client.responses.create(model=MODEL, instructions="Be brief.", input=items, tools=TOOLS, tool_choice="none",
                                max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    messages = [{"role": "system", "content": "Be brief.\n\nAnswer in French."},
                {"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                      "arguments": '{"city": "Paris"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
                {"role": "user", "content": "And tomorrow?"}]
    chat = client.chat.completions.create(model=MODEL, messages=messages, tools=CHAT_TOOLS, tool_choice="none",
                                          max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    prompt = httpx.post(server.url + "/v1/tokenize", json={"messages": messages}, headers=AUTH).json()
    text = httpx.post(server.url + "/v1/detokenize", json={"tokens": prompt["tokens"]}, headers=AUTH).json()["prompt"]
    assert prompt["count"] == r.usage.input_tokens and text.count("<|im_start|>system") == 1
    assert text.index("Answer in French.") < text.index("sunny, 21 C") < text.index("And tomorrow?")


def test_stream_adds_up_to_the_non_streamed_response(client):
    kw = dict(model=MODEL, input="Tell a story.", max_output_tokens=12, temperature=0.9, include=LOGPROBS,
              extra_body={"seed": 3, "ignore_eos": True})
    plain = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = _events(stream)  # no final response: the SDK keeps a response.completed one only
    assert events[-1].type == "response.incomplete" and events[-1].response.status == "incomplete"
    _same_output(events[-1].response, plain)
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert "".join(e.delta for e in deltas) == plain.output_text
    want = [lp.logprob for lp in plain.output[0].content[0].logprobs]
    assert [lp.logprob for e in deltas for lp in e.logprobs] == want and len(want) == 12
    done = next(e for e in events if e.type == "response.output_text.done")
    assert done.text == plain.output_text and events[-1].response.usage.output_tokens == 12


def test_completed_stream_through_the_sdk_accumulator(client, server):
    ids = token_ids(server, "Hello there, how are you?") + [EOS]
    kw = dict(model=MODEL, input="Hi", max_output_tokens=40, extra_body={"golden_token_ids": ids})
    plain = client.responses.create(**kw)
    with client.responses.stream(**kw) as stream:
        events = _events(stream)
        final = stream.get_final_response()
    assert plain.status == "completed" and plain.output_text == "Hello there, how are you?"
    assert events[-1].type == "response.completed" and final.status == "completed"
    _same_output(final, plain)
    assert final.usage.output_tokens == len(ids) and final.output[0].status == "completed"


@pytest.mark.parametrize("text,kinds", [
    (THOUGHT + "Let me check." + CALL, ["reasoning", "message", "function_call"]),
    (THOUGHT.rstrip() + CALL + "\n" + CALL, ["reasoning", "function_call", "function_call"]),
    ("</think>The weather is fine.", ["message"]),
], ids=["reasoning-message-call", "two-calls", "content-only"])
def test_forced_outputs_become_items_streamed_and_not(agent, agent_server, text, kinds):
    ids = token_ids(agent_server, text) + [EOS]
    kw = dict(model=MODEL, input="Weather in Paris?", tools=TOOLS, max_output_tokens=len(ids), temperature=0,
              extra_body={"golden_token_ids": ids})
    r = agent.responses.create(**kw)
    assert [i.type for i in r.output] == kinds and r.status == "completed"
    by = {i.type: i for i in r.output}
    if "reasoning" in by:
        assert by["reasoning"].content[0].text == "\nThey want weather.\n" and by["reasoning"].summary == []
        want = tokens_within(ids, (len("<think>"), len("<think>\nThey want weather.\n")),
                             lambda t: httpx.post(agent_server.url + "/v1/detokenize", json={"tokens": t},
                                                  headers=AUTH).json()["prompt"])
        assert r.usage.output_tokens_details.reasoning_tokens == want > 0
    if "message" in by:
        assert r.output_text == text.split("</think>")[1].split("<tool_call>")[0]
    for item in r.output:
        if item.type == "function_call":
            assert (item.name, json.loads(item.arguments), item.status) == ("get_weather", {"city": "Paris"},
                                                                            "completed")
            assert item.call_id.startswith("call_") and item.id.startswith("fc_")
    with agent.responses.stream(**kw) as stream:
        events = _events(stream)
        final = stream.get_final_response()
    _same_output(final, r)
    assert final.usage.output_tokens == r.usage.output_tokens
    reasoning = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert reasoning == (by["reasoning"].content[0].text if "reasoning" in by else "")
    parts = [e.part.type for e in events if e.type == "response.content_part.added"]
    part_of = {"reasoning": "reasoning_text", "message": "output_text"}
    assert parts == [part_of[k] for k in kinds if k in part_of]


def test_a_forced_function_and_json_schema_output(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"enum": [1, 2, 3]}},
              "required": ["ok", "n"], "additionalProperties": False}
    r = client.responses.create(model=MODEL, input="Reply in JSON.", max_output_tokens=64, temperature=0.7,
                                text={"format": {"type": "json_schema", "name": "reply", "schema": schema}},
                                extra_body={"seed": 2})
    assert r.status == "completed" and r.text.format.type == "json_schema"
    jsonschema.validate(json.loads(r.output_text), schema)
    named = dict(model=MODEL, input="Weather?", tools=[{**TOOLS[0], "parameters": schema}], max_output_tokens=64,
                 tool_choice={"type": "function", "name": "get_weather"}, extra_body={"seed": 4})
    r = client.responses.create(**named)
    (call,) = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    jsonschema.validate(json.loads(call.arguments), schema)
    with client.responses.stream(**named) as stream:
        events = _events(stream)
        final = stream.get_final_response()
    _same_output(final, r)
    assert events[2].type == "response.output_item.added" and events[2].item.type == "function_call"


@pytest.mark.parametrize("extra,param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"background": True}, "background"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"truncation": "auto"}, "truncation"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"reasoning": {"summary": "auto"}}, "reasoning.summary"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice"),
    ({"top_logprobs": 3}, "top_logprobs"),
    ({"max_output_tokens": 2000}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"tools": TOOLS}, "tool_choice"),  # "auto" needs --enable-auto-tool-choice, as on chat
], ids=lambda v: v if isinstance(v, str) else None)
def test_what_detent_cannot_honour_is_a_400_naming_it(server, extra, param):
    r = httpx.post(server.url + "/v1/responses", headers=AUTH, timeout=60,
                   json={"model": MODEL, "input": "Hi", "max_output_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param.split("[")[0].split(".")[0] in err["message"], err


def test_reasoning_tokens_are_those_wholly_inside_the_reasoning():
    pieces = ["<", "think", ">\n", "They", " want", ".\n</", "think", ">", "Hi"]  # a tokenizer splitting the tags
    decode = lambda ids: "".join(pieces[i] for i in ids)  # noqa: E731
    text = decode(range(len(pieces)))
    span = (len("<think>"), text.index("</think>"))
    assert tokens_within(list(range(len(pieces))), span, decode) == 2  # "They", " want"; ">\n" and ".\n</" straddle
    assert tokens_within([0, 1], (0, 0), decode) == 0


def test_a_named_call_after_reasoning_streams_in_the_non_streamed_order():
    """A named forced function is announced before any token (server/tool_stream.py), but
    under a reasoning parser its item follows the reasoning item, as in the non-streamed output."""
    shape = ChatOutput(ReasoningParser("qwen3"), True, tool_mode="get_weather")
    stream, out = shape.stream(), OutputEvents(logprobs=False)
    out.opening(stream.opening())
    pieces = ["<think>", "\nhm", "\n</think>", '{"city"', ': "Paris"}']
    events = []
    for i, piece in enumerate(pieces):
        delta, _ = stream.next(piece, i == len(pieces) - 1)
        events += out.pieces(delta, None)
    events += out.end(incomplete=False)
    message, _ = shape.message("".join(pieces), "stop")

    def strip(items):
        return [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in items]
    assert strip(out.items) == strip(output_items(message, None, incomplete=False))
    assert [e["item"]["type"] for e in events if e["type"] == "response.output_item.added"] == \
        ["reasoning", "function_call"]


def test_the_developer_role_stays_where_the_template_knows_it():
    body = {"instructions": "A.", "input": [{"role": "developer", "content": "B."}, {"role": "user", "content": "C"}]}
    knows = to_chat_request(ResponsesRequest.model_validate(body), "{% if m.role == 'developer' %}x{% endif %}")
    assert [(m.role, m.content) for m in knows.messages] == [("system", "A."), ("developer", "B."), ("user", "C")]
    plain = to_chat_request(ResponsesRequest.model_validate(body), "{{ m.role }}")
    assert [(m.role, m.content) for m in plain.messages] == [("system", "A.\n\nB."), ("user", "C")]


def test_every_responses_field_is_declared_or_refused():
    """vLLM's ResponsesRequest and OpenAI's ResponseCreateParams: each field is honoured
    (declared) or refused (server/vllm_fields.py), never silently ignored."""
    vllm = """background include input instructions max_output_tokens max_tool_calls metadata model logit_bias
    parallel_tool_calls previous_response_id prompt reasoning service_tier store stream temperature text tool_choice
    tools top_logprobs top_p top_k truncation user skip_special_tokens include_stop_str_in_output prompt_cache_key
    request_id mm_processor_kwargs priority cache_salt enable_response_messages previous_input_messages
    previous_response structured_outputs repetition_penalty seed stop ignore_eos vllm_xargs""".split()
    from openai.types.responses.response_create_params import ResponseCreateParamsBase
    fields = set(vllm) | set(ResponseCreateParamsBase.__annotations__) | {"stream_options"}
    silent = sorted(f for f in fields if f not in ResponsesRequest.model_fields and f not in REFUSED_RESPONSES)
    assert not silent, f"fields neither honoured nor refused: {silent}"


def test_an_error_after_the_stream_started_is_in_band(server):
    """A schema the engine's grammar compiler rejects fails once the stream has started: an
    `error` event, then `response.failed`; the server serves on."""
    body = {"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 20, "tool_choice": "required",
            "tools": [{"type": "function", "name": "f", "parameters": {
                "type": "object", "properties": {"a": {"$ref": "#/nope"}}, "required": ["a"]}}]}
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=AUTH, timeout=120) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert r.headers["x-detent-tuple-hash"] and r.headers["content-type"].startswith("text/event-stream")
    names = [ln[len("event: "):] for ln in lines if ln.startswith("event: ")]
    data = [json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: ")]
    assert names == [d["type"] for d in data] and names[-2:] == ["error", "response.failed"]
    assert "grammar" in data[-2]["message"] and data[-1]["response"]["status"] == "failed"
    assert data[-1]["response"]["error"]["message"] == data[-2]["message"]
    assert httpx.get(server.url + "/health").json() == {"status": "ok"}


def _aborted(server) -> float:
    return sum(v for k, v in server.metrics().items()
               if k.startswith("detent:request_success_total{") and 'finished_reason="abort"' in k)


def test_a_client_that_leaves_frees_its_request(server):
    body = {"model": MODEL, "input": "Count.", "stream": True, "max_output_tokens": 900,
            "ignore_eos": True, "temperature": 0}
    aborted = _aborted(server)
    with httpx.stream("POST", server.url + "/v1/responses", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if "response.output_text.delta" in line:
                break
    deadline = time.time() + 60
    while time.time() < deadline and (_aborted(server) == aborted or server.metric("detent:num_requests_running")):
        time.sleep(0.2)
    assert _aborted(server) == aborted + 1 and server.metric("detent:num_requests_running") == 0


def test_the_request_log_records_the_endpoint_and_verifies(agent, agent_server):
    r = agent.responses.create(model=MODEL, input="Logged.", max_output_tokens=5, temperature=1.0,
                               extra_body={"request_id": "resp_logged", "ignore_eos": True})
    deadline, rec = time.time() + 30, None
    while rec is None and time.time() < deadline:
        lines = [json.loads(x) for x in open(agent_server.request_log) if x.strip()]
        rec = next((x for x in lines if x.get("request_id") == "resp_logged-0"), None)
        time.sleep(0.1)
    assert rec["endpoint"] == "/v1/responses" and rec["outputs"][0]["seed"] == r.model_extra["detent"]["seeds"][0]
    rep = httpx.post(agent_server.url + "/v1/verify", json=rec, headers=AUTH, timeout=120).json()
    assert rep["equal"], rep
