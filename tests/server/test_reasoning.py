"""`--reasoning-parser` (server/reasoning.py): the split of a thinking model's
output into `reasoning` and `content`, as `vllm serve` returns it.

Unit: the split of finished outputs, and the stream's pieces adding up to
it exactly for every way of cutting the text into deltas. HTTP (the
official openai client against a real server): outputs forced with
`golden_token_ids` come back split, streamed and not, with
`include_reasoning: false`, with qwen3's `enable_thinking: false`, and
under structured outputs (all content)."""
from __future__ import annotations

import random

import httpx
import pytest

from server_helpers import API_KEY, launch, openai_client, real_argv, token_ids

from detent.server.reasoning import ReasoningParser

AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "smollm2"

SPLITS = {  # text -> (reasoning, content), qwen3 and deepseek_r1 alike while thinking
    "<think>\nStep one.\n</think>\n\nParis.": ("\nStep one.\n", "\n\nParis."),
    "Step one.</think>Paris.": ("Step one.", "Paris."),  # the template opened the block
    "<think>cut short": ("cut short", None),
    "no tags at all": ("no tags at all", None),  # no </think>: still thinking when it stopped
    "a</think>": ("a", None),
    "<think></think>y": ("", "y"),
    "x <think>y</think>z": ("x <think>y", "z"),  # only a leading <think> is dropped
    "  <thi": ("  <thi", None),
    "a </thin": ("a </thin", None),
    "1 < 2 </think> 3 </think> 4": ("1 < 2 ", " 3 </think> 4"),
}


@pytest.mark.parametrize("name", ["qwen3", "deepseek_r1"])
def test_the_split_of_a_finished_output(name):
    p = ReasoningParser(name)
    for text, want in SPLITS.items():
        assert p.split(text) == want, text


def test_qwen3_with_thinking_off_has_no_reasoning():
    off = ReasoningParser.for_request("qwen3", {"enable_thinking": False})
    assert off.split("a</think>b") == (None, "a</think>b")
    assert ReasoningParser.for_request("deepseek_r1", {"enable_thinking": False}).split("a</think>b") == ("a", "b")
    assert ReasoningParser.for_request("qwen3", None).thinking
    with pytest.raises(ValueError, match="deepseek_r1, qwen3"):
        ReasoningParser("granite")


def _streamed(p: ReasoningParser, text: str, cuts: list[int]) -> tuple[str, str, int]:
    s, got, held_steps = p.stream(), ["", ""], 0
    for a, b in zip([0] + cuts, cuts + [len(text)]):
        r, c = s.next(text[a:b], False)
        got[0] += r
        got[1] += c
        held_steps += not (r or c) and a < b
    r, c = s.next("", True)
    return got[0] + r, got[1] + c, held_steps


@pytest.mark.parametrize("thinking", [True, False])
def test_streamed_pieces_add_up_to_the_split(thinking):
    p = ReasoningParser("qwen3", thinking)
    rng = random.Random(7)
    for text in SPLITS:
        want = tuple(v or "" for v in p.split(text))
        for cut in range(len(text) + 1):  # every two-delta cut
            assert _streamed(p, text, [cut])[:2] == want, (text, cut)
        assert _streamed(p, text, list(range(1, len(text))))[:2] == want, text  # a character at a time
        for _ in range(50):
            cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, max(0, len(text) - 1))))
            assert _streamed(p, text, cuts)[:2] == want, (text, cuts)


def test_the_stream_holds_back_only_what_could_still_be_a_tag():
    s = ReasoningParser("qwen3").stream()
    assert s.next("<th", False) == ("", "")  # may open the block
    assert s.next("ink>Let me", False) == ("Let me", "")
    assert s.next(" see </thi", False) == (" see ", "")  # may close it
    assert s.next("nk>\n\n", False) == ("", "\n\n")
    assert s.next("Paris", False) == ("", "Paris")
    assert s.next("", True) == ("", "")


# ---- over HTTP


@pytest.fixture(scope="module")
def thinking_server(tiny_model):
    with launch(real_argv("--model", tiny_model, "--api-key", API_KEY, "--max-model-len", "1024",
                          "--served-model-name", MODEL, "--reasoning-parser", "qwen3",
                          "--trust-request-chat-template")) as s:
        yield s


THOUGHT = "<think>\nThe user greets me. </think>\n\nHello there!"


def _ask(client, server, text, stream=False, **extra):
    ids = token_ids(server, text)
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=len(ids), temperature=0, stream=stream,
        extra_body={"golden_token_ids": ids, **extra})


def test_reasoning_and_content_over_http(thinking_server):
    client = openai_client(thinking_server)
    msg = _ask(client, thinking_server, THOUGHT).choices[0].message
    assert (msg.model_extra["reasoning"], msg.content) == ("\nThe user greets me. ", "\n\nHello there!")
    chunks = list(_ask(client, thinking_server, THOUGHT, stream=True))
    reasoning = "".join(c.choices[0].delta.model_extra.get("reasoning") or "" for c in chunks if c.choices)
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == ("\nThe user greets me. ", "\n\nHello there!")
    assert chunks[-1].choices[0].finish_reason == "length"
    # cut short while thinking: all reasoning
    msg = _ask(client, thinking_server, "<think>\nStill thinking").choices[0].message
    assert (msg.model_extra["reasoning"], msg.content) == ("\nStill thinking", None)

    hidden = _ask(client, thinking_server, THOUGHT, include_reasoning=False).choices[0].message
    assert (hidden.model_extra["reasoning"], hidden.content) == (None, "\n\nHello there!")
    chunks = list(_ask(client, thinking_server, THOUGHT, stream=True, include_reasoning=False))
    assert not any(c.choices[0].delta.model_extra.get("reasoning") for c in chunks if c.choices)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "\n\nHello there!"

    off = _ask(client, thinking_server, "a</think>b", chat_template_kwargs={"enable_thinking": False})
    assert (off.choices[0].message.model_extra["reasoning"], off.choices[0].message.content) == (None, "a</think>b")


def test_a_constrained_output_is_all_content(thinking_server):
    """A grammar binds the output from its first token, so it holds no reasoning block."""
    client = openai_client(thinking_server)
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick"}], max_tokens=5,
                                       temperature=0, extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert r.choices[0].message.content in ("yes", "no")
    assert r.choices[0].message.model_extra["reasoning"] is None


def test_include_reasoning_false_without_a_parser_is_a_400(server):
    r = httpx.post(server.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "include_reasoning": False})
    assert r.status_code == 400 and r.json()["error"]["param"] == "include_reasoning"
    assert "--reasoning-parser" in r.json()["error"]["message"]


def test_reasoning_effort_is_a_template_variable(thinking_server):
    """Chat's `reasoning_effort` and Responses' `reasoning.effort` reach the chat template as
    `reasoning_effort`, as vLLM passes them; one differing from chat_template_kwargs' is a 400."""
    client = openai_client(thinking_server)
    template = "effort={{ reasoning_effort }};{% for m in messages %}{{ m.content }}{% endfor %}"
    want = len(token_ids(thinking_server, "effort=low;Hi"))
    assert want != len(token_ids(thinking_server, "effort=;Hi"))
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                          reasoning_effort="low", extra_body={"chat_template": template})
    assert chat.usage.prompt_tokens == want
    resp = client.responses.create(model=MODEL, input="Hi", max_output_tokens=1, reasoning={"effort": "low"},
                                   extra_body={"chat_template": template})
    assert resp.usage.input_tokens == want
    r = httpx.post(thinking_server.url + "/v1/chat/completions", headers=AUTH, timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "reasoning_effort": "low",
        "chat_template_kwargs": {"reasoning_effort": "high"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning_effort"


def _with_think_tokens(model_dir: str) -> str:
    """The tiny model's tokenizer with `<think>` and `</think>` as single added tokens that are
    not special (they stay in the text), as in Qwen3's vocabulary: two of SmolLM2's unused
    special tokens (ids 7 and 8) renamed, so the model's vocabulary is unchanged."""
    import json
    import os
    names = {7: "<think>", 8: "</think>"}
    path = os.path.join(model_dir, "tokenizer.json")
    tok = json.load(open(path))
    for added in tok["added_tokens"]:
        if added["id"] in names:
            old = added["content"]
            added.update(content=names[added["id"]], special=False)
            tok["model"]["vocab"][names[added["id"]]] = tok["model"]["vocab"].pop(old)
    json.dump(tok, open(path, "w"))
    path = os.path.join(model_dir, "tokenizer_config.json")
    cfg = json.load(open(path))
    for i, name in names.items():
        cfg.get("added_tokens_decoder", {}).get(str(i), {}).update(content=name, special=False)
    cfg["additional_special_tokens"] = [t for t in cfg.get("additional_special_tokens") or []
                                        if t not in ("<gh_stars>", "<issue_start>")]
    json.dump(cfg, open(path, "w"))
    return model_dir


def test_a_constraint_binds_after_a_one_token_think_end(tmp_path):
    """Where `</think>` is one token (Qwen3, DeepSeek-R1), structured outputs bind after the
    reasoning block, as vLLM's: a free reasoning prefix (forced here) that the grammar would
    refuse, then a constrained answer. The same request without the parser is constrained
    from its first token, so the same prefix is refused (the grammar's 400)."""
    from server_helpers import make_tiny_model
    model = _with_think_tokens(make_tiny_model(str(tmp_path / "tiny-think")))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Pick"}], "max_tokens": 24, "temperature": 0,
            "structured_outputs": {"choice": ["yes", "no"]}}
    with launch(real_argv("--model", model, "--api-key", API_KEY, "--max-model-len", "1024",
                          "--served-model-name", MODEL, "--reasoning-parser", "qwen3")) as s:
        think = token_ids(s, "<think>\nmaybe + or -\n</think>")
        assert token_ids(s, "</think>") == [8] and think[-1] == 8
        r = httpx.post(s.url + "/v1/chat/completions", headers=AUTH, timeout=120,
                       json={**body, "golden_token_ids": think})
        assert r.status_code == 200, r.text
        msg = r.json()["choices"][0]["message"]
        assert msg["reasoning"] == "\nmaybe + or -\n" and msg["content"] in ("yes", "no"), msg
    with launch(real_argv("--model", model, "--api-key", API_KEY, "--max-model-len", "1024",
                          "--served-model-name", MODEL)) as s:
        r = httpx.post(s.url + "/v1/chat/completions", headers=AUTH, timeout=120,
                       json={**body, "golden_token_ids": think})
        assert r.status_code == 400 and "not allowed" in r.text, r.text
