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
