"""`--enable-auto-tool-choice --tool-call-parser NAME`: under `tool_choice`
"auto" the model writes free text, in which a parser finds the tool calls, as
in `vllm serve`. Three of vLLM 0.20's parsers, by their vLLM names:
"hermes" (Qwen2.5, Qwen3) and "llama3_json" (Llama 3.1, 3.2), the calls
written as JSON (server/tool_parser_json.py), and "qwen3_coder"
(Qwen3-Coder, Qwen3.5), the calls written as XML whose values the request's
tool schemas type (server/tool_parser_xml.py). A finished text gives
(content, calls), each call (name, arguments as JSON text); a text with no
calls is all content.

Streamed (AutoToolStream, one stream for all three: each parser gives it a
reader that says where the calls begin and reads them step by step), the
pieces add up to the non-streamed result. Content goes out as generated,
except what could still belong to a call. A call is announced once its name
is complete; its arguments stream as a prefix of the non-streamed
`arguments` that cannot change. At the end the whole text is parsed once
more. When it has no calls (a block was no call), the held text goes out as
content, so content still adds up, but calls already announced cannot be
taken back (vLLM streams them too).
"""
from __future__ import annotations

from typing import Any, Callable, Protocol

from detent.server import tool_parser_json as json_calls
from detent.server import tool_parser_xml as xml_calls
from detent.server.tool_stream import Call, Tools, call_id


class CallReader(Protocol):
    """A parser step by step, for one stream (made per stream from the request's tools)."""
    done: list[Call]  # the calls finished so far, in order

    def content_end(self, text: str, shown: int) -> tuple[int, int]:
        """(how far the text is content for now, where the calls begin or -1); `text[:shown]` went out."""

    def scan(self, text: str) -> Call | None:
        """Moves past the calls finished since the last step; the open call's name and arguments so far, if any."""


Extract = Callable[[str, Tools], tuple[str | None, list[Call]]]

# Each parser by its vLLM name: how a finished text is read, and the reader a stream reads it with step by step.
_FORMATS: dict[str, tuple[Extract, Callable[[Tools], CallReader]]] = {
    "hermes": (json_calls.extract_hermes, json_calls.HermesReader),
    "llama3_json": (json_calls.extract_llama, json_calls.LlamaReader),
    xml_calls.PARSER: (xml_calls.extract, xml_calls.XmlReader),
}
PARSERS: tuple[str, ...] = tuple(_FORMATS)


def _check(parser: str) -> None:
    if parser not in PARSERS:
        raise ValueError(f"unknown tool call parser {parser!r}; Detent has {', '.join(PARSERS)}")


def extract_tool_calls(parser: str, text: str, tools: Tools = None) -> tuple[str | None, list[Call]]:
    """(content, [(name, arguments_json), ...]) of a finished output; no calls -> (text, []).
    `tools`: the request's, which qwen3_coder converts parameter values by."""
    _check(parser)
    return _FORMATS[parser][0](text, tools)


class AutoToolStream:
    """One choice's stream under tool_choice "auto": next(delta, finished) -> (content_piece, tool_call_deltas).
    The parser's reader says where the calls begin and reads them; the stream sends what is new."""

    def __init__(self, parser: str, tools: Tools = None):
        _check(parser)
        self.parser, self.tools = parser, tools
        self.reader = _FORMATS[parser][1](tools)
        self.text = ""
        self.shown = 0  # text[:shown] went out as content
        self.calls_at = -1  # where the calls begin (from there on nothing is content until the end); -1: not yet
        self.settled = 0  # the reader's finished calls sent whole
        self.names: list[str] = []  # announced calls
        self.sent: list[str] = []  # per announced call, the arguments sent so far
        self.finished = False

    def next(self, delta: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        if self.finished:
            raise RuntimeError("AutoToolStream.next after the step that finished the stream")
        self.text += delta
        out: list[dict[str, Any]] = []
        if finished:
            self.finished = True
            return self._finish(out), out
        piece = self._content()
        if self.calls_at >= 0:
            open_call = self.reader.scan(self.text)
            done = self.reader.done
            for i in range(self.settled, len(done)):  # finished since the last step: sent whole
                self._send(out, i, *done[i])
            self.settled = len(done)
            if open_call is not None:
                self._send(out, len(done), *open_call)
        return piece, out

    def _content(self) -> str:
        """The content piece sendable now; sets `calls_at` once the calls begin."""
        if self.calls_at >= 0:
            return ""
        upto, self.calls_at = self.reader.content_end(self.text, self.shown)
        piece, self.shown = self.text[self.shown:upto], upto
        return piece

    def _send(self, out: list[dict[str, Any]], i: int, name: str, args: str) -> None:
        """Announces call i, or sends what `args` adds to what was sent. Called once per call per step."""
        if i == len(self.names):
            self.names.append(name)
            self.sent.append(args)
            out.append({"index": i, "id": call_id(), "type": "function",
                        "function": {"name": name, "arguments": args}})
            return
        sent = self.sent[i]
        # Not a continuation: a value that changed under what was sent (a repeated key), which cannot be undone.
        if len(args) > len(sent) and args.startswith(sent):
            self.sent[i] = args
            out.append({"index": i, "function": {"arguments": args[len(sent):]}})

    def _finish(self, out: list[dict[str, Any]]) -> str:
        """The last step: the whole text parsed once; what was held goes out as calls or as content."""
        content, calls = extract_tool_calls(self.parser, self.text, self.tools)
        for i, (name, args) in enumerate(calls):
            self._send(out, i, name, args)
        # With calls, the content is the text before them, all of which went out already.
        return (content or "")[self.shown:] if calls else self.text[self.shown:]
