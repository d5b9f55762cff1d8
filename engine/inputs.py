"""Prompt types of the offline API, with vLLM's names (`vllm.inputs`)."""
from __future__ import annotations

import operator
import sys
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


_INT_DTYPES = {f"{u}int{b}" for u in ("", "u") for b in (8, 16, 32, 64)}


def token_id_list(name: str, value: Any, what: str = "token ids (integers)") -> list[int]:
    """`value` as a list of token ids, or a ValueError naming `name`. Each id must be
    an integer (int, a NumPy or 0-d torch integer, not a bool in any form): a str would
    otherwise give its characters' digits ("345" as [3, 4, 5]) and a float its truncation."""
    if isinstance(value, (str, bytes)) or not hasattr(value, "__iter__") or getattr(value, "ndim", 1) == 0:
        raise ValueError(f"{name} must be a list of {what}, got {type(value).__name__}")
    if isinstance(value, (list, tuple)) and set(map(type, value)) <= {int}:  # the usual case, at C speed:
        return list(value)  # the element loop below took twice the old int() copy (18 ms for 128k ids)
    dtype = str(getattr(value, "dtype", "")).removeprefix("torch.")
    if dtype == "bool":  # an array or tensor of bools: True is no token 1
        raise ValueError(f"{name} must be a list of {what}, got a bool {type(value).__name__}")
    if dtype in _INT_DTYPES and value.ndim == 1:  # a NumPy or torch vector of ints, at C speed
        return value.tolist()
    out = []
    for t in value:
        if type(t) is int:  # a plain int of a mixed list
            out.append(t)
            continue
        try:
            if _not_an_id(t):
                raise TypeError
            out.append(operator.index(t))
        except TypeError:
            raise ValueError(f"{name} must be a list of {what}, got element {t!r} "
                             f"({type(t).__name__}) at index {len(out)}") from None
    return out


def _not_an_id(t: Any) -> bool:
    """A bool in any form, or a torch tensor not 0-d (operator.index takes a 0-d bool
    tensor as 1, and a one-element vector as its element). No torch imported: no tensor."""
    if isinstance(t, bool):
        return True
    np, torch = sys.modules.get("numpy"), sys.modules.get("torch")
    if np is not None and isinstance(t, np.bool_):
        return True
    return torch is not None and isinstance(t, torch.Tensor) and (t.dtype == torch.bool or t.ndim != 0)


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
