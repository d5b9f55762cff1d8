"""Tokenizer from a model directory: `tokenizer.json` through `tokenizers`,
special tokens and the chat template from `tokenizer_config.json` (or
`chat_template.jinja`), EOS ids also from `generation_config.json`.

Chat templates render in a sandboxed, immutable jinja2 environment with the
same options and helpers transformers uses, so templates written for
transformers render identically. `IncrementalDetokenizer` streams text and
never emits half of a multi-byte character.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterable, Iterator, Sequence

from tokenizers import Tokenizer as _HFTokenizer


def _content(tok: Any) -> str | None:
    if isinstance(tok, dict):
        return tok.get("content")
    return tok


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


class ChatTemplateError(ValueError):
    pass


@lru_cache(maxsize=16)
def _compile_template(source: str):
    from jinja2 import TemplateError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


# `continue_final_message` (transformers' and vLLM's field): the last message is rendered with this
# tag after its text, and the prompt ends where the tag starts, so a template that keeps spacing keeps
# the message's trailing spaces, and an earlier copy of the same text is never taken for it
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def open_final_message(messages: list[dict]) -> tuple[list[dict], str]:
    """The messages to render for `continue_final_message` (the last one's text, or its last text
    part, followed by the tag), and that text."""
    if not messages:
        raise ValueError("continue_final_message: the conversation is empty")
    msgs = [dict(m) for m in messages]
    content = msgs[-1].get("content")
    if isinstance(content, str):
        msgs[-1]["content"] = content + CONTINUE_TAG
        return msgs, content
    parts = list(content) if isinstance(content, list) else []
    for i in reversed(range(len(parts))):
        if isinstance(parts[i], dict) and isinstance(parts[i].get("text"), str):
            final = parts[i]["text"]
            parts[i] = {**parts[i], "text": final + CONTINUE_TAG}
            msgs[-1]["content"] = parts
            return msgs, final
    raise ValueError("continue_final_message: the last message has no text to continue")


def cut_at_final_message(rendered: str, final: str) -> str:
    """The conversation rendered from `open_final_message`'s messages, cut where the tag starts
    (and right-stripped there when the template trimmed the text's trailing spacing)."""
    if final.strip() not in rendered or CONTINUE_TAG.strip() not in rendered:
        raise ValueError("continue_final_message: the last message's text does not appear in the rendered "
                         "conversation (the chat template drops or changes it)")
    at = rendered.rindex(CONTINUE_TAG.strip())
    return rendered[:at] if rendered.startswith(CONTINUE_TAG, at) else rendered[:at].rstrip()


class Tokenizer:
    def __init__(self, path: str):
        self.path = path
        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise FileNotFoundError(f"no tokenizer.json in {path} (Detent reads fast-tokenizer files; "
                                    f"save one with transformers' tokenizer.save_pretrained)")
        self._tok = _HFTokenizer.from_file(tj)
        cfg = _read_json(os.path.join(path, "tokenizer_config.json"))
        gen = _read_json(os.path.join(path, "generation_config.json"))
        self.config = cfg
        self.bos_token = _content(cfg.get("bos_token"))
        self.eos_token = _content(cfg.get("eos_token"))
        self.pad_token = _content(cfg.get("pad_token"))
        self.chat_template = self._find_template(path, cfg)
        self.bos_token_id = self.token_to_id(self.bos_token) if self.bos_token else None
        eos: list[int] = []
        g = gen.get("eos_token_id")
        for i in ([g] if isinstance(g, int) else (g or [])):
            if i not in eos:
                eos.append(int(i))
        if self.eos_token and self.token_to_id(self.eos_token) is not None:
            e = self.token_to_id(self.eos_token)
            if e not in eos:
                eos.append(e)
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self._special_ids = {t.id if hasattr(t, "id") else i
                             for i, t in self._tok.get_added_tokens_decoder().items() if t.special}

    @classmethod
    def from_pretrained(cls, path: str) -> "Tokenizer":
        return cls(path)

    @staticmethod
    def _find_template(path: str, cfg: dict) -> str | None:
        jinja = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(jinja):
            with open(jinja) as f:
                return f.read()
        t = cfg.get("chat_template")
        if isinstance(t, list):  # [{"name": "default", "template": ...}, ...]
            named = {d.get("name"): d.get("template") for d in t}
            t = named.get("default") or next(iter(named.values()), None)
        if t is None and os.path.isfile(os.path.join(path, "chat_template.json")):
            t = _read_json(os.path.join(path, "chat_template.json")).get("chat_template")
        return t

    # ------------------------------------------------------------ basics
    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, i: int) -> str | None:
        return self._tok.id_to_token(i)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"Tokenizer.encode expects a str, got {type(text).__name__}")
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def is_special(self, i: int) -> bool:
        return i in self._special_ids

    # ------------------------------------------------------- chat template
    def apply_chat_template(self, messages: Iterable[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            **kwargs) -> str:
        """Render a conversation to the prompt string (tokenize it with
        `encode(..., add_special_tokens=False)`, or use `encode_chat`)."""
        return "".join(self.chat_template_chunks(messages, add_generation_prompt, tools, chat_template, **kwargs))

    def chat_template_chunks(self, messages: Iterable[dict], add_generation_prompt: bool = True,
                             tools: list[dict] | None = None, chat_template: str | None = None,
                             **kwargs) -> Iterator[str]:
        """The rendering piece by piece as Jinja produces it, so that a caller
        (the server) can stop a template that runs too long or writes too much."""
        template = chat_template or self.chat_template
        if template is None:
            raise ChatTemplateError(f"the tokenizer at {self.path} has no chat template "
                                    f"(tokenizer_config.json 'chat_template' or chat_template.jinja)")
        from jinja2 import TemplateError
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "",
                   "pad_token": self.pad_token or "", **kwargs,
                   "messages": list(messages), "add_generation_prompt": add_generation_prompt,
                   "tools": tools}
        try:
            yield from _compile_template(template).generate(**context)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None

    def encode_chat(self, messages: Iterable[dict], add_generation_prompt: bool = True, **kw) -> list[int]:
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, **kw),
                           add_special_tokens=False)


class IncrementalDetokenizer:
    """Streams text as tokens arrive. Text is emitted only once it stops
    ending in U+FFFD (an incomplete UTF-8 sequence), so a character split
    across tokens comes out whole. Decoding always includes a few tokens of
    context before the new ones, so spaces that a tokenizer attaches to the
    following token are kept. `finish()` flushes whatever is held back."""

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: Sequence[int] = (),
                 skip_special_tokens: bool = True):
        self.tok = tokenizer
        self.skip = skip_special_tokens
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""  # everything emitted so far

    def _decode(self, a: int, b: int | None = None) -> str:
        return self.tok.decode(self.ids[a:b], skip_special_tokens=self.skip)

    def step(self, token_id: int) -> str:
        """Add one token; return the newly complete text (maybe "")."""
        self.ids.append(int(token_id))
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset)
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += new
            return new
        return ""

    def finish(self) -> str:
        """Flush held-back text at the end of the stream."""
        prefix = self._decode(self.prefix_offset, self.read_offset)
        full = self._decode(self.prefix_offset)
        new = full[len(prefix):] if len(full) > len(prefix) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += new
        return new
