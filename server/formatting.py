"""Engine outputs in OpenAI's shapes: logprobs, usage, stream deltas.

The engine reports, per generated token, a dict token id -> Logprob
(`.logprob`, `.rank`) holding the chosen token and the top k. Completions
want `{tokens, token_logprobs, top_logprobs, text_offset}`; chat wants
`{content: [{token, logprob, bytes, top_logprobs: [...]}]}`.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence


def tag_tail(text: str, tag: str) -> int:
    """How many trailing characters of `text` could be the start of `tag` (a proper prefix of it):
    what a stream holds back until it knows (reasoning tags, tool-call tags)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _lp(x: Any) -> float:
    v = float(getattr(x, "logprob", x))
    return v if math.isfinite(v) else -9999.0  # JSON has no -inf; OpenAI clients expect numbers


def _ranked(d: dict[int, Any]) -> list[tuple[int, Any]]:
    return sorted(d.items(), key=lambda kv: (getattr(kv[1], "rank", 0) or 0, -_lp(kv[1]), kv[0]))


class TokenText:
    """Token id -> its text for logprobs (decoded alone, as vLLM reports it)."""

    def __init__(self, decode: Callable[[list[int]], str], as_ids: bool = False):
        self._decode, self.as_ids = decode, as_ids
        self._cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        if self.as_ids:
            return f"token_id:{tid}"
        s = self._cache.get(tid)
        if s is None:
            s = self._cache[tid] = self._decode([tid])
        return s


def completion_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Any] | None],
                        tok: TokenText, text_offset0: int = 0) -> dict[str, Any]:
    tokens, token_lps, tops, offsets = [], [], [], []
    off = text_offset0
    for tid, d in zip(token_ids, logprobs):
        s = tok(tid)
        tokens.append(s)
        offsets.append(off)
        off += len(s)
        if d is None:  # the first prompt token has no logprob
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(_lp(d[tid]) if tid in d else None)
        tops.append({tok(t): _lp(v) for t, v in _ranked(d)})
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(token_ids: Sequence[int], logprobs: Sequence[dict[int, Any]], top_k: int,
                  tok: TokenText) -> dict[str, Any]:
    content = []
    for tid, d in zip(token_ids, logprobs):
        s = tok(tid)
        top = [{"token": tok(t), "logprob": _lp(v), "bytes": list(tok(t).encode("utf-8"))}
               for t, v in _ranked(d)[:top_k]]
        content.append({"token": s, "logprob": _lp(d[tid]) if tid in d else None,
                        "bytes": list(s.encode("utf-8")), "top_logprobs": top})
    return {"content": content}


def prompt_logprobs_json(prompt_logprobs: Sequence[dict[int, Any] | None] | None,
                         tok: TokenText) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` field: per prompt position, token id -> {logprob, rank, decoded_token}."""
    if prompt_logprobs is None:
        return None
    return [None if d is None else
            {str(t): {"logprob": _lp(v), "rank": getattr(v, "rank", None), "decoded_token": tok(t)}
             for t, v in _ranked(d)} for d in prompt_logprobs]


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


class ChoiceDelta:
    """What one choice has already streamed; gives the next delta.

    With stop strings the last `max_stop_len - 1` characters are held back
    until the request finishes: they may turn out to be the start of a stop
    string the final text drops, and streamed chunks must concatenate to
    exactly the non-streamed text.
    """

    def __init__(self, stop: Sequence[str] | None, include_stop: bool):
        self.hold = 0 if include_stop or not stop else max(len(s) for s in stop) - 1
        self.text_len = 0
        self.num_tokens = 0

    def next(self, text: str, num_tokens: int, finished: bool) -> tuple[str, int, int]:
        """(new text, first new token index, end token index)."""
        end = len(text) if finished else max(self.text_len, len(text) - self.hold)
        delta = text[self.text_len:end]
        self.text_len = max(self.text_len, end)
        t0, self.num_tokens = self.num_tokens, num_tokens
        return delta, t0, num_tokens
