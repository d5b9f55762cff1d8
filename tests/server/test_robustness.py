"""Property-based robustness: generated requests against the live server (issue 23).

Bodies are drawn field by field from the request models themselves
(server/protocol.py): every field gets values of its own type, boundary
values (0, -1, 2**31, 2**63, 2**64, 2**70, 1e308, lone surrogates) and
values of the wrong type, and unknown fields come along. The fields that
decide how much work a valid request does (n, max_tokens, prompt length)
are drawn small, so that a valid request finishes fast and a slow response
means a server bug, not a big job.

Near-valid bodies come too: a valid request with one to three of its fields
set to values of their own type, so that most of them pass validation and
reach the sampler, logprobs, stops, grammars, tools and streams behind it.

Each example sends its bodies concurrently with one good seeded request,
and checks:
- no 5xx, in the status or in-band in a stream;
- every response within RESPONSE_BOUND_S;
- the good request's choices (tokens and logprobs) == its solo run;
and after the run, /health is fine and a plain request works.
"""
from __future__ import annotations

import asyncio
import json
import time
import types
import typing

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from server_helpers import API_KEY

from detent.server.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest, DetokenizeRequest,
                                    ResponsesRequest, TokenizeRequest)

AUTH = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
RESPONSE_BOUND_S = 15.0
GOOD = [{"prompt": f"Once upon a time {i}", "max_tokens": 5, "temperature": 0.9, "seed": 11 + i, "logprobs": 3}
        for i in range(3)]

BIG_INTS = [0, -1, 2**31 - 1, 2**31, 2**53 + 1, 2**63 - 1, 2**63, 2**64 - 1, 2**64, 2**70, -(2**63) - 1, -(2**70)]
INTS = st.one_of(st.integers(-5, 50), st.sampled_from(BIG_INTS), st.integers())
FLOATS = st.one_of(st.floats(allow_nan=False, allow_infinity=False),
                   st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1e-5, 0.5, 1.0, 2.0, 1e4, 1e39, 1e308, -1e308]))
SURROGATE = st.sampled_from(["\ud800", "a\udfffb", "\udc00x"])
TEXT = st.one_of(st.text(max_size=12), SURROGATE, st.sampled_from(["", " ", "\x00", "é世🙂", "</s>", "<|im_end|>"]))
LEAF = st.one_of(st.none(), st.booleans(), INTS, FLOATS, TEXT)
ANY_JSON = st.recursive(LEAF, lambda c: st.one_of(st.lists(c, max_size=3),
                                                  st.dictionaries(st.text(max_size=6), c, max_size=3)), max_leaves=8)

# the fields that set the work of a valid request: drawn small, or invalid
SMALL = st.one_of(st.integers(-2, 4), st.sampled_from(BIG_INTS), ANY_JSON)
TOKEN_IDS = st.lists(st.one_of(st.integers(0, 49151), st.sampled_from([49152, 10**9, -1, 2**64])), max_size=12)
SCHEMAS = st.sampled_from([{"type": "object"}, {"type": "integer"}, {"type": "nonsense"}, {"enum": ["a", "b"]},
                           {"type": "object", "properties": {"x": {"type": "string", "maxLength": 2**70}}},
                           {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}])
OVERRIDES: dict[str, st.SearchStrategy] = {
    "n": SMALL, "best_of": SMALL, "max_tokens": SMALL, "max_completion_tokens": SMALL, "min_tokens": SMALL,
    "max_output_tokens": SMALL,
    "input": st.one_of(TEXT, st.lists(st.one_of(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "developer"]), "content": st.one_of(TEXT, st.lists(
            st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image"]),
                                   "text": TEXT}), max_size=2))},
        optional={"type": st.sampled_from(["message", "function_call", "function_call_output", "reasoning"]),
                  "call_id": TEXT, "output": TEXT, "name": TEXT, "arguments": TEXT}), ANY_JSON), max_size=3)),
    "prompt": st.one_of(TEXT, st.lists(TEXT, max_size=3), TOKEN_IDS, st.lists(TOKEN_IDS, max_size=3), ANY_JSON),
    "tokens": st.one_of(TOKEN_IDS, ANY_JSON),
    "golden_token_ids": st.one_of(st.none(), TOKEN_IDS), "stop_token_ids": st.one_of(st.none(), TOKEN_IDS),
    "guided_json": st.one_of(st.none(), SCHEMAS), "guided_regex": st.one_of(st.none(), st.sampled_from(
        ["[a-z]+", "(unclosed", "a{1,3}b", "\ud800"]), TEXT),
    "guided_choice": st.one_of(st.none(), st.lists(TEXT, max_size=3)),
    "guided_grammar": st.one_of(st.none(), st.sampled_from(['root ::= "yes" | "no"', "root ::= ("])),
    "chat_template_kwargs": st.one_of(st.none(), st.dictionaries(st.sampled_from(["chat_template", "x"]), TEXT,
                                                                max_size=2)),
    "chat_template": st.one_of(st.none(), TEXT),
}


def _strategy(ann: typing.Any) -> st.SearchStrategy:
    """Values of an annotation's type, mixed with values of other types."""
    return st.one_of(_typed(ann), ANY_JSON) if ann is not typing.Any else ANY_JSON


def _typed(ann: typing.Any) -> st.SearchStrategy:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (typing.Union, types.UnionType):
        return st.one_of(*(_typed(a) for a in args))
    if origin is typing.Literal:
        return st.sampled_from(args)
    if origin is list:
        return st.lists(_typed(args[0]), max_size=3)
    if origin is dict:
        return st.dictionaries(st.text(max_size=6), ANY_JSON, max_size=3)
    if isinstance(ann, type) and issubclass(ann, BaseModel):
        return _body(ann)
    return {int: INTS, float: FLOATS, bool: st.booleans(), str: TEXT, type(None): st.none()}.get(ann, ANY_JSON)


def _body(model: type[BaseModel]) -> st.SearchStrategy:
    """A JSON object over `model`'s fields (by alias): each present or not, plus an unknown field."""
    fields = {(f.alias or name): OVERRIDES.get(name, _strategy(f.annotation)) for name, f in model.model_fields.items()}
    if model is ChatMessage:
        fields["role"] = st.one_of(st.sampled_from(["user", "system", "assistant"]), TEXT)
        fields["content"] = st.one_of(TEXT, st.none(), st.lists(st.fixed_dictionaries(
            {"type": st.sampled_from(["text", "image_url"]), "text": TEXT}), max_size=2))
    opt = {k: v for k, v in fields.items() if k not in ("messages", "prompt", "role")}
    req = {k: v for k, v in fields.items() if k in ("messages", "prompt", "role")}
    return st.fixed_dictionaries(req, optional={**opt, "unknown_field": ANY_JSON})


def _bounded(model: type[BaseModel], *limits: str) -> st.SearchStrategy:
    # a chat or Responses request without its output limit runs to the end of the context:
    # always bound it (the first of `limits` set to 3 where none was drawn)
    return _body(model).map(lambda b: b if any(k in b for k in limits) else {**b, limits[0]: 3})


# near-valid bodies: a valid request with one to three fields set to values of their own type, the
# work-setting ones small and valid, so that most pass validation and reach what lies behind it
# (sampling, logprobs, stops, grammars, tools, streaming, the Responses items)
NEAR_OVERRIDES: dict[str, st.SearchStrategy] = {
    **OVERRIDES, **{k: st.integers(1, 3) for k in ("n", "best_of")},
    **{k: st.integers(1, 4) for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")},
    "min_tokens": st.integers(0, 2), "logprobs": st.one_of(st.booleans(), st.integers(0, 5)),
    "top_logprobs": st.integers(0, 5), "prompt_logprobs": st.integers(0, 3),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "seed": INTS,
}
NEAR_BASES = {"/v1/completions": (CompletionRequest, {"prompt": "Hi there", "max_tokens": 3}),
              "/v1/chat/completions": (ChatCompletionRequest, {"messages": [{"role": "user", "content": "Hi"}],
                                                               "max_tokens": 3}),
              "/v1/responses": (ResponsesRequest, {"input": "Hi", "max_output_tokens": 3})}


def _near_valid(path: str) -> st.SearchStrategy:
    model, base = NEAR_BASES[path]
    fields = {(f.alias or name): NEAR_OVERRIDES.get(name, _typed(f.annotation))
              for name, f in model.model_fields.items() if (f.alias or name) not in ("model", "messages", "input")}
    keys = st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3, unique=True)
    return keys.flatmap(lambda ks: st.fixed_dictionaries({**{k: st.just(v) for k, v in base.items()},
                                                          **{k: fields[k] for k in ks}}))


REQUESTS = st.one_of(
    *(st.tuples(st.just(path), _near_valid(path)) for path in NEAR_BASES),
    st.tuples(st.just("/v1/completions"), _body(CompletionRequest)),
    st.tuples(st.just("/v1/chat/completions"), _bounded(ChatCompletionRequest, "max_tokens", "max_completion_tokens")),
    st.tuples(st.just("/v1/responses"), _bounded(ResponsesRequest, "max_output_tokens")),
    st.tuples(st.just("/v1/tokenize"), _body(TokenizeRequest)),
    st.tuples(st.just("/v1/detokenize"), _body(DetokenizeRequest)),
)


async def _send(c: httpx.AsyncClient, path: str, body: dict) -> tuple[int, str, float]:
    t0 = time.monotonic()
    r = await c.post(path, content=json.dumps(body).replace("Infinity", "1e999").encode())
    return r.status_code, r.text, time.monotonic() - t0


@pytest.fixture(scope="module")
def solo(server):
    out = []
    for g in GOOD:
        r = httpx.post(server.url + "/v1/completions", json=g, headers=AUTH, timeout=60)
        assert r.status_code == 200, r.text
        out.append(r.json()["choices"])
    return out


@settings(max_examples=int(__import__("os").environ.get("DETENT_FUZZ_EXAMPLES", "40")), deadline=60_000,
          derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(reqs=st.lists(REQUESTS, min_size=1, max_size=3), which=st.integers(0, len(GOOD) - 1))
def test_generated_requests_never_5xx_stall_or_change_a_good_request(server, solo, reqs, which):
    async def run():
        async with httpx.AsyncClient(base_url=server.url, headers=AUTH, timeout=RESPONSE_BOUND_S * 2) as c:
            return await asyncio.gather(_send(c, "/v1/completions", GOOD[which]),
                                        *(_send(c, path, body) for path, body in reqs))

    (gs, gtext, _), *fuzzed = asyncio.run(run())
    for (path, body), (status, text, took) in zip(reqs, fuzzed):
        assert status < 500 and "internal_server_error" not in text, (path, body, status, text[:500])
        assert took < RESPONSE_BOUND_S, (path, body, took)
    assert gs == 200, gtext
    assert json.loads(gtext)["choices"] == solo[which]


def test_healthy_after_the_generated_requests(server):
    assert httpx.get(server.url + "/health", timeout=10).json() == {"status": "ok"}
    r = httpx.post(server.url + "/v1/completions", json=GOOD[0], headers=AUTH, timeout=60)
    assert r.status_code == 200
