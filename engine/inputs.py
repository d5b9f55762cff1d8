"""Prompt types of the offline API, with vLLM's names (`vllm.inputs`)."""
from __future__ import annotations

import operator
from typing import Any, TypedDict


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


# the optional key sits in a total=False subclass (NotRequired needs Python 3.11)
class TokensPrompt(_TokenIds, total=False):
    """A prompt given as token ids: `{"prompt_token_ids": [...]}`; `prompt`, when
    given, is the text they came from (returned as `RequestOutput.prompt`)."""
    prompt: str


class TextPrompt(TypedDict):
    """A prompt given as text, tokenized with the model's tokenizer."""
    prompt: str


def token_id_list(name: str, value: Any, what: str = "token ids (integers)") -> list[int]:
    """`value` as a list of token ids, or a ValueError naming `name`. Each id must be
    an integer (int, a NumPy or 0-d torch integer, not a bool): a str would otherwise
    give its characters' digits ("345" as [3, 4, 5]) and a float its truncation."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__"):
        raise ValueError(f"{name} must be a list of {what}, got {type(value).__name__}")
    if isinstance(value, (list, tuple)) and set(map(type, value)) <= {int}:  # the usual case, at C speed:
        return list(value)  # the element loop below took twice the old int() copy (18 ms for 128k ids)
    out = []
    for t in value:
        try:
            if isinstance(t, bool) or type(t).__name__ == "bool_":
                raise TypeError
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"{name} must be a list of {what}, got element {t!r} "
                             f"({type(t).__name__}) at index {len(out)}") from None
    return out


def text_content(content: Any, where: str) -> str:
    """A chat message's content as the template's string: a string; None (an assistant turn
    that only called tools) as "", as vLLM; OpenAI's content parts joined, text parts only,
    or a ValueError naming the part (`where`: "messages[i].content")."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, (list, tuple)):
        raise ValueError(f"{where} must be a string or a list of text parts, got {type(content).__name__}")
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{where}[{j}]: only text parts are supported (type 'text' with a string 'text')")
        parts.append(part["text"])
    return "".join(parts)
