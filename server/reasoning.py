"""`--reasoning-parser`: a thinking model's chat output split into `reasoning`
and `content`, as `vllm serve --reasoning-parser NAME` returns them.

Both parsers read `<think>…</think>`:
- `deepseek_r1` (DeepSeek-R1, QwQ): everything before `</think>` is
  reasoning, and an output without `</think>` (cut short while thinking)
  is all reasoning;
- `qwen3`: the same, except that a request whose
  `chat_template_kwargs.enable_thinking` is false has no reasoning (all of
  its output is content), since the template closed the thinking block in
  the prompt.

A leading `<think>` (older templates let the model write it) is dropped.
The split is made on the text, not on token ids, so it does not depend on
`</think>` being one token. The stream holds back a text tail that could
still become `<think>` or `</think>`, so its `reasoning` and `content`
pieces add up to the non-streamed fields exactly.

Only the response is split: the tokens, logprobs and the request log are
the model's output as generated, so `detent verify` is unaffected.
"""
from __future__ import annotations

from dataclasses import dataclass

from detent.server.formatting import tag_tail

PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    thinking: bool = True  # qwen3 with enable_thinking false: no reasoning block in the output

    def __post_init__(self) -> None:
        if self.name not in PARSERS:
            raise ValueError(f"unknown reasoning parser {self.name!r}; Detent has {', '.join(PARSERS)}")

    @classmethod
    def for_request(cls, name: str, template_kwargs: dict | None) -> "ReasoningParser":
        thinking = name != "qwen3" or (template_kwargs or {}).get("enable_thinking", True) is not False
        return cls(name, thinking)

    def split(self, text: str) -> tuple[str | None, str | None]:
        """(reasoning, content) of a finished output; None where a part is absent."""
        if not self.thinking:
            return None, text
        body = _after_start(text)
        reasoning, end, content = body.partition(END)
        if not end:  # still thinking when it stopped
            return body, None
        return reasoning, content or None

    def span(self, text: str) -> tuple[int, int] | None:
        """Where `split`'s reasoning lies in `text`: its first and end character offsets (None: no reasoning)."""
        if not self.thinking:
            return None
        body = _after_start(text)
        start = len(text) - len(body)
        return start, start + len(body.partition(END)[0])

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self)


def _after_start(text: str) -> str:
    s = text.lstrip()
    return s[len(START):] if s.startswith(START) else text


class ReasoningStream:
    """One choice's stream: `next(text_delta, finished)` -> (reasoning piece, content piece)."""

    def __init__(self, parser: ReasoningParser):
        self.parser = parser
        self.text = ""
        self.sent = ("", "")  # the reasoning and content sent so far

    def _settled(self) -> tuple[str, str]:
        """The split of the text so far that no later text can change."""
        if not self.parser.thinking:
            return "", self.text
        s = self.text.lstrip()
        if len(s) < len(START) and START.startswith(s):
            return "", ""  # may still open with <think>, which is not reasoning text
        body = _after_start(self.text)
        reasoning, end, content = body.partition(END)
        if end:
            return reasoning, content
        return body[:len(body) - tag_tail(body, END)], ""

    def next(self, delta: str, finished: bool) -> tuple[str, str]:
        self.text += delta
        if finished:
            r, c = self.parser.split(self.text)
            now = (r or "", c or "")
        else:
            now = self._settled()
        pieces = tuple(new[len(old):] for new, old in zip(now, self.sent))
        assert all(new.startswith(old) for new, old in zip(now, self.sent)), "a sent piece changed"
        self.sent = now
        return pieces
