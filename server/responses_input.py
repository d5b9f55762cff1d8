"""A `/v1/responses` request as the chat request it means (server/responses.py
answers it through the chat path: server/chat.py's `prepare_chat`).

- `instructions` and the `input` items become chat messages: a message item
  (`type` "message" or none; text content, or `input_text` / `output_text`
  parts) is that turn; a `function_call` item is an assistant turn's
  `tool_calls` entry (joined to the assistant turn just before it, if any);
  a `function_call_output` item is a `tool` message; a `reasoning` item is
  dropped. Any other item or content part is a 400 naming it.
- The `developer` role stays when the chat template names it; otherwise it
  is `system`. As vLLM, the system messages (instructions first, then
  system and developer items in order) become one, first, joined by a blank
  line: most templates take one system message, at the start.
- `tools` (Responses' flat function tools), `tool_choice`, `text.format`,
  `max_output_tokens`, `include` + `top_logprobs` and `reasoning.effort`
  (passed to the template as `reasoning_effort`, as vLLM does) become their
  chat fields; the sampling extensions are the same fields.

What Detent cannot honour is refused, naming the field: stored state
(`previous_response_id`, `conversation`, `background`), built-in tools,
non-text inputs, reasoning summaries, and the rest of
server/vllm_fields.py's `REFUSED_RESPONSES`.
"""
from __future__ import annotations

import re
from typing import Any

from detent.sampling.params import MAX_INT32
from detent.server.errors import bad_request
from detent.server.params import MAX_LOGPROBS, FieldNames, check_range
from detent.server.protocol import (ChatCompletionRequest, ReasoningConfig, ResponseFormat, ResponsesRequest,
                                    ResponseText, _Extensions)
from detent.server.vllm_fields import RESPONSES_FIELDS, check_vllm_fields

NAMES = FieldNames(messages="input", max_tokens="max_output_tokens", response_format="text.format",
                   json_schema="text.format", reasoning_effort="reasoning.effort")
LOGPROBS = "message.output_text.logprobs"  # the one `include` Detent has
ROLES = ("user", "system", "developer", "assistant")
TEXT_PARTS = ("input_text", "output_text")
_DEVELOPER = re.compile(r"""['"]developer['"]""")  # a template that handles the role names it


def to_chat_request(req: ResponsesRequest, template: str | None) -> ChatCompletionRequest:
    """The chat request `req` means; a 400 naming the field for what Detent cannot honour.
    `template`: the chat template the server renders with."""
    check_vllm_fields(req.model_extra, RESPONSES_FIELDS)
    check_range(req.max_output_tokens, 1, MAX_INT32, "max_output_tokens")
    check_range(req.top_logprobs, 0, MAX_LOGPROBS, "top_logprobs")
    logprobs = _include(req.include)
    if req.top_logprobs and not logprobs:
        raise bad_request(f"top_logprobs needs include: [{LOGPROBS!r}]", "top_logprobs")
    _check_reasoning(req.reasoning)
    in_use = req.chat_template or (req.chat_template_kwargs or {}).get("chat_template") or template or ""
    messages = _messages(req.instructions, req.input, developer=bool(_DEVELOPER.search(in_use)))
    return ChatCompletionRequest(
        **{name: getattr(req, name) for name in _Extensions.model_fields}, messages=messages,
        max_tokens=req.max_output_tokens, logprobs=logprobs, top_logprobs=req.top_logprobs if logprobs else None,
        tools=_tools(req.tools), tool_choice=_tool_choice(req.tool_choice), response_format=_text_format(req.text),
        chat_template=req.chat_template, chat_template_kwargs=req.chat_template_kwargs,
        reasoning_effort=req.reasoning.effort if req.reasoning is not None else None)


def _include(include: list[str] | None) -> bool:
    """Whether `include` asks for the output text's logprobs (anything else is a 400)."""
    for i, name in enumerate(include or []):
        if name != LOGPROBS:
            raise bad_request(f"include[{i}]: {name!r} is not supported; Detent can include {LOGPROBS!r} only "
                              f"(it has no built-in tools, images, files or encrypted reasoning)", "include")
    return bool(include)


def _check_reasoning(reasoning: ReasoningConfig | None) -> None:
    """`reasoning.effort` goes to the template (chat's `reasoning_effort`); a summary cannot be had."""
    for name in ("summary", "generate_summary"):
        if reasoning is not None and getattr(reasoning, name) is not None:
            raise bad_request(f"reasoning.{name} is not supported: the reasoning is returned whole, as a reasoning "
                              f"item's reasoning_text, never summarized; got {getattr(reasoning, name)!r}",
                              f"reasoning.{name}")


def _messages(instructions: str | None, input: str | list[dict[str, Any]], developer: bool) -> list[dict[str, Any]]:
    """The chat messages; `developer`: the template knows the developer role."""
    msgs: list[dict[str, Any]] = []
    items = [{"role": "user", "content": input}] if isinstance(input, str) else input
    for i, item in enumerate(items):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise bad_request(f"{where}.role must be one of {', '.join(ROLES)}, got {role!r}", f"{where}.role")
            msgs.append({"role": "system" if role == "developer" and not developer else role,
                         "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            if msgs and msgs[-1]["role"] == "assistant":
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            msgs.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                         "content": _text(item.get("output"), f"{where}.output")})
        elif kind != "reasoning":
            raise bad_request(f"{where}: {kind!r} items are not supported; Detent takes message, function_call, "
                              f"function_call_output and reasoning items (reasoning is dropped)", f"{where}.type")
    system = [m["content"] for m in msgs if m["role"] == "system"]
    if instructions is not None:
        system.insert(0, instructions)
    if system:
        msgs = [{"role": "system", "content": "\n\n".join(system)}] + [m for m in msgs if m["role"] != "system"]
    if not msgs:
        raise bad_request("input has no messages", "input")
    return msgs


def _string(item: dict[str, Any], key: str, where: str) -> str:
    if not isinstance(item.get(key), str):
        raise bad_request(f"{where}.{key} must be a string, got {item.get(key)!r}", f"{where}.{key}")
    return item[key]


def _text(content: Any, where: str) -> str:
    """A message's (or a call output's) text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts, got {type(content).__name__}", where)
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise bad_request(f"{where}[{j}]: {kind!r} parts are not supported; Detent's models read text "
                              f"({' or '.join(TEXT_PARTS)} with a string 'text')", f"{where}[{j}]")
        parts.append(part["text"])
    return "".join(parts)


def _tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses' flat function tools in chat's shape (an empty list, Responses' default: none)."""
    if not tools:
        return None
    out = []
    for i, t in enumerate(tools):
        if t.get("type") != "function":
            raise bad_request(f"tools[{i}]: {t.get('type')!r} tools are not supported: Detent runs no built-in "
                              f"tools; give function tools ({{'type': 'function', 'name': ..., 'parameters': ...}})",
                              f"tools[{i}].type")
        if not isinstance(t.get("name"), str):
            raise bad_request(f"tools[{i}].name must be a string, got {t.get('name')!r}", f"tools[{i}].name")
        if not isinstance(t.get("parameters", {}), dict):
            raise bad_request(f"tools[{i}].parameters must be a JSON Schema object", f"tools[{i}].parameters")
        out.append({"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters", "strict")
                                                      if t.get(k) is not None}})
    return out


def _tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(f"tool_choice must be 'auto', 'none', 'required' or {{'type': 'function', 'name': ...}} "
                      f"(Detent has no built-in tools), got {choice!r}", "tool_choice")


def _text_format(text: ResponseText | None) -> ResponseFormat | None:
    if text is None:
        return None
    if text.verbosity not in (None, "medium"):
        raise bad_request(f"text.verbosity: only 'medium' (the default) is supported; the model's length is "
                          f"set by max_output_tokens, got {text.verbosity!r}", "text.verbosity")
    f = text.format
    if f is None or f.type == "text":
        return None
    return ResponseFormat(type=f.type, json_schema=f if f.type == "json_schema" else None)
