"""A forced tool call, streamed as OpenAI's `tool_calls` deltas (`stream: true`
with `tool_choice` a named function or "required"; server/tools.py says how
the output is constrained).

Named function: the opening delta announces call 0 (id, name, arguments
""), then each text delta is an `arguments` fragment: the generated JSON as
it streams, which is exactly what the non-streamed `arguments` holds.

"required": the output is a JSON array of `{"name", "parameters"}`. Each
step re-reads the text so far with a partial JSON parser that keeps only
complete scalars (an unfinished string, number or literal is dropped). A
call is announced once its name is complete; its `arguments` stream as
`json.dumps(parameters)`, the non-streamed form. Until a call is complete
only a prefix that cannot change is sent: the dump of the partial value
minus its trailing `]`/`}` (the closers of containers still open; a
complete scalar never ends in one). A call is complete once a later call
began, or the whole text parses at the end.

Re-reading costs the length of the text, on the event loop: past
`EVERY_STEP_CHARS` the text is re-read only once it has grown by a
sixteenth (`reread_due`), so a long output costs linear time in all, in
larger pieces. server/tool_parsers.py reads calls the same way, and its
streams share the helpers here (`call_id`, and `content_until`: content held
back where a call's tag could begin).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Sequence

from partial_json_parser import Allow, MalformedJSON
from partial_json_parser import loads as partial_loads

from detent.server.formatting import tag_tail

Call = tuple[str, str]  # a call the model chose to write: (name, arguments as JSON text)
Tools = Sequence[dict[str, Any]] | None  # the request's tools, chat's shape: {"type": "function", "function": {...}}

COMPLETE_SCALARS = Allow.OBJ | Allow.ARR  # open objects and arrays are kept; unfinished scalars are not
EVERY_STEP_CHARS = 16384


def reread_due(length: int, last_read: int) -> bool:
    """Whether a text now `length` long, last read at `last_read`, is re-read this step:
    always below EVERY_STEP_CHARS, past it once it has grown by a sixteenth."""
    return length <= EVERY_STEP_CHARS or length * 16 >= last_read * 17


def content_until(text: str, shown: int, tags: tuple[str, ...]) -> tuple[int, int]:
    """(how far `text` may go out as content, where the first of `tags` in it begins or -1): content
    stops at a tag and holds back a tail that could begin one. Nothing before `shown` begins a
    tag: a possible start was held back."""
    found = [at for tag in tags if (at := text.find(tag, shown)) >= 0]
    if found:
        return min(found), min(found)
    return len(text) - max(tag_tail(text, tag) for tag in tags), -1


def resume_at(text: str, tag: str, pos: int) -> int:
    """Where to look for `tag` next, after it was not found in `text` from `pos`: a tag still
    arriving can only have begun within its length of the end."""
    return max(pos, len(text) - len(tag) + 1)


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def stream_finish_reason(finish_reason: str | None) -> str | None:
    """As vLLM's stream: a call that ran to its end finishes "tool_calls", named or
    required. A call cut short keeps "length", so a client knows its arguments are
    incomplete (vLLM reports "tool_calls" there too)."""
    return "tool_calls" if finish_reason == "stop" else finish_reason


class ToolCallStream:
    """One choice's calls: `opening()` once, then `next(text_delta, finished)` per step."""

    def __init__(self, mode: str):
        self.mode = mode  # the forced function's name, or "required"
        self.text = ""
        self.sent: list[str] = []  # per call, the arguments streamed so far
        self.read_len = 0  # how much text the last re-read saw

    def _announce(self, name: str, arguments: str = "") -> dict[str, Any]:
        self.sent.append(arguments)
        return {"index": len(self.sent) - 1, "id": call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments}}

    def opening(self) -> list[dict[str, Any]]:
        """The calls the first delta carries: the named one (its name is known before any token)."""
        return [] if self.mode == "required" else [self._announce(self.mode)]

    def next(self, delta: str, finished: bool) -> list[dict[str, Any]]:
        self.text += delta
        if self.mode != "required":
            return [{"index": 0, "function": {"arguments": delta}}] if delta else []
        return self._required(finished)

    def _parse(self, finished: bool) -> tuple[list[Any], bool]:
        """(the calls so far, whether all of them are complete)."""
        if finished:
            try:
                calls = json.loads(self.text)
                return (calls, True) if isinstance(calls, list) else ([], False)
            except ValueError:
                pass  # cut short (max_tokens, a stop string): what parsed so far stays partial
            except RecursionError:  # nested deeper than Python's JSON goes: no calls, as tools.tool_message
                return [], False
        try:
            calls = partial_loads(self.text, COMPLETE_SCALARS)
        except (MalformedJSON, ValueError, RecursionError):  # nothing but whitespace yet; too deep
            return [], False
        return (calls, False) if isinstance(calls, list) else ([], False)

    def _required(self, finished: bool) -> list[dict[str, Any]]:
        n = len(self.text)
        if not finished and not reread_due(n, self.read_len):
            return []
        self.read_len = n
        calls, all_complete = self._parse(finished)
        out: list[dict[str, Any]] = []
        for i, call in enumerate(calls):
            if not isinstance(call, dict):
                break
            if i == len(self.sent):
                if not isinstance(call.get("name"), str):
                    break  # its name has not finished: nothing after it can be announced either
                out.append(self._announce(call["name"]))
            if "parameters" not in call:
                continue
            args = json.dumps(call["parameters"], ensure_ascii=False)
            if not (all_complete or i < len(calls) - 1):
                args = args.rstrip("]}")
            sent = self.sent[i]
            if len(args) > len(sent) and args.startswith(sent):
                fragment, self.sent[i] = args[len(sent):], args
                if out and out[-1]["index"] == i:  # announced in this same step: one entry per call
                    out[-1]["function"]["arguments"] += fragment
                else:
                    out.append({"index": i, "function": {"arguments": fragment}})
        return out
