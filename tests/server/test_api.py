"""The real `detent-serve` (embedded SmolLM2) through the official openai client."""
from __future__ import annotations

import asyncio
import json
import re

import httpx
import jsonschema
import pytest

from server_helpers import API_KEY, launch, real_argv

MODEL = "smollm2"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
PROMPT = "The capital of France is"
SAMPLED = dict(temperature=0.8, top_p=0.95, seed=1234)


def _sse(server, path, body):
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200, r.read()
        events = []
        for line in r.iter_lines():
            if line.startswith("data: "):
                if line == "data: [DONE]":
                    break
                events.append(json.loads(line[6:]))
    return events


def test_models(client):
    assert [m.id for m in client.models.list().data] == ["smollm2", "detent-smollm2"]


def test_completion_usage_and_verifiability(client, server):
    raw = client.completions.with_raw_response.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    r = raw.parse()
    det = r.model_extra["detent"]
    assert raw.headers["x-detent-tuple-hash"] == det["tuple_hash"] and len(det["tuple_hash"]) == 64
    assert raw.headers["x-detent-deployment-hash"] == det["deployment_hash"] and len(det["deployment_hash"]) == 64
    assert r.system_fingerprint == f"detent-{det['deployment_hash'][:16]}-{det['tuple_hash'][:16]}"
    tok = httpx.post(server.url + "/v1/tokenize", json={"prompt": PROMPT}, headers=AUTH).json()
    assert r.usage.prompt_tokens == tok["count"] == len(tok["tokens"])
    assert r.usage.completion_tokens == 8 and r.choices[0].finish_reason == "length"
    assert r.usage.total_tokens == r.usage.prompt_tokens + 8
    # the same prompt as token ids gives the same bits
    r2 = client.completions.create(model=MODEL, prompt=tok["tokens"], max_tokens=8, temperature=0)
    assert r2.choices[0].text == r.choices[0].text
    detok = httpx.post(server.url + "/v1/detokenize", json={"tokens": tok["tokens"]}, headers=AUTH).json()
    assert detok["prompt"].endswith(PROMPT)


def test_chat_counts_and_template(client, server):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}]
    r = client.chat.completions.create(model="detent-smollm2", temperature=0, max_tokens=5, messages=msgs)
    assert r.choices[0].message.role == "assistant" and r.object == "chat.completion"
    tok = httpx.post(server.url + "/v1/tokenize", json={"messages": msgs}, headers=AUTH).json()
    assert r.usage.prompt_tokens == tok["count"] and r.usage.completion_tokens == 5
    text = httpx.post(server.url + "/v1/detokenize", json={"tokens": tok["tokens"]}, headers=AUTH).json()["prompt"]
    assert "Name a colour." in text and text.index("Be brief.") < text.index("Name a colour.")
    assert r.model_extra["detent"]["tuple_hash"]


def test_tokenize_takes_vllms_tools_and_return_token_strs_and_refuses_no_messages(server):
    """vLLM's tokenize-chat fields, ignored before: `tools` go to the chat template as a chat request's
    do, and `return_token_strs` adds each token's string; an empty messages list is a 400 as in chat."""
    msgs = [{"role": "user", "content": "Name a colour."}]
    tok = httpx.post(server.url + "/v1/tokenize", json={"messages": msgs, "return_token_strs": True},
                     headers=AUTH).json()
    assert len(tok["token_strs"]) == tok["count"] and tok["token_strs"][0] == "<|im_start|>", tok
    assert "token_strs" not in httpx.post(server.url + "/v1/tokenize", json={"messages": msgs}, headers=AUTH).json()
    tool = {"type": "function", "function": {"name": "paint", "parameters": {"type": "object"}}}
    r = httpx.post(server.url + "/v1/tokenize", json={"messages": msgs, "tools": [tool]}, headers=AUTH)
    assert r.status_code == 200 and r.json()["count"] >= tok["count"], r.text
    for body, param in (({"messages": msgs, "tools": [5]}, "tools"), ({"messages": []}, "messages")):
        r = httpx.post(server.url + "/v1/tokenize", json=body, headers=AUTH)
        assert r.status_code == 400 and r.json()["error"]["param"].startswith(param), r.text


def test_continue_final_message_ends_the_prompt_with_the_open_message(client, server):
    # vLLM's field: the last (assistant) message stays open, and the model continues it
    msgs = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "My favourite is"}]
    body = {"messages": msgs, "add_generation_prompt": False, "continue_final_message": True}
    tok = httpx.post(server.url + "/v1/tokenize", json=body, headers=AUTH).json()
    text = httpx.post(server.url + "/v1/detokenize", json={"tokens": tok["tokens"]}, headers=AUTH).json()["prompt"]
    assert text.endswith("My favourite is")
    closed = httpx.post(server.url + "/v1/tokenize", json={**body, "continue_final_message": False},
                        headers=AUTH).json()
    assert closed["count"] > tok["count"] and closed["tokens"][:tok["count"]] == tok["tokens"]
    r = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=3, temperature=0,
                                       extra_body={"add_generation_prompt": False, "continue_final_message": True})
    assert r.usage.prompt_tokens == tok["count"]


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_stream_chunks_concatenate_to_nonstreamed(client, server, kind):
    if kind == "completions":
        body = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, logprobs=2, stop=["\n\n"], **SAMPLED)
        full = client.completions.create(**body)
        events = _sse(server, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
        text = "".join(c["text"] for e in events for c in e["choices"])
        lps = [x for e in events for c in e["choices"] for x in c["logprobs"]["token_logprobs"]]
        assert lps == full.choices[0].logprobs.token_logprobs
        assert text == full.choices[0].text
    else:
        body = dict(model=MODEL, max_tokens=24, logprobs=True, top_logprobs=2, **SAMPLED,
                    messages=[{"role": "user", "content": "Write one sentence about the sea."}])
        full = client.chat.completions.create(**body)
        events = _sse(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}})
        text = "".join(c["delta"].get("content", "") for e in events for c in e["choices"])
        lps = [x["logprob"] for e in events for c in e["choices"] if c["logprobs"] for x in c["logprobs"]["content"]]
        assert lps == [x.logprob for x in full.choices[0].logprobs.content]
        assert text == full.choices[0].message.content
        assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    assert events[-1]["choices"] == [] and events[-1]["usage"] == full.usage.model_dump(exclude_none=True)
    finals = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finals == [full.choices[0].finish_reason]


def test_stream_with_a_stop_string_spanning_tokens(client, server):
    """Streamed text never includes a stop string the final text drops."""
    body = dict(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0)
    free = client.completions.create(**body).choices[0].text
    stop = free[len(free) // 2: len(free) // 2 + 6]
    assert len(stop) == 6
    full = client.completions.create(**body, stop=[stop])
    assert full.choices[0].finish_reason == "stop" and full.choices[0].text == free[:free.index(stop)]
    events = _sse(server, "/v1/completions", {**body, "stop": [stop]})
    assert "".join(c["text"] for e in events for c in e["choices"]) == full.choices[0].text


def test_openai_client_streaming(client):
    stream = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": "Say hi."}])
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 8 and chunks[-1].choices == []


def test_logprobs_match_prefill_scoring(client):
    """A greedy token's logprob (decode) equals the same token's prompt logprob (prefill), bit for bit."""
    gen = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=3)
    lp = gen.choices[0].logprobs
    assert len(lp.tokens) == 6 and all(v <= 0 for v in lp.token_logprobs)
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 3 <= len(top) <= 4 and max(top.values()) == chosen  # greedy: the chosen token is the top one
    ids = httpx.post(f"{client.base_url}tokenize", json={"prompt": PROMPT}, headers=AUTH).json()["tokens"]
    as_ids = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=0,
                                       extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    full_ids = ids + [int(t.removeprefix("token_id:")) for t in as_ids.tokens]
    echo = client.completions.create(model=MODEL, prompt=full_ids, max_tokens=1, temperature=0, logprobs=0, echo=True)
    elp = echo.choices[0].logprobs
    assert elp.token_logprobs[0] is None
    assert elp.token_logprobs[len(ids):len(ids) + 6] == lp.token_logprobs
    assert echo.choices[0].text.startswith(PROMPT)


def test_golden_tokens_and_prompt_logprobs(client, server):
    forced = httpx.post(server.url + "/v1/tokenize", json={"prompt": " purple elephants", "add_special_tokens": False},
                        headers=AUTH).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=len(forced) + 2, temperature=0, logprobs=2,
                                  extra_body={"golden_token_ids": forced, "prompt_logprobs": 1})
    c = r.choices[0]
    assert c.text.startswith(" purple elephants") and len(c.logprobs.tokens) == len(forced) + 2
    assert all(v <= 0 for v in c.logprobs.token_logprobs)
    plp = c.model_extra["prompt_logprobs"]
    assert plp[0] is None and len(plp) == r.usage.prompt_tokens
    assert all(isinstance(v["logprob"], float) and v["rank"] >= 1 for d in plp[1:] for v in d.values())


def test_chat_top_logprobs_shape(client):
    r = client.chat.completions.create(model=MODEL, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3,
                                       messages=[{"role": "user", "content": "Count: 1, 2,"}])
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for c in content:
        assert len(c.top_logprobs) == 3
        vals = [t.logprob for t in c.top_logprobs]
        assert vals == sorted(vals, reverse=True) and c.token == c.top_logprobs[0].token
        assert bytes(c.bytes).decode("utf-8", "replace") == c.token


SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                           "population": {"type": "integer", "minimum": 0, "maximum": 99999999}},
          "required": ["city", "population"], "additionalProperties": False}


@pytest.mark.parametrize("seed", [0, 1])
def test_response_format_json_schema_validates(client, seed):
    r = client.chat.completions.create(
        model=MODEL, max_tokens=64, temperature=0.7, seed=seed,
        messages=[{"role": "user", "content": "Give the largest city of France and its population as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": SCHEMA}})
    assert r.choices[0].finish_reason == "stop", r.choices[0]
    jsonschema.validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_a_schema_xgrammar_cannot_compile_is_a_400_with_its_reason_and_no_source_path(client):
    """The 400 carried xgrammar's C++ source path ("[11:12:51] /project/cpp/regex_converter.cc:94:");
    it gives the reason alone, through the official client."""
    import openai
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": "(?<=x)y"}}}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
                                       response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
    message = e.value.body["message"]
    assert "Lookbehind is not supported yet" in message and e.value.body["param"] == "structured_outputs", message
    assert not re.search(r"\.cc\b|/project/|\[\d\d:\d\d:\d\d\]|RuntimeError", message), message


def test_allowed_token_ids_the_grammar_never_allows_is_a_400_naming_both(client, server):
    """allowed_token_ids and a structured output are both masks (vLLM's reading): where the grammar
    allows none of the ids, the grammar won in silence and the output broke allowed_token_ids. The
    request fails there; the official client reads a 400 naming both."""
    import openai
    ids = httpx.post(server.url + "/v1/tokenize", json={"prompt": " hello world", "add_special_tokens": False},
                     headers=AUTH).json()["tokens"]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Hi"}],
                                       response_format={"type": "json_object"}, extra_body={"allowed_token_ids": ids})
    assert "allowed_token_ids and the structured_outputs grammar have no token in common at output token 0" \
        in e.value.body["message"], e.value.body


def test_json_object_regex_choice_grammar(client):
    msg = [{"role": "user", "content": "Describe a cat as JSON."}]
    r = client.chat.completions.create(model=MODEL, max_tokens=64, temperature=0, messages=msg,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    else:  # cut by max_tokens: still a valid JSON-object prefix
        assert r.choices[0].message.content.lstrip().startswith("{")
    r = client.completions.create(model=MODEL, prompt="Call me at", max_tokens=16, temperature=0,
                                  extra_body={"guided_regex": r"[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", r.choices[0].text)
    r = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=msg,
                                       extra_body={"structured_outputs": {"choice": ["furry", "scaly"]}})
    assert r.choices[0].message.content in ("furry", "scaly")
    r = client.chat.completions.create(model=MODEL, max_tokens=8, temperature=0, messages=msg,
                                       extra_body={"guided_grammar": 'root ::= "yes" | "no"'})
    assert r.choices[0].message.content in ("yes", "no")


def test_n_samples_and_prompt_list(client):
    r = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], n=2, max_tokens=4, logprobs=0, **SAMPLED)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    assert r.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in r.choices)
    assert len(r.model_extra["detent"]["seeds"]) == 4
    # a seeded request is reproducible: the same call gives the same samples
    r2 = client.completions.create(model=MODEL, prompt=["Hello", "Goodbye"], n=2, max_tokens=4, logprobs=0, **SAMPLED)
    assert [c.text for c in r.choices] == [c.text for c in r2.choices]


def _alone_and_among_16(base_url: str):
    import openai
    target = dict(model=MODEL, prompt="The best thing about mornings is", max_tokens=12, logprobs=3, **SAMPLED)

    async def run():
        c = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)
        alone = await c.completions.create(**target)
        others = [dict(model=MODEL, prompt=f"Item {i}: " + "word " * (i * 7 % 40), max_tokens=4 + i % 9,
                       temperature=[0, 1.0, 0.5][i % 3], seed=i) for i in range(16)]
        reqs = others[:7] + [target] + others[7:]
        outs = await asyncio.gather(*(c.completions.create(**r) for r in reqs))
        await c.close()
        return alone.choices[0], outs[7].choices[0]

    a, b = asyncio.run(run())
    return ((a.text, a.logprobs.token_logprobs, a.logprobs.top_logprobs),
            (b.text, b.logprobs.token_logprobs, b.logprobs.top_logprobs))


def test_seeded_request_alone_equals_among_16_concurrent(server):
    alone, among = _alone_and_among_16(server.url)
    assert alone[0] == among[0]  # text
    assert alone[1] == among[1]  # chosen-token logprobs, exact floats
    assert alone[2] == among[2]  # top-3 logprobs


def test_same_check_fails_with_stock_selection(tiny_model):
    """The check above can fail: with --selection stock the batch changes the bits."""
    with launch(real_argv("--model", tiny_model, "--api-key", API_KEY, "--selection", "stock",
                          "--max-model-len", "1024", "--served-model-name", MODEL)) as s:
        alone, among = _alone_and_among_16(s.url)
    assert alone != among


@pytest.mark.parametrize("selection", ["pinned", "stock"])
def test_tp2_server_alone_vs_among_16_concurrent(tiny_model, selection):
    """`detent-serve --tp 2` (two gloo ranks on CPU, the path of `--tp 4` on GPUs):
    the seeded check above through HTTP holds pinned and breaks under stock."""
    with launch(real_argv("--model", tiny_model, "--api-key", API_KEY, "--tp", "2", "--device", "cpu",
                          "--selection", selection, "--max-model-len", "1024", "--served-model-name", MODEL)) as s:
        alone, among = _alone_and_among_16(s.url)
    if selection == "pinned":
        assert alone == among
    else:
        assert alone != among
