"""/v1/responses: OpenAI's Responses API, as `vllm serve` offers it, on the chat path.

A request becomes the chat request it means (server/responses_input.py), and
server/chat.py's `prepare_chat` makes the engine request a chat request
would: the same template rendering, tools, constraints, sampling parameters
and `ChatOutput` shaping. The answer is written in the Responses shape
(server/responses_output.py): the response object, or with `stream: true`
its events, each `event: TYPE` and `data: JSON` with an increasing
`sequence_number`:

    response.created, response.in_progress
    per output item: response.output_item.added, then
      reasoning: response.content_part.added, response.reasoning_text.delta ...,
                 response.reasoning_text.done, response.content_part.done
      message:   response.content_part.added, response.output_text.delta ...,
                 response.output_text.done, response.content_part.done
      function_call: response.function_call_arguments.delta ..., .done
    and response.output_item.done
    response.completed, or response.incomplete (cut by max_output_tokens),
      carrying the whole response

An error once the stream has started is an `error` event, then
`response.failed`. Nothing is stored: every response says `"store": false`.
"""
from __future__ import annotations

import itertools
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from detent.server.chat import ChatPlan, choice_steps, prepare_chat
from detent.server.errors import APIError
from detent.server.generation import Generation
from detent.server.protocol import ChatCompletionRequest, ResponsesRequest
from detent.server.responses_input import NAMES, to_chat_request
from detent.server.responses_output import (OutputEvents, ResponseHead, output_items, output_logprobs,
                                            request_settings)
from detent.server.serving import ServerState, SSEResponse, json_text_response, sse, sse_data


def translated(state: ServerState, req: ResponsesRequest) -> tuple[ResponsesRequest, ChatCompletionRequest, str]:
    """`req`, the chat request it means and the settings its response objects repeat (JSON text).
    The route runs this where the body is validated (server/serving.py `read_body`), on the pool
    for a large body: the translation validates the tools and messages again, and on the event
    loop 200,000 tools held /health for 1 s; the settings hold the tools, encoded once here."""
    return req, to_chat_request(req, getattr(state.tokenizer, "chat_template", None)), request_settings(req)


async def create_response(req: ResponsesRequest, chat_req: ChatCompletionRequest, settings: str, request: Request,
                          state: ServerState) -> Response:
    plan = await prepare_chat(chat_req, state, NAMES)
    rid = req.request_id or f"resp_{uuid.uuid4().hex}"
    gen = await Generation(state, rid, [plan.ids], [plan.params], endpoint="/v1/responses").start()
    head = ResponseHead.of(rid, settings, plan)
    if req.stream:
        return SSEResponse(_events(chat_req, gen, plan, head), on_close=gen.close)
    finals = await gen.finals(request)
    if finals is None:
        return Response(status_code=499)
    (out,) = finals
    c = out.outputs[0]

    def items() -> list[dict[str, Any]]:
        message, _ = plan.shape.message(c.text, c.finish_reason)
        return output_items(message, output_logprobs(plan, c), c.finish_reason == "length")
    _, body = await head.finished(items, out, plan, state)
    return json_text_response(body)


async def _events(req: ChatCompletionRequest, gen: Generation, plan: ChatPlan,
                  head: ResponseHead) -> AsyncIterator[bytes]:
    seq = itertools.count()

    def event(e: dict[str, Any]) -> bytes:
        return sse({**e, "sequence_number": next(seq)}, event=e["type"])

    def with_response(kind: str, response: str) -> bytes:  # `response`: the object's JSON text
        return sse_data(f'{{"type":"{kind}","response":{response},"sequence_number":{next(seq)}}}', event=kind)

    start = head.body("in_progress", [])
    yield with_response("response.created", start)
    yield with_response("response.in_progress", start)
    out = OutputEvents(plan.top_logprobs is not None)
    stream = plan.shape.stream()
    try:
        out.opening(stream.opening())
        async for step in choice_steps(gen, {0: stream}, req.stop, req.include_stop_str_in_output):
            for e in out.pieces(step.delta, output_logprobs(plan, step.output, *step.tokens)):
                yield event(e)
        final = gen.final[0]
        for e in out.end(final.outputs[0].finish_reason == "length"):
            yield event(e)
        status, body = await head.finished(lambda: _all_logprobs(out.items, plan, final), final, plan, gen.state)
    except APIError as e:
        err = e
    except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
        err = APIError(500, f"internal error: {type(e).__name__}: {e}")
    else:
        yield with_response(f"response.{status}", body)
        return
    info = err.body()["error"]
    yield event({"type": "error", "code": str(info["code"]), "message": err.message, "param": err.param})
    failed = {"code": "server_error" if err.status >= 500 else "invalid_prompt", "message": err.message}
    yield with_response("response.failed", head.body("failed", out.items, error=failed))


def _all_logprobs(items: list[dict[str, Any]], plan: ChatPlan, final: Any) -> list[dict[str, Any]]:
    """The finished stream's items with the message's logprobs those of every generated token,
    as in the non-streamed response (the deltas carried them as the text came)."""
    logprobs = output_logprobs(plan, final.outputs[0])
    message = next((item for item in items if item["type"] == "message"), None)
    if logprobs is not None and message is not None:
        message["content"][0]["logprobs"] = logprobs
    return items
