"""Tokenizer, chat template and incremental detokenization against
transformers' tokenizer on the same files."""
import os
import shutil

import pytest

from detent.models import IncrementalDetokenizer, Tokenizer
from detent.models.tokenizer import ChatTemplateError

TEXTS = ["Hello, world!", "  leading spaces and\ttabs\n\nnewlines", "héllo 世界 🙂",
         "<|im_start|>user\nhi<|im_end|>", "def f(x):\n    return x ** 2  # ünïcödé", ""]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "and 3+3?"}],
]


@pytest.fixture(scope="module")
def hf_tok(embedded_dir):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(embedded_dir)


def test_encode_decode_match_transformers(embedded_tokenizer, hf_tok):
    for text in TEXTS:
        ids = embedded_tokenizer.encode(text)
        assert ids == hf_tok(text)["input_ids"], text
        assert embedded_tokenizer.decode(ids) == hf_tok.decode(ids, skip_special_tokens=True)
        assert embedded_tokenizer.decode(ids, skip_special_tokens=False) == hf_tok.decode(ids)
    assert embedded_tokenizer.vocab_size == len(hf_tok) == 49152


def test_special_tokens_and_eos(embedded_tokenizer):
    t = embedded_tokenizer
    assert t.eos_token == "<|im_end|>" and t.eos_token_ids == (2,)
    assert t.token_to_id("<|im_start|>") == 1 and t.is_special(2)


def test_chat_template_matches_transformers(embedded_tokenizer, hf_tok):
    for conv in CONVERSATIONS:
        for gen in (True, False):
            want = hf_tok.apply_chat_template(conv, add_generation_prompt=gen, tokenize=False)
            assert embedded_tokenizer.apply_chat_template(conv, add_generation_prompt=gen) == want
        want_ids = hf_tok.apply_chat_template(conv, add_generation_prompt=True, tokenize=True,
                                              return_dict=False)
        assert embedded_tokenizer.encode_chat(conv) == list(want_ids)


def _continued(tok, conv, **kw):
    from detent.models.tokenizer import cut_at_final_message, open_final_message
    msgs, final = open_final_message(conv)
    return cut_at_final_message(tok.apply_chat_template(msgs, add_generation_prompt=False, **kw), final)


def test_continue_final_message_cuts_where_transformers_does(embedded_tokenizer, hf_tok):
    from detent.models.tokenizer import CONTINUE_TAG, open_final_message
    for last in ("The capital is", "  spaced, and repeated: is  ", "is", "and 3+3?"):
        conv = CONVERSATIONS[1] + [{"role": "assistant", "content": last}]
        want = hf_tok.apply_chat_template(conv, continue_final_message=True, tokenize=False)
        assert _continued(embedded_tokenizer, conv) == want, last
    parts = [{"type": "text", "text": "first"}, {"type": "image"}]  # content parts: the last text part
    msgs, final = open_final_message([{"role": "assistant", "content": parts}])
    assert final == "first" and msgs[0]["content"][0]["text"] == "first" + CONTINUE_TAG and parts[0]["text"] == "first"
    upper = "{% for m in messages %}{{ m.content | upper }}{% endfor %}"
    conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "lower"}]
    with pytest.raises(ValueError):
        hf_tok.apply_chat_template(conv, chat_template=upper, continue_final_message=True, tokenize=False)
    with pytest.raises(ValueError, match="continue_final_message"):
        _continued(embedded_tokenizer, conv, chat_template=upper)


TOOLS_TEMPLATE = (
    "{%- for m in messages %}{% if loop.index0 > 5 %}{% break %}{% endif %}"
    "<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>\n{% endfor %}"
    "{%- if tools %}TOOLS: {{ tools | tojson }}{{ tools[0] | tojson(indent=2) }}{% endif %}"
    "{%- if add_generation_prompt %}<assistant>{{ bos_token }}{% endif %}")


def test_custom_template_features_match_transformers(embedded_dir, tmp_path):
    """tojson (non-ASCII kept, indent), loop controls, tools, trim/lstrip
    blocks: rendered as transformers renders them."""
    d = tmp_path / "tok"
    d.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(embedded_dir, f), d / f)
    (d / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    from transformers import AutoTokenizer
    hf = AutoTokenizer.from_pretrained(d)
    ours = Tokenizer(str(d))
    tools = [{"type": "function", "function": {"name": "météo", "parameters": {"city": "str"}}}]
    conv = CONVERSATIONS[1]
    assert ours.apply_chat_template(conv, tools=tools) == \
        hf.apply_chat_template(conv, tools=tools, add_generation_prompt=True, tokenize=False)


def test_chat_template_is_sandboxed(embedded_tokenizer):
    msgs = CONVERSATIONS[0]
    with pytest.raises(ChatTemplateError):
        embedded_tokenizer.apply_chat_template(
            msgs, chat_template="{{ ''.__class__.__mro__[1].__subclasses__() }}")
    with pytest.raises(ChatTemplateError):  # immutable: templates cannot mutate the messages
        embedded_tokenizer.apply_chat_template(msgs, chat_template="{{ messages.append(1) }}")
    assert msgs == CONVERSATIONS[0]
    with pytest.raises(ChatTemplateError, match="no system role"):
        embedded_tokenizer.apply_chat_template(
            msgs, chat_template="{{ raise_exception('no system role') }}")


def test_missing_template_and_tokenizer_errors(tmp_path, embedded_dir):
    shutil.copy(os.path.join(embedded_dir, "tokenizer.json"), tmp_path / "tokenizer.json")
    t = Tokenizer(str(tmp_path))
    with pytest.raises(ChatTemplateError, match="has no chat template"):
        t.apply_chat_template(CONVERSATIONS[0])
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer(str(tmp_path / "nowhere"))


def _stream(tok, ids, prompt=()):
    det = IncrementalDetokenizer(tok, prompt_ids=prompt)
    pieces = [det.step(i) for i in ids] + [det.finish()]
    return pieces, det.text


def test_streaming_detokenization_is_byte_exact(embedded_tokenizer):
    tok = embedded_tokenizer
    text = "héllo 世界 🙂"
    ids = tok.encode(text)
    # the emoji and CJK characters are split across tokens: decoding token by
    # token on its own would emit broken characters
    assert any("\ufffd" in tok.decode([i]) for i in ids)
    pieces, streamed = _stream(tok, ids)
    assert streamed.encode("utf-8") == text.encode("utf-8")
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_streaming_after_a_prompt_keeps_spaces(embedded_tokenizer):
    tok = embedded_tokenizer
    prompt = tok.encode("Say something:")
    out = tok.encode(" Bonjour, ça va? 👋🏽 très bien — 日本語も OK.")
    pieces, streamed = _stream(tok, out, prompt)
    assert streamed == tok.decode(out)
    assert all("\ufffd" not in p for p in pieces)


def test_an_incomplete_character_is_flushed_at_the_end(embedded_tokenizer):
    tok = embedded_tokenizer
    ids = tok.encode("ok 世界")
    cut = next(k for k in range(1, len(ids)) if tok.decode(ids[:k]).endswith("\ufffd"))
    pieces, streamed = _stream(tok, ids[:cut])
    assert streamed == tok.decode(ids[:cut])  # held back while streaming, emitted by finish()
    assert "\ufffd" not in "".join(pieces[:-1]) and pieces[-1].endswith("\ufffd")
