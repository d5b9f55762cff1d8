"""The Responses API's response object, and the output items a streamed
response opens and closes as its pieces arrive (server/responses.py writes
them; server/chat_output.py makes the pieces).

Output items, in this order, each when present: a `reasoning` item (what
`--reasoning-parser` took out of the text), a `message` with one
`output_text` part (the content), a `function_call` per tool call. With
`include: ["message.output_text.logprobs"]` the output_text carries the
logprobs of every generated token (reasoning and call tokens included, as
vLLM's). An output cut by max_output_tokens makes the response
"incomplete", and its last item too.
"""
from __future__ import annotations

import bisect
import functools
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from detent.server.chat import ChatPlan
from detent.server.formatting import chat_logprobs
from detent.server.generation import seeds
from detent.server.protocol import ResponsesRequest, ResponseText
from detent.server.serving import ServerState, built


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def reasoning_item(id: str, text: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "reasoning", "id": id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "status": status}


def message_item(id: str, text: str, logprobs: list[dict] | None, status: str = "completed") -> dict[str, Any]:
    part: dict[str, Any] = {"type": "output_text", "text": text, "annotations": []}
    if logprobs is not None:
        part["logprobs"] = logprobs
    return {"type": "message", "id": id, "role": "assistant", "status": status, "content": [part]}


def call_item(id: str, call_id: str, name: str, arguments: str, status: str = "completed") -> dict[str, Any]:
    return {"type": "function_call", "id": id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(message: dict[str, Any], logprobs: list[dict] | None, incomplete: bool) -> list[dict[str, Any]]:
    """A non-streamed response's output, from the chat message (ChatOutput.message)."""
    items = []
    if message.get("reasoning"):
        items.append(reasoning_item(item_id("rs"), message["reasoning"]))
    if message.get("content"):
        items.append(message_item(item_id("msg"), message["content"], logprobs))
    for call in message.get("tool_calls") or []:
        items.append(call_item(item_id("fc"), call["id"], call["function"]["name"], call["function"]["arguments"]))
    if incomplete and items:
        items[-1]["status"] = "incomplete"
    return items


def output_logprobs(plan: ChatPlan, c: Any, t0: int = 0, t1: int | None = None) -> list[dict] | None:
    """The output_text's logprobs of tokens t0..t1 (None when not asked for)."""
    if plan.top_logprobs is None:
        return None
    return chat_logprobs(c.token_ids[t0:t1], (c.logprobs or [])[t0:t1], plan.top_logprobs, plan.tok)["content"]


def tokens_within(ids: list[int], span: tuple[int, int], decode: Callable[[list[int]], str]) -> int:
    """How many of `ids` decode to text wholly inside `span` (character offsets in their text):
    the reasoning tokens, when `span` is the reasoning's. Binary searches on the decoded
    prefixes' lengths, so it does not depend on `<think>`/`</think>` being one token each."""
    def length(t: int) -> int:
        return len(decode(ids[:t]))
    first = bisect.bisect_left(range(len(ids) + 1), span[0], key=length)
    end = bisect.bisect_right(range(len(ids) + 1), span[1], key=length) - 1
    return max(0, end - first)


# json.dumps holds the GIL for its whole call, stalling every thread (0.34 s for one tool of 900,000
# keys); the encoder's iterator lets it go between pieces (46 ms at most, for 2.3x the time)
_PIECEWISE = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


def request_settings(req: ResponsesRequest) -> str:
    """The request's settings as every response object repeats them, encoded once (JSON object
    members), where the body is validated: on the pool for a large body (server/responses.py).
    Encoded per object on the event loop, one tool of 900,000 keys held /health for 1.7 s a stream."""
    settings = {"instructions": req.instructions, "background": False, "max_tool_calls": req.max_tool_calls,
                "metadata": req.metadata, "parallel_tool_calls": True, "previous_response_id": None,
                "reasoning": req.reasoning.model_dump(exclude_none=True) if req.reasoning is not None else None,
                "prompt_cache_key": req.prompt_cache_key, "safety_identifier": req.safety_identifier,
                "service_tier": "default", "store": False, "text": _text_echo(req.text),
                "tool_choice": req.tool_choice or "auto", "tools": req.tools or [],
                "top_logprobs": req.top_logprobs or 0, "truncation": "disabled", "user": req.user}
    return "".join(_PIECEWISE.iterencode(settings))[1:-1]


def members(obj: dict[str, Any]) -> str:
    """A non-empty JSON object's text without its braces, to splice into another's."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False, separators=(",", ":"))[1:-1]


@dataclass(frozen=True)
class ResponseHead:
    """What every response object of one request carries: its id, and the request's settings
    as the response repeats them (the effective sampling values, as vLLM), as JSON text."""
    id: str
    created_at: int
    settings: str  # JSON object members

    @classmethod
    def of(cls, rid: str, settings: str, plan: ChatPlan) -> "ResponseHead":
        """`settings`: request_settings(the request)."""
        ran = {"model": plan.model, "max_output_tokens": plan.params.max_tokens,
               "temperature": plan.params.temperature, "top_p": plan.params.top_p}
        return cls(rid, int(time.time()), members(ran) + "," + settings)

    def body(self, status: str, output: list[dict[str, Any]], usage: dict | None = None,
             error: dict | None = None, **after: Any) -> str:
        """The response object's JSON text (`after`: members past usage)."""
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        head = {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": error, "incomplete_details": incomplete}
        tail = {"output": output, "usage": usage, **after}
        return "{" + members(head) + "," + self.settings + "," + members(tail) + "}"

    async def finished(self, output: Callable[[], list[dict[str, Any]]], final: Any, plan: ChatPlan,
                       state: ServerState) -> tuple[str, str]:
        """The response's status and JSON text once the engine request finished (`final`: its last
        output, `output()` its items). With logprobs the items and the text are built in a worker
        thread, as chat's body is (server/serving.py `built`)."""
        c = final.outputs[0]
        status = "incomplete" if c.finish_reason == "length" else "completed"
        reasoning = await _reasoning_tokens(state, plan, c)
        usage = {"input_tokens": len(plan.ids),
                 "input_tokens_details": {"cached_tokens": max(getattr(final, "num_cached_tokens", 0) or 0, 0)},
                 "output_tokens": len(c.token_ids), "output_tokens_details": {"reasoning_tokens": reasoning},
                 "total_tokens": len(plan.ids) + len(c.token_ids)}
        done = {"completed_at": int(time.time())} if status == "completed" else {}
        detent = {**state.fingerprint(), "seeds": seeds([final])}
        text = await built(lambda: self.body(status, output(), usage, **done, detent=detent),
                           plan.top_logprobs is not None)
        return status, text


def _text_echo(text: ResponseText | None) -> dict[str, Any]:
    f = text.format if text is not None else None
    if f is None or f.type != "json_schema":
        out: dict[str, Any] = {"format": {"type": f.type if f is not None else "text"}}
    else:
        out = {"format": f.model_dump(by_alias=True, exclude_none=True)}
    if text is not None and text.verbosity is not None:
        out["verbosity"] = text.verbosity
    return out


async def _reasoning_tokens(state: ServerState, plan: ChatPlan, c: Any) -> int:
    """output_tokens_details.reasoning_tokens: the tokens of the reasoning's text (vLLM counts
    those between `<think>` and `</think>`); decoding runs on the preprocessing pool."""
    span = plan.shape.reasoner.span(c.text) if plan.shape.reasoner is not None else None
    if span is None or span[0] == span[1]:
        return 0
    decode = functools.partial(state.tokenizer.decode, skip_special_tokens=plan.params.skip_special_tokens)
    return await state.preprocess.run(tokens_within, list(c.token_ids), span, decode)


class OutputEvents:
    """A streamed response's output items, from its deltas (server/chat_output.py's
    `reasoning`, `content` and `tool_calls` pieces, which every reader has held back
    as needed): an item is opened when the pieces change kind and the previous one
    closed, with the events that say so (without `sequence_number`: the writer's). The events
    share the items' state: each is to be written before the next is asked for."""

    def __init__(self, logprobs: bool):
        self.items: list[dict[str, Any]] = []
        self.index: dict[str, int] = {}  # item id -> its output_index
        self.open: dict[str, Any] | None = None  # the item being written: the last of `items`
        self.calls: dict[int, dict[str, Any]] = {}  # tool call index -> its item
        self.logprobs = logprobs
        self.pending: list[dict] = []  # logprobs not yet sent with an output_text delta
        self.held: list[dict[str, Any]] = []  # calls the opening announced, not yet begun

    def opening(self, delta: dict[str, Any]) -> None:
        """The stream's opening delta: a named forced function is announced before any token,
        but its item waits for its first piece, which may follow a reasoning block."""
        self.held = list(delta.get("tool_calls") or [])

    def pieces(self, delta: dict[str, Any], logprobs: list[dict] | None) -> Iterator[dict[str, Any]]:
        """The events of one step's delta: reasoning, then content, then tool call pieces."""
        self.pending += logprobs or []
        if delta.get("reasoning"):
            yield from self._text("reasoning", delta["reasoning"])
        if delta.get("content"):
            yield from self._text("message", delta["content"])
        calls = delta.get("tool_calls") or []
        if calls:
            calls, self.held = self.held + calls, []
        for call in calls:
            yield from self._call(call)

    def end(self, incomplete: bool) -> Iterator[dict[str, Any]]:
        """Begins the calls still held, and closes the last item (incomplete when the output
        was cut short)."""
        for call in self.held:
            yield from self._call(call)
        if self.open is not None:
            yield from self._close("incomplete" if incomplete else "completed")

    def _where(self, item: dict[str, Any]) -> dict[str, Any]:
        return {"item_id": item["id"], "output_index": self.index[item["id"]]}

    def _begin(self, item: dict[str, Any], first: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """Opens `item` (`first`: its state when added) after closing the open one."""
        if self.open is not None:
            yield from self._close("completed")
        self.index[item["id"]] = len(self.items)
        self.items.append(item)
        self.open = item
        yield {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": first}
        if item["type"] != "function_call":
            part = {**item["content"][0], "text": ""}
            yield {"type": "response.content_part.added", **self._where(item), "content_index": 0, "part": part}

    def _text(self, kind: str, piece: str) -> Iterator[dict[str, Any]]:
        if self.open is None or self.open["type"] != kind:
            if kind == "reasoning":
                item = reasoning_item(item_id("rs"), "", "in_progress")
            else:
                item = message_item(item_id("msg"), "", [] if self.logprobs else None, "in_progress")
            yield from self._begin(item, {**item, "content": []})
        part = self.open["content"][0]
        part["text"] += piece
        if kind == "reasoning":
            yield {"type": "response.reasoning_text.delta", **self._where(self.open), "content_index": 0,
                   "delta": piece}
            return
        sent, self.pending = self.pending, []
        if self.logprobs:
            part["logprobs"] += sent
        yield {"type": "response.output_text.delta", **self._where(self.open), "content_index": 0, "delta": piece,
               "logprobs": _without_bytes(sent)}

    def _call(self, call: dict[str, Any]) -> Iterator[dict[str, Any]]:
        fn = call["function"]
        if "id" in call:  # announced: a new function_call item
            item = call_item(item_id("fc"), call["id"], fn["name"], "", "in_progress")
            self.calls[call["index"]] = item
            yield from self._begin(item, dict(item))
        item = self.calls[call["index"]]
        if item is not self.open:
            raise RuntimeError(f"tool call {call['index']}'s arguments arrived after its item closed")
        if fn.get("arguments"):
            item["arguments"] += fn["arguments"]
            yield {"type": "response.function_call_arguments.delta", **self._where(item), "delta": fn["arguments"]}

    def _close(self, status: str) -> Iterator[dict[str, Any]]:
        item, self.open = self.open, None
        item["status"] = status
        where = self._where(item)
        if item["type"] == "function_call":
            yield {"type": "response.function_call_arguments.done", **where, "arguments": item["arguments"]}
        else:
            part = item["content"][0]
            if item["type"] == "reasoning":
                yield {"type": "response.reasoning_text.done", **where, "content_index": 0, "text": part["text"]}
            else:
                yield {"type": "response.output_text.done", **where, "content_index": 0, "text": part["text"],
                       "logprobs": _without_bytes(part.get("logprobs") or [])}
            yield {"type": "response.content_part.done", **where, "content_index": 0, "part": part}
        yield {"type": "response.output_item.done", "output_index": where["output_index"], "item": item}


def _without_bytes(entries: list[dict]) -> list[dict]:
    """Logprobs in the stream events' shape (no `bytes`)."""
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]
