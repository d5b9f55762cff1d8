"""Prompt types of the offline API, with vLLM's names (`vllm.inputs`)."""
from __future__ import annotations

from typing import TypedDict


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
