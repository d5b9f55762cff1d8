"""Issue 23 against a live server: bounds on every numeric field, bad Unicode and
JSON, bounded work per request, HTTP hygiene. Each case was a 500, a stall or
an unbounded response before; each now gets a 4xx naming the field and limit,
and the server keeps serving."""
from __future__ import annotations

import asyncio
import json
import socket
import time

import httpx
import pytest

from server_helpers import API_KEY, token_ids

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
MSG = [{"role": "user", "content": "hi"}]
GOOD = {"prompt": "The sky is", "max_tokens": 6, "temperature": 0.8, "seed": 7, "logprobs": 2}


def _raw(server, path, content: bytes, headers=AUTH):
    return httpx.post(server.url + path, content=content, headers=headers, timeout=60)


def _post(server, path, body):
    # ensure_ascii keeps a lone surrogate as the escape "\ud800", legal JSON
    return _raw(server, path, json.dumps(body).encode())


def _err(r, status, *needles, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    for n in needles:
        assert n in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def _healthy(server):
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = _post(server, CMPL, {"prompt": "ok", "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2


def test_poisoned_top_k_is_a_400_and_concurrent_good_requests_equal_their_solo_runs(server):
    """The issue's request overflowed in the sampler and failed every request of its step."""
    poison = {"prompt": "Hi", "max_tokens": 2, "top_k": 1180591620717411303424, "top_p": 0.9}
    goods = [{**GOOD, "seed": s, "prompt": f"Story {s}:"} for s in range(4)]
    solo = [_post(server, CMPL, g).json()["choices"][0] for g in goods]

    async def mixed():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=60) as c:
            bodies = [b for g in goods for b in (poison, g)]
            rs = await asyncio.gather(*(c.post(CMPL, content=json.dumps(b).encode()) for b in bodies))
        return rs[0::2], rs[1::2]

    bad, good = asyncio.run(mixed())
    for r in bad:
        _err(r, 400, "top_k", "64-bit", param="top_k")
    assert [r.json()["choices"][0] for r in good] == solo  # tokens and logprobs, exactly
    _healthy(server)


@pytest.mark.parametrize("path,extra,param,needle", [
    (CMPL, {"top_k": 2**40}, "top_k", "2147483647"),
    (CMPL, {"temperature": 1e39}, "temperature", "10000"),
    (CMPL, {"repetition_penalty": 1e-300}, "repetition_penalty", "0.0001"),
    (CMPL, {"seed": 2**64}, "seed", "64-bit"),
    (CMPL, {"seed": -(2**63) - 1}, "seed", "64-bit"),
    (CMPL, {"n": 10**6}, "n", "--max-n"),
    (CMPL, {"best_of": 10**6}, "best_of", "--max-n"),
    (CMPL, {"max_tokens": 2**40}, "max_tokens", "2147483647"),
    (CMPL, {"logprobs": 10**12}, "logprobs", "20"),
    (CMPL, {"prompt_logprobs": 21}, "prompt_logprobs", "20"),
    (CMPL, {"min_tokens": 2**62}, "min_tokens", "min_tokens"),
    (CMPL, {"stop_token_ids": [2**63]}, "stop_token_ids", "2147483647"),
    (CMPL, {"presence_penalty": 1e308}, "presence_penalty", "[-2, 2]"),
    (CMPL, {"frequency_penalty": -1e308}, "frequency_penalty", "[-2, 2]"),
    (CMPL, {"top_p": 1e308}, "top_p", "(0, 1]"),
    (CMPL, {"min_p": -1e-300}, "min_p", "[0, 1]"),
    (CHAT, {"top_logprobs": 10**9, "logprobs": True}, "top_logprobs", "20"),
    (CHAT, {"max_completion_tokens": 2**60}, "max_completion_tokens", "2147483647"),
    (CHAT, {"temperature": 1e999}, "temperature", "finite"),
])
def test_every_numeric_field_is_bounded(server, path, extra, param, needle):
    base = {"prompt": "x", "max_tokens": 2} if path == CMPL else {"messages": MSG, "max_tokens": 2}
    if "max_completion_tokens" in extra:
        base.pop("max_tokens")
    r = _raw(server, path, json.dumps({**base, **extra}).replace("Infinity", "1e999").encode())
    err = _err(r, 400, needle)
    assert param in err["message"] and err["param"] == param, err
    _healthy(server)


@pytest.mark.parametrize("path,body,param", [
    (CMPL, {"prompt": "a\ud800b", "max_tokens": 2}, "prompt"),
    (CMPL, {"prompt": ["ok", "a\udfffb"], "max_tokens": 2}, "prompt[1]"),
    (CMPL, {"prompt": "a\ud800", "max_tokens": 2, "stream": True}, "prompt"),
    (CHAT, {"messages": [{"role": "user", "content": "x\ud800"}], "max_tokens": 2}, "messages[0].content"),
    (CHAT, {"messages": [{"role": "user", "content": "x\ud800"}], "max_tokens": 2, "stream": True},
     "messages[0].content"),
    (CMPL, {"prompt": "ok", "max_tokens": 2, "request_id": "id\ud800"}, "request_id"),
    (CMPL, {"prompt": "ok", "max_tokens": 2, "model": "\ud800"}, "model"),
    (CMPL, {"prompt": "ok", "max_tokens": 2, "stop": ["\udc00"]}, "stop[0]"),
    ("/v1/tokenize", {"prompt": "a\ud800"}, "prompt"),
    # in a key: the error names it escaped (as itself the 400's body could not be encoded: a 500)
    (CMPL, {"prompt": "ok", "max_tokens": 2, "x\ud800": 1}, "x\\ud800"),
    (CHAT, {"messages": [{"role": "user", "content": "x", "\udfff": 1}], "max_tokens": 2}, "messages[0].\\udfff"),
])
def test_lone_surrogates_are_400(server, path, body, param):
    _err(_post(server, path, body), 400, "surrogate", param=param)
    _healthy(server)


@pytest.mark.parametrize("content,needle", [
    (b'{"prompt": "x", "max_tokens": ' + b"7" * 5000 + b"}", "digits"),
    (b'{"prompt": "x", "seed": ' + b"9" * 30 + b"}", "64-bit"),
    (b'{"prompt": "x", "temperature": NaN}', "NaN"),
    (b'{"prompt": "x", "guided_json": ' + b'{"a":' * 100_000 + b"1" + b"}" * 100_000 + b"}", "nested deeper"),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested deeper"),
    (b'{"prompt": "x", "guided_json": ' + b'{"a":' * 70 + b"1" + b"}" * 70 + b"}", "nested deeper than 64"),
])
def test_pathological_json_is_400(server, content, needle):
    _err(_raw(server, CMPL, content), 400, needle)
    _healthy(server)


def test_404_and_405_in_the_openai_error_shape(server):
    err = _err(httpx.get(server.url + "/v1/nope", headers=AUTH), 404, "/v1/nope")
    assert err["type"] == "not_found_error"
    r = httpx.get(server.url + CMPL, headers=AUTH)
    err = _err(r, 405, "GET", CMPL)
    assert "POST" in r.headers.get("allow", "")


def test_body_slower_than_its_content_length_times_out_408(server):
    """The fixture runs with --request-timeout 3: a stalled upload is answered and closed."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + API_KEY.encode() +
                  b"\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": ")
        t0 = time.time()
        data = b""
        while b"\r\n\r\n" not in data or not data.rstrip().endswith(b"}"):
            chunk = s.recv(65536)
            if not chunk:
                break
            data += chunk
        took = time.time() - t0
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), data
    assert b"connection: close" in head.lower()
    assert b"--request-timeout" in body and 2.5 < took < 10, (took, data)
    _healthy(server)


def test_prompt_characters_are_bounded_before_tokenizing(server):
    """max-model-len 1024 x 32 characters per token: a longer prompt is refused untokenized, fast."""
    t0 = time.time()
    err = _err(_post(server, CMPL, {"prompt": "ab " * 300_000, "max_tokens": 2}), 400, "--max-chars-per-token",
               "32768", param="prompt")
    assert err["code"] == "context_length_exceeded" and time.time() - t0 < 2
    _err(_post(server, "/v1/tokenize", {"prompt": "z" * 40_000}), 400, "--max-chars-per-token")
    _err(_post(server, CHAT, {"messages": [{"role": "user", "content": "q " * 20_000}]}), 400,
         "--max-chars-per-token", param="messages")
    _healthy(server)


@pytest.mark.parametrize("extra,param", [
    ({"chat_template_kwargs": {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"}},
     "chat_template_kwargs.chat_template"),
    ({"chat_template": "{{ messages[0].content }}"}, "chat_template"),
])
def test_client_chat_templates_are_refused_without_the_flag(server, extra, param):
    _err(_post(server, CHAT, {"messages": MSG, "max_tokens": 2, **extra}), 400,
         "--trust-request-chat-template", param=param)
    _err(_post(server, "/v1/tokenize", {"messages": MSG, **extra}), 400, "--trust-request-chat-template")
    # the model's own template still takes kwargs
    r = _post(server, CHAT, {"messages": MSG, "max_tokens": 2, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200, r.text


def test_caps_on_prompts_sequences_and_logprob_volume(server):
    _err(_post(server, CMPL, {"prompt": ["a"] * 65, "max_tokens": 1}), 400, "65 prompts", "--max-prompts-per-request",
         param="prompt")
    _err(_post(server, CMPL, {"prompt": [[1, 2]] * 64, "max_tokens": 1, "n": 5}), 400, "320 sequences",
         "--max-sequences-per-request", param="n")
    # 1,000 prompt tokens x (20 + 1) x n=50 copies of the echoed prompt > 1,000,000 values
    ids = [5 + i % 1000 for i in range(1000)]
    _err(_post(server, CMPL, {"prompt": ids, "max_tokens": 1, "n": 50, "echo": True, "logprobs": 20}), 400,
         "--max-logprob-entries", param="prompt_logprobs")
    r = _post(server, CMPL, {"prompt": ids[:10], "max_tokens": 1, "n": 2, "echo": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    _healthy(server)


@pytest.mark.parametrize("path,body", [
    (CMPL, {"prompt": "The sky is", "max_tokens": 12, "temperature": 0, "ignore_eos": True}),
    (CHAT, {"messages": MSG, "max_tokens": 12, "temperature": 0, "ignore_eos": True}),
    ("/v1/responses", {"input": "hi", "max_output_tokens": 12, "temperature": 0, "ignore_eos": True}),
])
def test_requests_sharing_a_request_id_are_served_each_as_if_alone(server, path, body):
    """A client's request_id need not be unique (a retry, a trace id on several requests), as
    in vLLM, whose engine ids carry a random suffix. The near-valid fuzz (test_robustness.py)
    found the second of two such requests refused with a 400 whose clean-up cancelled the
    first, whose response then never came."""
    body = {**body, "request_id": "dup"}

    def text(r):
        d = r.json()
        if "choices" in d:
            return d["choices"][0].get("text") or d["choices"][0]["message"]["content"]
        return d["output"][0]["content"][0]["text"]

    solo = _post(server, path, body)
    assert solo.status_code == 200, solo.text

    async def both():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=30) as c:
            first = asyncio.ensure_future(c.post(path, content=json.dumps(body).encode()))
            await asyncio.sleep(0.05)  # the first is admitted
            second = await c.post(path, content=json.dumps(body).encode())
            return await first, second

    for r in asyncio.run(both()):
        assert r.status_code == 200, r.text
        assert r.json()["id"] == "dup" and text(r) == text(solo)  # greedy: the solo run's output
    _healthy(server)


@pytest.mark.parametrize("extra", [
    {"tool_choice": {"type": "function", "function": {"name": ["get_weather"]}}},
    {"tool_choice": {"type": "function", "function": {"name": {"n": 1}}}},
])
def test_a_tool_choice_naming_a_function_by_a_non_string_is_400(server, extra):
    """The fuzz found a list or object name a 500 (unhashable, looked up among the tools' names)."""
    body = {"messages": MSG, "max_tokens": 2, "tools": [{"type": "function", "function": {"name": "get_weather"}}]}
    _err(_post(server, CHAT, {**body, **extra}), 400, "tool_choice", param="tool_choice")
    _healthy(server)


def _sse_data(text: str) -> list[str]:
    return [ln[6:] for ln in text.splitlines() if ln.startswith("data: ")]


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_call_whose_json_holds_a_lone_surrogate_escape_is_answered(server, stream):
    """The model's JSON may escape a lone surrogate ("\\ud800"): json.loads makes it one, which
    the response could not encode (a 500, or a stream cut off mid-body). It is written back
    as the same escape. Forced with golden_token_ids through tool_choice "required"."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}, "required": ["a"]}}}]
    forced = token_ids(server, '[{"name": "f", "parameters": {"a": "x\\ud800"}}]')
    body = {"messages": MSG, "tools": tools, "tool_choice": "required", "golden_token_ids": forced,
            "max_tokens": len(forced), "stream": stream}
    r = _post(server, CHAT, body)
    assert r.status_code == 200, r.text
    if stream:
        data = _sse_data(r.text)
        assert data[-1] == "[DONE]", r.text[-500:]
        args = "".join(tc["function"].get("arguments") or "" for d in data[:-1]
                       for c in json.loads(d)["choices"] for tc in c["delta"].get("tool_calls") or [])
    else:
        (call,) = r.json()["choices"][0]["message"]["tool_calls"]
        args = call["function"]["arguments"]
    assert json.loads(args) == {"a": "x\ud800"}
    _healthy(server)
