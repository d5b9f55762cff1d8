"""`--tool-call-parser hermes|llama3_json` (server/tool_parsers.py): the
calls written as JSON, two of vLLM 0.20's parsers by their vLLM names.

- "hermes" (vLLM's Hermes2ProToolParser; Qwen2.5, Qwen3): each call is a
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>` block, the last
  possibly unterminated. Content: the text before the first block, None when
  that is "" (whitespace is kept); text between and after blocks is dropped.
- "llama3_json" (vLLM's Llama3JsonToolParser; Llama 3.1, 3.2): each call is a
  JSON object `{"name": ..., "parameters" or "arguments": ...}` ("arguments"
  wins), optionally after `<|python_tag|>`, usually joined by "; ". As in
  vLLM, the next `{` past the end of an object starts the next one (vLLM
  skips a `{` right at that end). Content: None; other text is dropped.

As in vLLM, a block or object that is not JSON or lacks a string "name" or its
arguments makes the whole text content, with no calls; `arguments` is
`json.dumps(value, ensure_ascii=False)` of the parsed value. The JSON writes
its values' types, so neither reads the request's tools. One divergence:
llama3_json reads calls only from a text that starts (after whitespace) with
`{` or `<|python_tag|>`, the rule of vLLM's stream; vLLM's non-streamed path
also finds an object after prose, which a stream could only match by holding
back all text to the end.

Streamed, hermes holds a tail that could begin `<tool_call>` and all from the
first one on; llama3_json holds all once the text starts like a call. A call
is announced once its name is complete; its arguments stream as
server/tool_stream.py streams "required" calls (the dump of the value so far,
unfinished scalars dropped, minus trailing closers: a prefix that cannot
change), not as the model spaced them (vLLM's hermes stream does that, which
can differ from its own non-streamed `arguments`). None grows after a
finished block or object failed. Nor can sent arguments be revised when a
later key replaces their value (a repeated key, or "arguments" after
"parameters"): that call's pieces stop where they were. Cost: finished calls
are read once, the open one each step, and past `EVERY_STEP_CHARS` only
once it grew by a sixteenth (server/tool_stream.py's `reread_due`).
"""
from __future__ import annotations

import json
from typing import Any

from partial_json_parser import loads as partial_loads

from detent.server.formatting import tag_tail
from detent.server.tool_stream import COMPLETE_SCALARS, Call, Tools, content_until, reread_due, resume_at

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_ARGUMENT_KEYS = {"hermes": ("arguments",), "llama3_json": ("arguments", "parameters")}
_DECODER = json.JSONDecoder()


def _as_call(value: Any, keys: tuple[str, ...]) -> Call | None:
    """The call a parsed block or object holds, or None when it is not one."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    key = next((k for k in keys if k in value), None)
    return None if key is None else (value["name"], json.dumps(value[key], ensure_ascii=False))


def _loads_call(body: str, keys: tuple[str, ...]) -> Call | None:
    try:
        return _as_call(json.loads(body), keys)
    except (ValueError, RecursionError):
        return None


def _decode_at(text: str, start: int) -> tuple[Any, int] | None:
    """The JSON value at `start` and where it ends, or None (unfinished, or not JSON)."""
    try:
        return _DECODER.raw_decode(text, start)
    except (ValueError, RecursionError):
        return None


def _llama_starts_calls(text: str) -> bool | None:
    """llama3_json: whether the text is calls (True) or content (False); None while it cannot tell."""
    head = text.lstrip()
    if head.startswith(("{", _PYTHON_TAG)):
        return True
    return None if not head or _PYTHON_TAG.startswith(head) else False


# `tools` is not read (the JSON writes its values' types): every parser is handed the request's.
def extract_hermes(text: str, tools: Tools = None) -> tuple[str | None, list[Call]]:
    first = text.find(_OPEN)
    if first < 0:
        return text, []
    calls: list[Call] = []
    pos = first
    while (start := text.find(_OPEN, pos)) >= 0:
        body = start + len(_OPEN)
        end = text.find(_CLOSE, body)
        call = _loads_call(text[body:] if end < 0 else text[body:end], _ARGUMENT_KEYS["hermes"])
        if call is None:
            return text, []
        calls.append(call)
        if end < 0:
            break
        pos = end + len(_CLOSE)
    return text[:first] or None, calls


def extract_llama(text: str, tools: Tools = None) -> tuple[str | None, list[Call]]:
    if not _llama_starts_calls(text):
        return text, []
    calls: list[Call] = []
    pos = 0
    while (start := text.find("{", pos)) >= 0:
        decoded = _decode_at(text, start)
        call = None if decoded is None else _as_call(decoded[0], _ARGUMENT_KEYS["llama3_json"])
        if call is None:
            return text, []
        calls.append(call)
        pos = decoded[1] + 1  # + 1: the `{` vLLM skips
    return (None, calls) if calls else (text, [])


class _JsonReader:
    """hermes or llama3_json step by step, for a stream: where the calls begin (`content_end`),
    the calls finished so far (`done`), the open one's name and arguments so far (`scan`)."""

    keys: tuple[str, ...] = ()

    def __init__(self, tools: Tools = None):
        self.pos = 0  # where to look for the next call's start
        self.open_at = -1  # where the call being generated begins (hermes: its body); -1: none
        self.read_len = 0  # the open call's length at its last re-read
        self.done: list[Call] = []  # finished calls, in order
        self.broken = False  # a finished block or object was no call: the text will end as content

    def scan(self, text: str) -> Call | None:
        """Moves past the calls finished since the last step; the open call's name and arguments so far
        (the dump of its value so far minus trailing closers: a prefix that cannot change), if any."""
        if self.broken:
            return None
        partial = self._read(text)
        if not (isinstance(partial, dict) and isinstance(partial.get("name"), str)):
            return None
        key = next((k for k in self.keys if k in partial), None)
        return partial["name"], "" if key is None else json.dumps(partial[key], ensure_ascii=False).rstrip("]}")

    def _read(self, text: str) -> Any:
        raise NotImplementedError

    def _due(self, length: int) -> bool:
        """Whether to re-read the open call (`length` characters so far) this step."""
        if not reread_due(length, self.read_len):
            return False
        self.read_len = length
        return True

    def _close(self, call: Call | None) -> bool:
        """Records a finished call; False (and no more calls streamed) when it was none."""
        if call is None:
            self.broken = True
            return False
        self.done.append(call)
        self.open_at = -1
        return True


class HermesReader(_JsonReader):
    keys = _ARGUMENT_KEYS["hermes"]

    def __init__(self, tools: Tools = None):
        super().__init__(tools)
        self.close_from = 0  # where to look for the open block's `</tool_call>`

    def content_end(self, text: str, shown: int) -> tuple[int, int]:
        """(how far the text is content for now, where the calls begin or -1)."""
        upto, begins = content_until(text, shown, (_OPEN,))
        if begins >= 0:
            self.pos = begins
        return upto, begins

    def _read(self, text: str) -> Any:
        """Moves past the blocks finished since the last step; the open block's partial value, if any."""
        while True:
            if self.open_at < 0:
                start = text.find(_OPEN, self.pos)
                if start < 0:
                    self.pos = resume_at(text, _OPEN, self.pos)
                    return None
                self.open_at = self.close_from = start + len(_OPEN)
                self.read_len = 0
            end = text.find(_CLOSE, self.close_from)
            if end < 0:
                self.close_from = resume_at(text, _CLOSE, self.close_from)
                if not self._due(len(text) - self.open_at):
                    return None
                return _partial(text[self.open_at:len(text) - tag_tail(text, _CLOSE)])
            if not self._close(_loads_call(text[self.open_at:end], self.keys)):
                return None
            self.pos = end + len(_CLOSE)


class LlamaReader(_JsonReader):
    keys = _ARGUMENT_KEYS["llama3_json"]
    plain = False  # the text is content, all of it

    def content_end(self, text: str, shown: int) -> tuple[int, int]:
        """(how far the text is content for now, where the calls begin or -1)."""
        if not self.plain:
            starts = _llama_starts_calls(text)
            if starts is None:
                return shown, -1
            if starts:
                return shown, 0
            self.plain = True
        return len(text), -1

    def _read(self, text: str) -> Any:
        """Moves past the objects finished since the last step; the open object's partial value, if any."""
        while True:
            if self.open_at < 0:
                start = text.find("{", self.pos)
                if start < 0:
                    self.pos = max(self.pos, len(text))  # not back onto a `{` skipped just after an object
                    return None
                self.open_at, self.read_len = start, 0
            if not self._due(len(text) - self.open_at):
                return None
            decoded = _decode_at(text, self.open_at)
            if decoded is None:  # unfinished (or never JSON: the end will tell)
                return _partial(text[self.open_at:])
            if not self._close(_as_call(decoded[0], self.keys)):
                return None
            self.pos = decoded[1] + 1  # + 1: the `{` vLLM skips


def _partial(body: str) -> Any:
    """The value parsed so far, complete scalars only; None before there is one (or when it is no JSON)."""
    try:
        return partial_loads(body, COMPLETE_SCALARS)
    except Exception:  # the model's text may be anything; on some garbage the library fails an assert or an index
        return None
