"""`--tool-call-parser qwen3_coder`: vLLM 0.20's Qwen3CoderToolParser, for the
XML calls Qwen3-Coder and Qwen3.5 write:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

Read as vLLM reads a finished text (its regexes, written out as searches):
- Blocks: each `<tool_call>` to the first `</tool_call>` after it; the last
  may run unterminated to the end of the text (less a final newline). Text
  between and after blocks is dropped. A text with no `<tool_call>` is one
  block.
- Functions, in a block: each `<function=` to the first `</function>` after
  it, or to the block's end. The name is the text up to the first `>`; a
  function with no `>` is no call (it is dropped).
- Parameters, in a function: each `<parameter=` to the first `</parameter>`
  or the next `<parameter=`, or to the function's end (less a final
  newline). The name is the text up to the first `>`, the value the rest
  less one leading and one trailing newline. A parameter with no `>` fails
  vLLM's parse of the whole text (below).
- Values are strings, converted by the schema of the request's tool of that
  name (`parameters.properties[NAME]`, its `type` lower-cased; a schema with
  `anyOf` and no `type` counts as "object"; none: "string"): "null" in any
  case is null whatever the type; a tool or parameter the request does not
  declare: the string; string, str, text, varchar, char, enum: the string;
  int*, uint*, long*, short*, unsigned*: `int()`; num*, float*: `float()`,
  written as an integer when whole; boolean, bool, binary: true exactly when
  the value is "true" in any case (anything else is false); object, array,
  arr, dict*, list*: JSON, else a Python literal; any other type: a Python
  literal. A conversion that fails keeps the string.
- `arguments`: `json.dumps(parameters, ensure_ascii=False)`, in the order
  written (a repeated parameter keeps its first place and its last value).
- Content: the text before the first `<tool_call>` (with none, before the
  first `<function=`), None when that is "". With no call the whole text is
  content, as it is when the parse fails: a parameter with no `>`, a number
  too large for an integer ("1e999" as a number), a literal JSON cannot
  write (a Python set), nesting too deep.
One divergence: a tool whose `properties` is not an object is read as
declaring none (vLLM's parse fails on it).

Streamed (server/tool_parsers.py's AutoToolStream with `XmlReader`), the
pieces add up to the non-streamed result. Content goes out until a
`<tool_call>` or `<function=` begins (a tail that could begin one is held
back). A call is announced once `<function=NAME>` is complete, with
`arguments` "{"; a parameter's value is known only once the parameter ends
(its conversion needs all of it), and then the dump of the parameters so far
less its closing `}` goes out: a prefix that cannot change, unless a
parameter repeats (then that call's pieces stop where they were, as
hermes's do for a repeated key). The `}` goes out when the function ends.
Calls outside any `<tool_call>` stream only at the end: a `<tool_call>`
after them would make them content. A parse that fails (above) stops the
calls where they were; the held text goes out as content at the end. vLLM's
own stream differs: it streams text after the calls as content and reads
bare functions as content, neither of which its non-streamed result does.
Each step costs about what arrived: every search resumes where the last
one stopped; a parameter is converted when it ends, and once more when its
function ends (the function is then read whole, as the end reads the text).
"""
from __future__ import annotations

import ast
import json
from typing import Any, Iterator

from detent.server.tool_stream import Call, Tools, content_until, resume_at

PARSER = "qwen3_coder"

_BLOCK, _BLOCK_END = "<tool_call>", "</tool_call>"
_FUNCTION, _FUNCTION_END = "<function=", "</function>"
_PARAM, _PARAM_END = "<parameter=", "</parameter>"

_STRINGS = ("string", "str", "text", "varchar", "char", "enum")
_INTEGERS = ("int", "uint", "long", "short", "unsigned")  # prefixes
_NUMBERS = ("num", "float")  # prefixes
_BOOLEANS = ("boolean", "bool", "binary")
_CONTAINERS = ("object", "array", "arr")  # and the prefixes dict, list
# What fails vLLM's parse of the whole text: a parameter with no `>` (ValueError), int() of an infinite float
# (OverflowError), a literal json.dumps cannot write (TypeError), nesting too deep (RecursionError, MemoryError).
_PARSE_FAILS = (ValueError, TypeError, OverflowError, RecursionError, MemoryError)


def properties(tools: Tools, name: str) -> dict[str, Any]:
    """The parameter schemas of the request's first tool named `name`; {} when there is none."""
    for tool in tools or ():
        function = tool.get("function") or {}
        if function.get("name") == name:
            props = (function.get("parameters") or {}).get("properties", {})
            return props if isinstance(props, dict) else {}
    return {}


def _type(schema: Any) -> str:
    if isinstance(schema, dict) and "type" in schema:
        return str(schema["type"]).strip().lower()
    return "object" if isinstance(schema, dict) and "anyOf" in schema else "string"


def convert(value: str, name: str, props: dict[str, Any]) -> Any:
    """A parameter's value, by its schema in the tool's `props`, as vLLM converts it."""
    if value.lower() == "null":
        return None
    if name not in props:
        return value
    kind = _type(props[name])
    if kind in _STRINGS:
        return value
    if kind.startswith(_INTEGERS):
        try:
            return int(value)
        except ValueError:
            return value
    if kind.startswith(_NUMBERS):
        try:
            number = float(value)
            return number if number - int(number) != 0 else int(number)  # int(inf) raises OverflowError: no calls
        except ValueError:  # not a number, or NaN
            return value
    if kind in _BOOLEANS:
        return value.lower() == "true"
    if kind in _CONTAINERS or kind.startswith(("dict", "list")):
        try:
            return json.loads(value)
        except ValueError:
            pass
    try:
        return ast.literal_eval(value)
    except (ValueError, SyntaxError, TypeError):
        return value


def _regex_end(text: str) -> int:
    """Where vLLM's `$` first matches in `text`: before a final newline, else at the end."""
    return len(text) - 1 if text.endswith("\n") else len(text)


def _spans(text: str, open_tag: str, close_tag: str, last_end: int) -> Iterator[str]:
    """What follows each `open_tag` up to the first `close_tag` after it; the last, unclosed, up to `last_end`."""
    pos = 0
    while (start := text.find(open_tag, pos)) >= 0:
        body = start + len(open_tag)
        end = text.find(close_tag, body)
        if end < 0:
            yield text[body:last_end]
            return
        yield text[body:end]
        pos = end + len(close_tag)


def _blocks(text: str) -> list[str]:
    """The bodies of the `<tool_call>` blocks; the whole text when it has none."""
    return list(_spans(text, _BLOCK, _BLOCK_END, _regex_end(text))) or [text]


def _param_end(text: str, start: int) -> tuple[int, int]:
    """(where a parameter whose value began before `start` ends, where the next may begin): at the first
    `</parameter>` (the next begins past it) or `<parameter=` from `start`; (-1, -1) when there is neither."""
    close, following = text.find(_PARAM_END, start), text.find(_PARAM, start)
    if close >= 0 and (following < 0 or close < following):
        return close, close + len(_PARAM_END)
    return following, following


def _param(written: str) -> tuple[str, str]:
    """A parameter's name and value from the text after its `<parameter=` (`NAME>VALUE`)."""
    gt = written.find(">")
    if gt < 0:
        raise ValueError(f"a parameter with no '>': {written[:60]!r}")
    value = written[gt + 1:]
    value = value[1:] if value.startswith("\n") else value
    return written[:gt], value[:-1] if value.endswith("\n") else value


def _call(body: str, tools: Tools) -> Call | None:
    """The call a function's body (`NAME>` and its parameters) holds; None without a `>`."""
    gt = body.find(">")
    if gt < 0:
        return None
    name, props, args = body[:gt], properties(tools, body[:gt]), {}
    pos, last_end = gt + 1, _regex_end(body)
    while (at := body.find(_PARAM, pos)) >= 0:
        start = at + len(_PARAM)
        end, pos = _param_end(body, start)
        if end < 0:
            end = pos = last_end
        key, value = _param(body[start:end])
        args[key] = convert(value, key, props)
    return name, json.dumps(args, ensure_ascii=False)


def _calls(text: str, tools: Tools) -> list[Call]:
    """The calls in the bodies of the functions in `text` (a block, or the rest of one)."""
    bodies = _spans(text, _FUNCTION, _FUNCTION_END, len(text))
    return [call for body in bodies if (call := _call(body, tools)) is not None]


def extract(text: str, tools: Tools = None) -> tuple[str | None, list[Call]]:
    """(content, calls) of a finished text; no calls -> (text, [])."""
    try:
        calls = [call for block in _blocks(text) for call in _calls(block, tools)]
    except _PARSE_FAILS:
        return text, []
    if not calls:
        return text, []
    begins = text.find(_BLOCK)
    return text[:begins if begins >= 0 else text.find(_FUNCTION)] or None, calls


class _OpenFunction:
    """The function being generated, read as it grows: its name once `>` arrives, its parameters as each ends."""

    def __init__(self, body_at: int):
        self.body_at = body_at  # where its body (NAME>...) begins
        self.end_from = body_at  # where to look for its `</function>`
        self.name: str | None = None
        self.name_from = body_at  # where to look for the `>` that ends the name
        self.props: dict[str, Any] = {}
        self.args: dict[str, Any] = {}
        self.sendable = "{"  # json.dumps(args) less its closing `}`
        self.param_from = -1  # where to look for the next `<parameter=`
        self.value_at = -1  # where the open parameter's text (NAME>VALUE) begins; -1: none open
        self.value_from = -1  # where to look for its end

    def read(self, text: str, tools: Tools) -> Call | None:
        """(name, arguments so far) once the name is complete; the parameters ended since the last step read."""
        if self.name is None:
            gt = text.find(">", self.name_from)
            if gt < 0:
                self.name_from = len(text)
                return None
            self.name, self.param_from = text[self.body_at:gt], gt + 1
            self.props = properties(tools, self.name)
        grown = False
        while True:
            if self.value_at < 0:
                at = text.find(_PARAM, self.param_from)
                if at < 0:
                    self.param_from = resume_at(text, _PARAM, self.param_from)
                    break
                self.value_at = self.value_from = at + len(_PARAM)
            end, following = _param_end(text, self.value_from)
            if end < 0:
                self.value_from = resume_at(text, _PARAM_END, self.value_from)
                break
            key, value = _param(text[self.value_at:end])
            self.args[key] = convert(value, key, self.props)
            self.value_at, self.param_from, grown = -1, following, True
        if grown:
            self.sendable = json.dumps(self.args, ensure_ascii=False)[:-1]
        return self.name, self.sendable


class XmlReader:
    """qwen3_coder step by step, for a stream: where the calls begin (`content_end`), the calls
    finished so far (`done`), the open one's name and arguments so far (`scan`)."""

    def __init__(self, tools: Tools = None):
        self.tools = tools
        self.done: list[Call] = []  # finished calls, in order
        self.broken = False  # the parse failed: the text will end as content
        self.bare = False  # a `<function=` came first: its calls are read at the end
        self.pos = 0  # where the next block may begin
        self.block_at = -1  # where the open block's body begins; -1: none open
        self.block_from = 0  # where to look for its `</tool_call>`
        self.function_from = 0  # where the open block's next function may begin
        self.function: _OpenFunction | None = None

    def content_end(self, text: str, shown: int) -> tuple[int, int]:
        """(how far the text is content for now, where the calls begin or -1)."""
        upto, begins = content_until(text, shown, (_BLOCK, _FUNCTION))
        if begins >= 0:
            self.bare, self.pos = not text.startswith(_BLOCK, begins), begins
        return upto, begins

    def scan(self, text: str) -> Call | None:
        """Moves past the blocks and functions finished since the last step; the open call so far, if any."""
        if self.broken or self.bare:
            return None
        try:
            return self._scan(text)
        except _PARSE_FAILS:
            self.broken = True
            return None

    def _scan(self, text: str) -> Call | None:
        while True:
            if self.block_at < 0:
                start = text.find(_BLOCK, self.pos)
                if start < 0:
                    self.pos = resume_at(text, _BLOCK, self.pos)
                    return None
                self.block_at = self.block_from = self.function_from = start + len(_BLOCK)
            end = text.find(_BLOCK_END, self.block_from)
            if end < 0:
                self.block_from = resume_at(text, _BLOCK_END, self.block_from)
                return self._scan_block(text)
            # The block ended: the rest of it (from the open function, if any) is read whole.
            rest = self.function_from if self.function is None else self.function.body_at - len(_FUNCTION)
            self.done += _calls(text[rest:end], self.tools)
            self.pos, self.block_at, self.function = end + len(_BLOCK_END), -1, None

    def _scan_block(self, text: str) -> Call | None:
        """The open block's functions, up to the end of the text."""
        while True:
            if self.function is None:
                start = text.find(_FUNCTION, self.function_from)
                if start < 0:
                    self.function_from = resume_at(text, _FUNCTION, self.function_from)
                    return None
                self.function = _OpenFunction(start + len(_FUNCTION))
            function = self.function
            end = text.find(_FUNCTION_END, function.end_from)
            if end < 0:
                function.end_from = resume_at(text, _FUNCTION_END, function.end_from)
                return function.read(text, self.tools)
            if (call := _call(text[function.body_at:end], self.tools)) is not None:
                self.done.append(call)
            self.function_from, self.function = end + len(_FUNCTION_END), None
