"""How a chat choice's generated text becomes the response's message, or its
stream of deltas.

The text passes through up to two readers, in this order:
1. the reasoning parser (`--reasoning-parser`, server/reasoning.py) takes
   the `<think>` block out as `reasoning`;
2. what is left, the content, is read for tool calls: forced ones
   (`tool_choice` "required" or a named function, whose output the grammar
   shaped; server/tools.py, server/tool_stream.py) or, with
   `--enable-auto-tool-choice`, the ones the model chose to write
   (`--tool-call-parser`, server/tool_parsers.py).

Streamed, every reader holds back what it cannot yet place, so the deltas
add up to the non-streamed message exactly. None of this touches the
tokens, logprobs or the request log: `detent verify` sees the model's output.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from detent.server.reasoning import ReasoningParser
from detent.server.tool_parsers import AutoToolStream, extract_tool_calls
from detent.server.tool_stream import ToolCallStream, call_id, stream_finish_reason
from detent.server.tools import tool_message


@dataclass(frozen=True)
class ChatOutput:
    reasoner: ReasoningParser | None = None  # this request's split, or None (no parser, or constrained)
    reasoning_field: bool = False  # the server runs a reasoning parser: messages always carry `reasoning`
    include_reasoning: bool = True
    tool_mode: str | None = None  # a forced call: the function's name, or "required"
    tool_parser: str | None = None  # tool_choice "auto" under --enable-auto-tool-choice
    tools: tuple[dict[str, Any], ...] = ()  # the request's, for a parser that reads values by their schema

    def _split(self, text: str) -> tuple[str | None, str | None]:
        return self.reasoner.split(text) if self.reasoner is not None else (None, text)

    def message(self, text: str, finish: str | None) -> tuple[dict[str, Any], str | None]:
        """The non-streamed assistant message of a finished choice, and its finish reason."""
        reasoning, content = self._split(text)
        if self.tool_mode is not None:
            message, finish = tool_message(content or "", self.tool_mode, finish)
        elif self.tool_parser is not None:
            message, finish = _auto_message(self.tool_parser, self.tools, content, finish)
        else:
            message = {"role": "assistant", "content": content}
        if self.reasoning_field:
            message["reasoning"] = reasoning if self.include_reasoning else None
        return message, finish

    def stream(self) -> "ChoiceStream":
        return ChoiceStream(self)


def _auto_message(parser: str, tools: tuple[dict[str, Any], ...], content: str | None,
                  finish: str | None) -> tuple[dict[str, Any], str | None]:
    text, calls = extract_tool_calls(parser, content or "", tools)
    if not calls:
        return {"role": "assistant", "content": content}, finish
    tool_calls = [{"id": call_id(), "type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    return ({"role": "assistant", "content": text, "tool_calls": tool_calls},
            "tool_calls" if finish == "stop" else finish)


class ChoiceStream:
    """One choice's deltas: `opening()` once, then `next(text_delta, finished)` per step."""

    def __init__(self, shape: ChatOutput):
        self.shape = shape
        self.thoughts = shape.reasoner.stream() if shape.reasoner is not None else None
        self.forced = ToolCallStream(shape.tool_mode) if shape.tool_mode is not None else None
        self.auto = AutoToolStream(shape.tool_parser, shape.tools) if shape.tool_parser is not None else None
        self.called = False  # an auto call was streamed

    def opening(self) -> dict[str, Any]:
        if self.forced is None:
            return {"role": "assistant", "content": ""}
        calls = self.forced.opening()  # a named function is announced before any token
        return {"role": "assistant", "content": None, **({"tool_calls": calls} if calls else {})}

    def next(self, text: str, finished: bool) -> tuple[dict[str, Any], bool]:
        """(the delta, whether it carries anything new)."""
        if self.thoughts is None and self.forced is None and self.auto is None:
            return ({"content": text} if text or not finished else {}), bool(text)
        reasoning, content = self.thoughts.next(text, finished) if self.thoughts is not None else ("", text)
        delta: dict[str, Any] = {}
        if reasoning and self.shape.include_reasoning:
            delta["reasoning"] = reasoning
        if self.forced is not None:
            calls = self.forced.next(content, finished)
        elif self.auto is not None:
            content, calls = self.auto.next(content, finished)
            self.called |= bool(calls)
        else:
            calls = []
        if content and self.forced is None:
            delta["content"] = content
        if calls:
            delta["tool_calls"] = calls
        return delta, bool(delta)

    def finish_reason(self, finish: str | None) -> str | None:
        """A forced call that ran to its end finishes "tool_calls" (server/tool_stream.py), as
        does a stream in which the model chose to call; a call cut short keeps "length"."""
        if self.forced is not None or self.called:
            return stream_finish_reason(finish)
        return finish
