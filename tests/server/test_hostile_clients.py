"""Inputs a hostile-client campaign against the HTTP routes found mishandled, each with the 4xx
or behaviour expected now: vLLM's where it has one, the project's bounds where one client's
request cost the others. In process, over the fake engine: the routes' checks, not the model,
are under test."""
from __future__ import annotations

import pytest
from fake_engine import FakeEngine, FakeTokenizer, fake_state
from starlette.testclient import TestClient

from server_helpers import API_KEY, client_error as _error

from detent.server.app import build_app

AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"prompt": "hi", "max_tokens": 2}


@pytest.fixture(scope="module")
def client():
    with TestClient(build_app(fake_state(api_key=API_KEY))) as c:
        yield c


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


def test_continue_final_message_with_an_explicit_add_generation_prompt_is_a_400(client):
    """vLLM: "Cannot set both `continue_final_message` and `add_generation_prompt` to True." on chat
    and on /tokenize; Detent answered 200, silently dropping add_generation_prompt."""
    both = {"continue_final_message": True, "add_generation_prompt": True}
    for path, body in (("/v1/chat/completions", CHAT), ("/tokenize", {"messages": CHAT["messages"]})):
        err = _error(client.post(path, headers=AUTH, json={**body, **both}))
        assert err["param"] == "continue_final_message" and "add_generation_prompt" in err["message"], err
        # the default (add_generation_prompt left out) or an explicit false still continues the message
        for extra in ({"continue_final_message": True}, {**both, "add_generation_prompt": False}):
            assert client.post(path, headers=AUTH, json={**body, **extra}).status_code == 200


def test_an_empty_tools_array_is_a_400(client):
    """vLLM and OpenAI refuse `tools: []` (400 naming tools); Detent served it as if no tools were
    given. A Responses request's empty tools list is its default, and still means none."""
    for extra in ({"tools": []}, {"tools": [], "tool_choice": "none"}, {"tools": [], "tool_choice": "auto"}):
        err = _error(client.post("/v1/chat/completions", headers=AUTH, json={**CHAT, **extra}))
        assert err["param"] == "tools" and "empty" in err["message"], err
    r = client.post("/v1/responses", headers=AUTH, json={"input": "hi", "max_output_tokens": 2, "tools": []})
    assert r.status_code == 200, r.text


def test_stop_token_ids_reach_the_engine_once_each():
    """stop_token_ids: [7] * 4,000,000 with min_tokens (a 12 MB body) made the engine scan and ban
    4 million ids at every step, the whole batch's: a 30-token neighbour took 47 s instead of 2.
    Repeats mean nothing, so the engine gets each id once, in the order sent."""
    from detent.server.params import sampling_params
    from detent.server.protocol import CompletionRequest
    req = CompletionRequest.model_validate({"prompt": "hi", "stop_token_ids": [7, 3] * 100_000 + [9],
                                            "min_tokens": 2})
    params = sampling_params(req, max_tokens=4, logprobs=None, prompt_logprobs=None, structured=None, vocab_size=100)
    assert params.stop_token_ids == [7, 3, 9]


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_stop_strings_are_bounded_as_a_prompt_is(client, path, body):
    """A million stop strings (9 MB) were searched for in the output at every engine step, slowing
    every request in the batch several times; now, as bad_words, their characters are bounded by
    --max-model-len x --max-chars-per-token (512 x 32 here) and more is a 400 naming stop."""
    err = _error(client.post(path, headers=AUTH, json={**body, "stop": [f"s{i}" for i in range(10_000)]}))
    assert err["param"] == "stop" and "--max-chars-per-token" in err["message"], err
    assert client.post(path, headers=AUTH, json={**body, "stop": [f"s{i}" for i in range(100)]}).status_code == 200
    # one stop string is bounded the same way
    err = _error(client.post(path, headers=AUTH, json={**body, "stop": "x" * (512 * 32 + 1)}))
    assert err["param"] == "stop", err


DEEP = 5000  # arrays nested deeper than Python's recursion limit lets json.loads and json.dumps go


@pytest.mark.parametrize("mode,text", [
    ("f", '{"n": ' + "[" * DEEP + "]" * DEEP + "}"),
    ("required", '[{"name": "f", "parameters": {"n": ' + "[" * DEEP + "]" * DEEP + "}}]"),
])
def test_a_forced_tool_call_nested_too_deep_to_parse_is_content_not_a_500(mode, text):
    """A forced tool call (tool_choice named or "required") over a schema that takes any value, whose
    arguments nest ~980 deep (golden_token_ids forces it; a model with a long context can write it):
    json.loads raised RecursionError and the response was a 500. The stream, as the response, reads
    it as output it cannot parse: the text, no calls. (On the tiny server the 500 came at 980.)"""
    from detent.server.tool_stream import ToolCallStream
    from detent.server.tools import tool_message
    message, finish = tool_message(text, mode, "stop")
    assert message == {"role": "assistant", "content": text, "tool_calls": []} and finish == "stop"
    stream = ToolCallStream(mode)
    stream.opening()
    assert isinstance(stream.next(text, finished=True), list)


@pytest.mark.parametrize("index", ["{not json", "[1, 2]", '{"weight_map": [1]}', '{"weight_map": {"w": 5}}'])
def test_update_weights_with_a_nul_in_the_path_or_a_broken_index_is_a_400(tmp_path, index):
    """POST /v1/update_weights (with --allowed-weight-dir): a path holding "\\u0000" made
    os.path.realpath raise ValueError, and a checkpoint directory whose index file is not an index
    (a trainer's half-written checkpoint) raised from json or dict access: both were 500s. Now 400s
    naming path, like a missing or corrupt checkpoint."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "model.safetensors.index.json").write_text(index)
    class Updatable(FakeEngine):
        def update_weights(self, tensors):
            return len(tensors)

    state = fake_state(Updatable(), api_key=API_KEY, allowed_weight_dirs=(str(tmp_path),))
    with TestClient(build_app(state)) as c:
        err = _error(c.post("/v1/update_weights", headers=AUTH, json={"path": str(tmp_path) + "/x\u0000y"}))
        assert err["param"] == "path" and "NUL" in err["message"], err
        err = _error(c.post("/v1/update_weights", headers=AUTH, json={"path": str(ckpt)}))
        assert err["param"] == "path" and "not a checkpoint index" in err["message"], err
        assert c.get("/health").status_code == 200


def _on_loop_spy(monkeypatch, module, name) -> list[bool]:
    """Replaces module.name with a spy that records, per call, whether an event loop runs in its thread."""
    import asyncio
    import importlib
    mod = importlib.import_module(module)
    real, on_loop = getattr(mod, name), []

    def spy(*a, **k):
        try:
            asyncio.get_running_loop()
            on_loop.append(True)
        except RuntimeError:  # no loop runs in this thread: a worker's
            on_loop.append(False)
        return real(*a, **k)
    monkeypatch.setattr(mod, name, spy)
    return on_loop


@pytest.mark.parametrize("path,body,formatter", [
    ("/v1/chat/completions", {**CHAT, "logprobs": True, "top_logprobs": 2}, "detent.server.chat.chat_logprobs"),
    ("/v1/chat/completions", {**CHAT, "prompt_logprobs": 1}, "detent.server.chat.prompt_logprobs_json"),
    ("/v1/completions", {**COMPLETION, "logprobs": 2}, "detent.server.completions._choice"),
    # echo: n choices each repeat the prompt's text (256 x a 32k-token context: 32 MB, 0.2 s to encode)
    ("/v1/completions", {**COMPLETION, "echo": True, "n": 3}, "detent.server.completions._choice"),
])
def test_a_logprob_response_is_built_off_the_event_loop(client, monkeypatch, path, body, formatter):
    """Up to --max-logprob-entries entries make a body of tens of MB: formatted on the event loop,
    a 51 MB one held /health and every stream for 2.4 s. A response with logprobs is built (and
    encoded) in a worker thread, as is one with echo; one without stays on the loop (no thread hop
    on the common path)."""
    on_loop = _on_loop_spy(monkeypatch, *formatter.rsplit(".", 1))
    r = client.post(path, headers=AUTH, json=body)
    assert r.status_code == 200, r.text
    assert on_loop and not any(on_loop), on_loop
    if path == "/v1/completions":  # without logprobs: built on the loop
        on_loop.clear()
        assert client.post(path, headers=AUTH, json=COMPLETION).status_code == 200
        assert on_loop and all(on_loop), on_loop


def test_a_large_body_is_parsed_checked_and_validated_off_the_event_loop(client, monkeypatch):
    """A 16 MiB body of empty lists (`"x": [[], [], ...]`, or as `prompt`) held the event loop, so
    /health and every stream, for 12 s (json.loads, the depth/Unicode/integer walk, pydantic, all
    in the number of values). A body over 64 KiB is now read on the preprocessing pool; a small
    one stays on the loop (no thread hop on the common path)."""
    on_loop = _on_loop_spy(monkeypatch, "detent.server.serving", "parse_json")
    big = {**COMPLETION, "x": [[]] * 30_000}  # ~120 KB
    assert client.post("/v1/completions", headers=AUTH, json=big).status_code == 200
    err = _error(client.post("/v1/completions", headers=AUTH, json={"prompt": [[]] * 30_000}))  # refused there too
    assert "prompt" in err["message"], err
    assert on_loop == [False, False], on_loop
    on_loop.clear()
    assert client.post("/v1/completions", headers=AUTH, json=COMPLETION).status_code == 200
    assert on_loop == [True], on_loop


def test_a_large_responses_request_becomes_a_chat_request_off_the_event_loop(client, monkeypatch):
    """A Responses request becomes the chat request it means (server/responses_input.py), which
    validates its tools and messages again: 200,000 tools (a 15 MB body, tool_choice "none") held
    the event loop, so /health and every stream, for 1 s. The translation runs where the body is
    validated: on the pool for a body over 64 KiB, on the loop (no thread hop) for a small one."""
    on_loop = _on_loop_spy(monkeypatch, "detent.server.responses", "to_chat_request")
    tools = [{"type": "function", "name": f"f{i}", "description": "d" * 600, "parameters": {"type": "object"}}
             for i in range(128)]  # OpenAI's most, in a body over 64 KiB
    body = {"input": "hi", "max_output_tokens": 2, "tools": tools, "tool_choice": "none"}
    assert client.post("/v1/responses", headers=AUTH, json=body).status_code == 200
    err = _error(client.post("/v1/responses", headers=AUTH, json={**body, "input": [{"type": "web_search_call"}]}))
    assert err["param"] == "input[0].type", err  # its 400s as before
    assert on_loop == [False, False], on_loop
    on_loop.clear()
    assert client.post("/v1/responses", headers=AUTH, json={"input": "hi", "max_output_tokens": 2}).status_code == 200
    assert on_loop == [True], on_loop


@pytest.mark.parametrize("path,body", [("/v1/completions", {**COMPLETION, "prompt": ["a", "bb", "c"]}),
                                       ("/v1/chat/completions", CHAT),
                                       ("/v1/responses", {"input": "hi", "max_output_tokens": 2})])
def test_sampling_params_are_built_off_the_event_loop_once_per_max_tokens(client, monkeypatch, path, body):
    """SamplingParams checks every id and bias a request lists, in Python: 8M allowed_token_ids
    took 1.2 s, and a vocabulary's logit_bias 48 ms per prompt, so 64 prompts held the event loop
    (/health answered after 7 s on the tiny-model server). They are built on the preprocessing
    pool, once for the prompts that share a max_tokens."""
    on_loop = _on_loop_spy(monkeypatch, "detent.server.params", "sampling_params")
    bias = {"logit_bias": {str(i): 1 for i in range(FakeTokenizer.vocab_size)}}
    r = client.post(path, headers=AUTH, json={**body, **bias})
    assert r.status_code == 200, r.text
    assert on_loop == [False], on_loop


def test_allowed_token_ids_reach_the_engine_once_each():
    """As stop_token_ids: repeats mean nothing, and 8M of them were 16 MB to pickle to the engine."""
    from detent.server.params import sampling_params
    from detent.server.protocol import CompletionRequest
    req = CompletionRequest.model_validate({"prompt": "hi", "allowed_token_ids": [7, 3] * 100_000 + [9]})
    params = sampling_params(req, max_tokens=4, logprobs=None, prompt_logprobs=None, structured=None, vocab_size=100)
    assert params.allowed_token_ids == [7, 3, 9]


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)])
def test_an_empty_stop_string_is_named_not_the_whole_list_echoed(client, path, body):
    """Empty stop strings pass the character bound (they have none), and the 400 echoed the whole
    list: 200,000 of them made an 800 KB error message (22 MB from a 16 MiB body), built and
    scanned on the event loop. The message names the first bad entry."""
    for stop, where in (([""] * 200_000, "stop[0]"), (["a", "b", ""], "stop[2]")):
        err = _error(client.post(path, headers=AUTH, json={**body, "stop": stop}))
        assert err["param"] == "stop" and where in err["message"] and len(err["message"]) < 200, err["message"][:300]


@pytest.mark.parametrize("key", [" 1", "1 ", "1_0", "+1", "\u0661", "0x1", "", "1" * 30,
                                 "-0", "-1", "00", "05", "-05"])
def test_logit_bias_keys_are_decimal_token_ids(client, key):
    """int() reads " 1", "1_0", "+1" and the Arabic-Indic "١" as ids, and "-0" and "05" as 0 and 5,
    so such a key was a silent bias on some token (vLLM's int(key) takes them all). A key is a token
    id as OpenAI writes one, non-negative decimal digits with no sign or leading zero; anything else
    is a 400 naming logit_bias and the key."""
    err = _error(client.post("/v1/completions", headers=AUTH, json={**COMPLETION, "logit_bias": {key: 5}}))
    assert err["param"] == "logit_bias" and repr(key) in err["message"], err
    for ok in ("0", "5", "10"):
        r = client.post("/v1/completions", headers=AUTH, json={**COMPLETION, "logit_bias": {ok: 5}})
        assert r.status_code == 200, r.text


@pytest.mark.parametrize("metadata,param", [({f"k{i}": "v" for i in range(17)}, "metadata"),
                                            ({"k" * 65: "v"}, "metadata.kkk"), ({"k": "v" * 513}, "metadata.k")])
def test_responses_metadata_has_openais_bounds(client, metadata, param):
    """Every response object of a Responses request repeats its metadata (three in a stream, encoded
    on the event loop): 700,000 pairs (a 16 MB body) held /health for 0.9 s while the stream was
    written. OpenAI's bounds (16 pairs, keys of at most 64 characters, values of at most 512) are a
    400 naming metadata; metadata within them is echoed as before, and the official client reads the 400."""
    import openai
    body = {"input": "hi", "max_output_tokens": 2}
    err = _error(client.post("/v1/responses", headers=AUTH, json={**body, "metadata": metadata}))
    assert err["param"].startswith(param), err
    ok = {f"{i:02d}" * 32: "v" * 512 for i in range(16)}
    for stream in (False, True):
        r = client.post("/v1/responses", headers=AUTH, json={**body, "metadata": ok, "stream": stream})
        assert r.status_code == 200 and r.text.count('"metadata":{"0000') == (3 if stream else 1), r.text[:300]
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key=API_KEY, http_client=client, max_retries=0)
    with pytest.raises(openai.BadRequestError, match="metadata"):
        sdk.responses.create(model="m", input="hi", max_output_tokens=2, metadata=metadata)


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {**COMPLETION, "logit_bias": {"k" * 1_000_000: "x"}}),
    ("/v1/responses", {"input": "hi", "metadata": {"k" * 1_000_000: "v"}}),
    ("/v1/completions", {**COMPLETION, "x": {"k" * 1_000_000: float("inf")}}),
])
def test_a_long_key_is_cut_in_the_400_that_names_it(client, path, body):
    """A 400 names a wrong value by its path, keys included: a 1M-character key made a 2 MB error
    body (the key in the message and again as param). A key over 64 characters is cut."""
    import json
    r = client.post(path, headers={**AUTH, "Content-Type": "application/json"},
                    content=json.dumps(body).replace("Infinity", "1e999"))
    err = _error(r)
    assert len(r.content) < 1000 and "k" * 64 + "..." in err["param"] and "k" * 65 not in r.text, r.text[:300]


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                                       ("/tokenize", {"prompt": "hi"})])
def test_a_compressed_body_is_a_415_naming_its_encoding(client, path, body):
    """A gzip body (Content-Encoding: gzip) was a 400 quoting Python's decoder: "malformed JSON body:
    'utf-8' codec can't decode byte 0x8b in position 1". The server reads bodies uncompressed: a 415
    that says so; "identity" is no encoding."""
    import gzip
    import json
    raw = json.dumps(body).encode()
    r = client.post(path, content=gzip.compress(raw),
                    headers={**AUTH, "Content-Type": "application/json", "Content-Encoding": "gzip"})
    assert r.status_code == 415, r.text
    err = r.json()["error"]
    assert err["code"] == "unsupported_content_encoding" and "'gzip' is not supported" in err["message"], err
    r = client.post(path, content=raw, headers={**AUTH, "Content-Type": "application/json", "Content-Encoding": "identity"})
    assert r.status_code == 200, r.text


def test_a_conversation_becomes_template_input_off_the_event_loop(client, monkeypatch):
    """A 16 MiB body holds 550,000 empty messages: turning them into the template's dicts took
    0.6 s of the event loop (the rendering after it was already on the pool, and bounded)."""
    on_loop = _on_loop_spy(monkeypatch, "detent.server.chat", "messages_to_dicts")
    assert client.post("/v1/chat/completions", headers=AUTH, json=CHAT).status_code == 200
    err = _error(client.post("/tokenize", headers=AUTH, json={"messages": [{"role": "user", "content": "x" * 9000}] * 2}))
    assert err["param"] == "messages" and "--max-chars-per-token" in err["message"], err  # still refused before rendering
    assert on_loop == [False, False], on_loop


@pytest.mark.parametrize("path,body", [
    ("/v1/completions", {**COMPLETION, "stop_token_ids": ["a"] * 200_000}),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": 5}] * 100_000}),
    ("/detokenize", {"tokens": [0.5] * 200_000}),
])
def test_a_list_of_wrong_items_is_reported_by_its_first(client, path, body):
    """pydantic built one error per wrong item, and listing them (to report eight) held the GIL:
    the 5M errors of a 20 MB `stop_token_ids: ["a", ...]` took 57 s. A list stops at its first."""
    err = _error(client.post(path, headers=AUTH, json=body))
    assert "more fields" not in err["message"] and err["message"].count(";") <= 1, err["message"][:300]


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                                       ("/v1/responses", {"input": "hi", "max_output_tokens": 2})])
def test_golden_token_ids_longer_than_max_tokens_is_a_400_naming_them(client, path, body):
    """The forced ids past max_tokens could never be emitted, yet the request was taken and they
    were dropped in silence. A 400 names golden_token_ids and both counts; as many ids as
    max_tokens is a request. The official client reads the 400."""
    import openai
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key=API_KEY, http_client=client, max_retries=0)
    err = _error(client.post(path, headers=AUTH, json={**body, "golden_token_ids": [3, 4, 5]}))
    assert err["param"] == "golden_token_ids" and "3 ids, more than max_tokens=2" in err["message"], err
    assert client.post(path, headers=AUTH, json={**body, "golden_token_ids": [3, 4]}).status_code == 200
    with pytest.raises(openai.BadRequestError) as e:
        sdk.completions.create(model="m", prompt="hi", max_tokens=1, extra_body={"golden_token_ids": [3, 4]})
    assert e.value.status_code == 400 and e.value.body["param"] == "golden_token_ids", e.value.body


def test_logit_bias_is_bounded_by_the_vocabulary_and_read_to_its_first_wrong_value():
    """1M logit_bias entries of wrong values held /health for 2.9 s: pydantic built an error per
    entry (on the preprocessing pool, holding the GIL all along). An object with more entries than
    the model's vocabulary cannot be valid (each key is a different token id): it is a 400 before
    any entry is read. One within the bound is reported by its first wrong value; a vocabulary's
    worth of biases is a request. The official client reads the 400."""
    import openai
    V = FakeTokenizer.vocab_size
    state = fake_state(api_key=API_KEY, vocab_size=V)
    with TestClient(build_app(state)) as c:
        for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                           ("/v1/responses", {"input": "hi", "max_output_tokens": 2})):
            err = _error(c.post(path, headers=AUTH, json={**body, "logit_bias": {str(i): 1 for i in range(V + 1)}}))
            assert err["param"] == "logit_bias", err
            assert f"{V + 1} entries, more than the model's vocabulary of {V} tokens" in err["message"], err
            err = _error(c.post(path, headers=AUTH, json={**body, "logit_bias": {str(i): "x" for i in range(V)}}))
            assert err["param"] == "logit_bias.0" and "more fields" not in err["message"], err
            assert c.post(path, headers=AUTH, json={**body, "logit_bias": {str(i): 1 for i in range(V)}}).status_code == 200
        err = _error(c.post("/v1/completions", headers=AUTH,
                            json={**COMPLETION, "logit_bias": {str(i): "x" for i in range(1_000_000)}}))
        assert f"1000000 entries, more than the model's vocabulary of {V} tokens" in err["message"], err
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key=API_KEY, http_client=c, max_retries=0)
        with pytest.raises(openai.BadRequestError, match="more than the model's vocabulary"):
            sdk.completions.create(model="m", prompt="hi", max_tokens=1, logit_bias={str(i): 1 for i in range(V + 1)})


@pytest.mark.parametrize("path,body", [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                                       ("/v1/responses", {"input": "hi", "max_output_tokens": 16})])
def test_a_request_id_every_chunk_repeats_is_bounded(client, path, body):
    """Every response (and every streamed chunk, n x max_tokens of them) repeats request_id as its id:
    an 8 MB id streamed 7.7 GB back. Over 512 characters it is a 400 naming it; 512 is served."""
    err = _error(client.post(path, json={**body, "request_id": "x" * 513}, headers=AUTH))
    assert err["param"] == "request_id" and "512" in err["message"], err
    r = client.post(path, json={**body, "request_id": "x" * 512}, headers=AUTH)
    assert r.status_code == 200 and r.json()["id"] == "x" * 512, r.text


@pytest.mark.parametrize("name,field", [("add_generation_prompt", True), ("continue_final_message", True),
                                        ("messages", False), ("range", False)])
def test_chat_template_kwargs_that_the_renderer_sets_itself_are_a_400_naming_them(client, name, field):
    """chat_template_kwargs {"add_generation_prompt": false} reached the renderer beside its own
    argument: a 400 quoting a Python TypeError ("got multiple values for argument"), naming messages."""
    for path, body in (("/v1/chat/completions", CHAT), ("/tokenize", {"messages": CHAT["messages"]})):
        err = _error(client.post(path, json={**body, "chat_template_kwargs": {name: False}}, headers=AUTH))
        assert err["param"] == f"chat_template_kwargs.{name}", err
        assert "sets this template variable itself" in err["message"] and "TypeError" not in err["message"], err
        assert ("request's own field" in err["message"]) == field, err


def test_prompt_logprobs_on_a_chat_stream_are_a_400_not_dropped(client):
    """A chat stream has no place for prompt_logprobs and sent none (computed, counted against the
    logprob entries' bound, never delivered); as vLLM, it is a 400. Without streaming they are served."""
    err = _error(client.post("/v1/chat/completions", json={**CHAT, "prompt_logprobs": 1, "stream": True}, headers=AUTH))
    assert err["param"] == "prompt_logprobs" and "stream" in err["message"], err
    r = client.post("/v1/chat/completions", json={**CHAT, "prompt_logprobs": 1}, headers=AUTH)
    assert r.status_code == 200, r.text


def test_an_integer_of_too_many_digits_and_an_id_outside_the_vocabulary_read_as_the_clients_errors(client):
    """Python's own advice ("use sys.set_int_max_str_digits() to increase the limit") reached the
    client, and /detokenize said "tokens token id ... at index 0 is outside the vocabulary"."""
    r = client.post("/v1/completions", content=b'{"prompt": "hi", "max_tokens": ' + b"1" * 5001 + b"}",
                    headers={**AUTH, "Content-Type": "application/json"})
    assert _error(r)["message"] == "malformed JSON body: an integer has more than 4,300 digits", r.text
    state = fake_state(api_key=API_KEY, vocab_size=FakeTokenizer.vocab_size)
    with TestClient(build_app(state)) as c:
        err = _error(c.post("/detokenize", json={"tokens": [1, 10 ** 6]}, headers=AUTH))
    assert err["param"] == "tokens" and err["message"] == (
        f"tokens contains token id 1000000 (at index 1), outside the vocabulary [0, {FakeTokenizer.vocab_size})"), err


@pytest.mark.parametrize("message,param", [
    ("min_tokens=3 bans EOS and stop_token_ids, and every token ...", "min_tokens"),
    ("allowed_token_ids: every allowed id is a one-token bad word, no token can be sampled", "allowed_token_ids"),
    ("structured_outputs.json nests deeper than 16 levels; the limit is max_schema_depth = 16", "structured_outputs"),
    ("prompt is 900 tokens, longer than max_model_len=512", "prompt"),
    ("the engine is busy", None), ("maximum recursion", None)])
def test_the_engines_refusal_names_the_field_its_message_opens_with(message, param):
    """The engine's admission refusals reached the client with param null; the field a message opens
    with is the param when it is a request field, and none is guessed otherwise."""
    from detent.server.errors import engine_refusal
    e = engine_refusal(ValueError(message))
    assert (e.status, e.param, e.message) == (400, param, message)


def test_head_health_is_the_probe_without_a_body(client):
    """Load balancers probe by HEAD (AWS ALB, HAProxy's option httpchk): HEAD /health was a 405.
    It answers the status GET /health would, with no body: 200 while the engine runs, else 503."""
    r = client.head("/health")
    assert r.status_code == 200 and r.content == b"", (r.status_code, r.content)
    assert client.get("/health").json() == {"status": "ok"}
    r = TestClient(build_app(fake_state())).head("/health")  # no lifespan: the engine never started
    assert r.status_code == 503 and r.content == b"", (r.status_code, r.content)


def test_a_schema_bound_after_the_reasoning_is_not_checked_again_on_the_event_loop(monkeypatch):
    """Under --reasoning-parser a structured output binds after `</think>`: the spec was copied with
    dataclasses.replace, which checked the schema against its meta-schema again, on the event loop
    (223 ms for a legal schema of 1,000 properties, holding /health and every stream). It is checked
    once, on the pool; the copy only takes the ids."""
    class ThinkTokenizer(FakeTokenizer):  # `</think>` is one token, as in the models the parser is for
        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            return [2] if text == "</think>" else super().encode(text, add_special_tokens)
    state = fake_state(tokenizer=ThinkTokenizer(), api_key=API_KEY, reasoning_parser="qwen3")
    on_loop = _on_loop_spy(monkeypatch, "detent.sampling.params", "_check_schema")
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    body = {**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "o", "schema": schema}}}
    with TestClient(build_app(state)) as c:
        assert c.post("/v1/chat/completions", headers=AUTH, json=body).status_code == 200
    assert on_loop == [False], on_loop
