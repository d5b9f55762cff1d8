"""`tools` with `tool_choice` "required" or a named function, as `vllm serve`
handles them: the output is constrained to JSON over the function's
parameter schema (structured output) and returned as `tool_calls`.
Streaming: server/tool_stream.py. "auto" (the default with tools) lets the
model write free text that a parser reads for calls: it needs
`--enable-auto-tool-choice --tool-call-parser NAME` (server/tool_parsers.py),
and is a 400 without them, as under vLLM.
"""
from __future__ import annotations

import json
from typing import Any

from detent.sampling.params import StructuredOutputs
from detent.server.errors import bad_request
from detent.server.params import checked_spec
from detent.server.tool_parsers import PARSERS
from detent.server.tool_stream import call_id

_EMPTY = {"type": "object", "properties": {}}


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict]:
    """name -> parameter schema, each tool checked."""
    out = {}
    for i, t in enumerate(tools):
        fn = t.get("function") if isinstance(t, dict) else None
        if t.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_request(f"tools[{i}] must be {{'type': 'function', 'function': {{'name': ..., "
                              f"'parameters': ...}}}}", "tools")
        params = fn.get("parameters", _EMPTY)
        if not isinstance(params, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        out[fn["name"]] = params
    return out


def tool_constraint(tools: list[dict] | None, choice: Any,
                    auto_parser: str | None = None) -> tuple[StructuredOutputs | None, str | None]:
    """(the structured output the tool choice imposes, the forced function's name or
    "required"); (None, None) when no call is forced. `auto_parser`: the server's
    --tool-call-parser under --enable-auto-tool-choice, or None (then "auto" is a 400)."""
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None, None
    fns = _functions(tools)
    if choice == "none":
        return None, None
    if choice in (None, "auto"):
        if auto_parser is not None:
            return None, None  # free text, read for calls afterwards (server/chat_output.py)
        raise bad_request("tool_choice 'auto' (the default with tools) needs a tool-call parser: start "
                          f"detent-serve with --enable-auto-tool-choice --tool-call-parser {'|'.join(PARSERS)}, "
                          "or use tool_choice 'required' or name a function", "tool_choice")
    if choice == "required":
        one_call = [{"type": "object", "properties": {"name": {"type": "string", "enum": [n]}, "parameters": p},
                     "required": ["name", "parameters"]} for n, p in fns.items()]
        schema, mode = {"type": "array", "minItems": 1, "items": {"anyOf": one_call}}, "required"
    elif isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        mode = choice["function"].get("name")
        if not isinstance(mode, str) or mode not in fns:  # a list or object name is unhashable
            raise bad_request(f"tool_choice names function {mode!r}, which is not among the tools "
                              f"({', '.join(fns)})", "tool_choice")
        schema = fns[mode]
    else:
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or {{'type': 'function', "
                          f"'function': {{'name': ...}}}}, got {choice!r}", "tool_choice")
    return checked_spec("the tools' parameters schema", "json", schema, "tools"), mode


def tool_message(text: str, mode: str, finish_reason: str | None) -> tuple[dict[str, Any], str | None]:
    """The assistant message carrying the calls in `text`, and the finish reason to report.
    Output cut short (max_tokens) is not valid JSON: it stays `content`, with no calls.
    A named function's `arguments` is the generated JSON text itself (as vLLM, and as
    it streams); "required" calls' are `json.dumps(parameters)`, which their stream
    rebuilds (server/tool_stream.py)."""
    try:
        parsed = json.loads(text)
        calls = ([(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in parsed]
                 if mode == "required" else [(mode, text)])
    except (ValueError, RecursionError):  # cut short, or nested deeper than Python's JSON goes (a 500 was)
        return {"role": "assistant", "content": text, "tool_calls": []}, finish_reason
    tool_calls = [{"id": call_id(), "type": "function", "function": {"name": n, "arguments": a}} for n, a in calls]
    # OpenAI: a forced named function finishes "stop"; calls the model chose, "tool_calls"
    return ({"role": "assistant", "content": None, "tool_calls": tool_calls},
            "tool_calls" if mode == "required" and finish_reason == "stop" else finish_reason)
