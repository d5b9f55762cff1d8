"""vLLM's request fields and endpoints on detent-serve (issue 22), through the
official openai client: logit_bias, allowed_token_ids, continuous_usage_stats,
echo with max_tokens 0, GET /tokenizer_info, and every field vLLM accepts
either honoured or refused with a 400 naming it."""
from __future__ import annotations

import json

import httpx
import pytest

from server_helpers import API_KEY

from detent.server.protocol import ChatCompletionRequest, CompletionRequest
from detent.server.vllm_fields import REFUSED, REFUSED_CHAT

MODEL = "smollm2"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
IDS = [1, 504, 3458, 282, 4649, 314]

# the request fields of vLLM's CompletionRequest and ChatCompletionRequest (OpenAI's and vLLM's extensions)
VLLM_COMMON = """model frequency_penalty logit_bias logprobs max_tokens n presence_penalty seed stop stream
stream_options temperature top_p user response_format best_of use_beam_search top_k min_p repetition_penalty
length_penalty stop_token_ids include_stop_str_in_output ignore_eos min_tokens skip_special_tokens
spaces_between_special_tokens truncate_prompt_tokens prompt_logprobs allowed_token_ids bad_words add_special_tokens
structured_outputs guided_json guided_regex guided_choice guided_grammar guided_decoding_backend
guided_whitespace_pattern priority request_id logits_processors return_tokens_as_token_ids return_token_ids
cache_salt kv_transfer_params vllm_xargs""".split()
VLLM_COMPLETION = VLLM_COMMON + "prompt echo suffix prompt_embeds".split()
VLLM_CHAT = VLLM_COMMON + """messages top_logprobs max_completion_tokens tools tool_choice reasoning_effort
include_reasoning parallel_tool_calls echo add_generation_prompt continue_final_message documents chat_template
chat_template_kwargs mm_processor_kwargs""".split()

# a value that asks for something, per refused field
ASKS = {"use_beam_search": True, "length_penalty": 0.5, "truncate_prompt_tokens": 4,
        "spaces_between_special_tokens": False, "priority": 1, "logits_processors": ["x"], "prompt_embeds": "AAAA",
        "guided_decoding_backend": "outlines", "guided_whitespace_pattern": " ", "cache_salt": "s",
        "kv_transfer_params": {"a": 1}, "vllm_xargs": {"a": 1}, "return_token_ids": True,
        "echo": True, "best_of": 2, "add_special_tokens": True, "documents": [{"t": "x"}], "mm_processor_kwargs": {"a": 1},
        "parallel_tool_calls": False}


def _post(server, path, body):
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=120)


def test_every_vllm_field_is_declared_or_refused():
    for fields, model, refused in ((VLLM_COMPLETION, CompletionRequest, REFUSED),
                                   (VLLM_CHAT, ChatCompletionRequest, {**REFUSED, **REFUSED_CHAT})):
        silent = [f for f in fields if f not in model.model_fields and f not in refused]
        assert not silent, f"{model.__name__}: vLLM fields neither honoured nor refused: {silent}"
    assert set(ASKS) == set(REFUSED) | set(REFUSED_CHAT)


def test_refused_fields_are_400s_naming_them_and_defaults_pass(server):
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    comp = {"model": MODEL, "prompt": IDS, "max_tokens": 1}
    for name, value in ASKS.items():
        for path, body in (("/v1/chat/completions", chat), ("/v1/completions", comp)):
            if path == "/v1/completions" and name not in REFUSED:
                continue  # chat-only refusals (echo, add_special_tokens) are completion fields
            r = _post(server, path, {**body, name: value})
            assert r.status_code == 400, (path, name, r.text)
            err = r.json()["error"]
            assert err["param"] == name and name in err["message"], err
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0, "spaces_between_special_tokens": True,
                "truncate_prompt_tokens": None, "return_token_ids": False}
    assert _post(server, "/v1/completions", {**comp, **defaults}).status_code == 200
    assert _post(server, "/v1/chat/completions", {**chat, **defaults, "echo": False, "add_special_tokens": False,
                                                  "include_reasoning": True}).status_code == 200


def _ids(choice) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in choice.logprobs.tokens]


def test_logit_bias_over_http(client, server):
    base = dict(model=MODEL, prompt=IDS, max_tokens=5, logprobs=0, extra_body={"return_tokens_as_token_ids": True})
    plain = _ids(client.completions.create(temperature=0, **base).choices[0])
    target = next(t for t in (42, 43, 44) if t not in plain)
    got = _ids(client.completions.create(temperature=0, logit_bias={str(target): 100}, **base).choices[0])
    assert got == [target] * 5
    banned = _ids(client.completions.create(temperature=0, logit_bias={str(plain[0]): -100}, **base).choices[0])
    assert banned[0] != plain[0]
    for bias, why in (({"abc": 1}, "token ids"), ({"42": 101}, "100"), ({"99999999": 1}, "vocabulary")):
        r = _post(server, "/v1/completions", {"model": MODEL, "prompt": IDS, "max_tokens": 1, "logit_bias": bias})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias" and why in r.text, r.text


def test_allowed_token_ids(client, server):
    allowed = [7, 9, 11]
    r = client.completions.create(model=MODEL, prompt=IDS, max_tokens=12, temperature=1.0, seed=3, logprobs=0,
                                  extra_body={"return_tokens_as_token_ids": True, "allowed_token_ids": allowed})
    assert set(_ids(r.choices[0])) <= set(allowed) and len(_ids(r.choices[0])) == 12
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": IDS, "max_tokens": 1,
                                          "allowed_token_ids": [99999999]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text


def test_continuous_usage_stats(server):
    body = {"model": MODEL, "prompt": IDS, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    text_events = [e for e in events if e["choices"]]
    assert text_events and all(e["usage"] is not None for e in events)
    done = [e["usage"]["completion_tokens"] for e in text_events]
    assert done == sorted(done) and done[-1] == 6 and all(e["usage"]["prompt_tokens"] == len(IDS) for e in events)
    # without continuous_usage_stats the text chunks carry no usage, as vLLM
    body["stream_options"] = {"include_usage": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert all(e["usage"] is None for e in events if e["choices"])


def test_echo_with_max_tokens_zero_scores_the_prompt(client, server):
    scored = client.completions.create(model=MODEL, prompt=IDS, max_tokens=0, echo=True, logprobs=1, temperature=0)
    c = scored.choices[0]
    ref = client.completions.create(model=MODEL, prompt=IDS, max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert c.logprobs.token_logprobs == ref.choices[0].logprobs.token_logprobs[:len(IDS)]
    assert len(c.logprobs.tokens) == len(IDS) and c.logprobs.token_logprobs[0] is None
    assert c.text == ref.choices[0].text[:len(c.text)] and scored.usage.completion_tokens == 0
    assert c.finish_reason == "length"
    body = {"model": MODEL, "prompt": IDS, "max_tokens": 0, "echo": True, "logprobs": 1, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=AUTH, timeout=120) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == c.text
    assert events[-1]["usage"]["completion_tokens"] == 0
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": IDS, "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


def test_tokenizer_info_as_transformers_reads_it(server, tiny_model):
    transformers = pytest.importorskip("transformers")
    r = httpx.get(server.url + "/tokenizer_info", timeout=30)
    assert r.status_code == 200, r.text
    info = r.json()
    ref = transformers.AutoTokenizer.from_pretrained(tiny_model)
    for key in ("bos_token", "eos_token", "model_max_length", "pad_token", "unk_token"):
        want = ref.init_kwargs.get(key)
        assert info.get(key) == (getattr(want, "content", want)), key
    assert info["chat_template"] == ref.chat_template
    assert isinstance(info["tokenizer_class"], str) and info["tokenizer_class"]
    assert "vocab_file" not in info and "merges_file" not in info


def test_bad_words(client, server):
    base = dict(model=MODEL, prompt=IDS, max_tokens=12, temperature=0, logprobs=0,
                extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True})
    plain = _ids(client.completions.create(**base).choices[0])
    word = httpx.post(server.url + "/detokenize", json={"tokens": [plain[0]]}, headers=AUTH).json()["prompt"]
    banned = set()
    for text in (word.lstrip(), " " + word.lstrip()):
        ids = httpx.post(server.url + "/tokenize", json={"prompt": text, "add_special_tokens": False},
                         headers=AUTH).json()["tokens"]
        if len(ids) == 1:
            banned.add(ids[0])
    assert plain[0] in banned
    got = _ids(client.completions.create(**{**base, "extra_body": {**base["extra_body"], "bad_words": [word]}})
               .choices[0])
    assert len(got) == 12 and not banned & set(got) and got != plain
    r = _post(server, "/v1/completions", {"model": MODEL, "prompt": IDS, "max_tokens": 1, "bad_words": [" "]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "bad_words", r.text


WEATHER = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "get_time", "parameters": {
             "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}}, "required": ["zone"],
             "additionalProperties": False}}}]
MSGS = [{"role": "user", "content": "Weather in Paris?"}]


def test_tool_choice_named_and_required_return_tool_calls(client, server):
    import jsonschema
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=200, temperature=0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    m = r.choices[0].message
    assert m.content is None and len(m.tool_calls) == 1 and m.tool_calls[0].function.name == "get_weather"
    jsonschema.validate(json.loads(m.tool_calls[0].function.arguments), WEATHER)
    assert r.choices[0].finish_reason == "stop"
    r = client.chat.completions.create(model=MODEL, messages=MSGS, tools=TOOLS, max_tokens=400, temperature=0,
                                       tool_choice="required")
    calls = r.choices[0].message.tool_calls
    assert calls and r.choices[0].finish_reason == "tool_calls"
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    # the calls go back into the history (content null) with the tool's answer
    history = MSGS + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
                      {"role": "tool", "tool_call_id": calls[0].id, "content": "21 C"}]
    assert _post(server, "/v1/chat/completions", {"model": MODEL, "messages": history, "max_tokens": 2}).status_code == 200
    for body, param in (({"tools": TOOLS}, "tool_choice"), ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice"),
                        ({"tool_choice": "required"}, "tool_choice"),
                        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
                         "tool_choice"),
                        ({"tools": [{"type": "function"}], "tool_choice": "required"}, "tools"),
                        ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
                         "tool_choice")):
        r = _post(server, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 2, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert _post(server, "/v1/chat/completions", {"model": MODEL, "messages": MSGS, "max_tokens": 2, "tools": TOOLS,
                                                  "tool_choice": "none"}).status_code == 200
