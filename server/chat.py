"""/v1/chat/completions: messages through the model's chat template."""
from __future__ import annotations

import copy
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from detent.engine import cut_at_final_message, open_final_message, text_content
from detent.sampling.params import SamplingParams, StructuredOutputs
from detent.server.chat_output import ChatOutput, ChoiceStream
from detent.server.errors import bad_request
from detent.server.formatting import ChoiceDelta, TokenText, chat_logprobs, prompt_logprobs_json, usage
from detent.server.generation import Generation, output_error, seeds, sse_events
from detent.server.params import (FieldNames, bad_words_ids, check_counts, check_logprob_entries, check_prompt_ids,
                                  check_stop_chars, resolve_max_tokens, sampling_params_per_prompt,
                                  structured_outputs)
from detent.server.protocol import ChatCompletionRequest, ChatMessage, TokenizeRequest
from detent.server.reasoning import END, ReasoningParser
from detent.server.serving import ServerState, SSEResponse, respond
from detent.server.tools import tool_constraint


def messages_to_dicts(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    out = []
    for i, m in enumerate(messages):
        d = m.model_dump(exclude_none=True)
        try:
            d["content"] = text_content(m.content, f"messages[{i}].content")
        except ValueError as e:
            raise bad_request(str(e), f"messages[{i}].content") from None
        out.append(d)
    return out


RENDERER_FIELDS = {"add_generation_prompt", "continue_final_message"}  # the request's own fields
RENDERER_SETS = RENDERER_FIELDS | {"messages", "range"}  # (range: the renderer's time-bounded one)


def client_template(req: ChatCompletionRequest | TokenizeRequest, trusted: bool) -> dict[str, Any]:
    """The template kwargs a request may pass: a client's own template only when the
    server trusts them (--trust-request-chat-template), as vLLM does; its tools, which the
    template describes to the model (the chat prompt, and /tokenize's count of it)."""
    kwargs = dict(getattr(req, "chat_template_kwargs", None) or {})
    clash = sorted(RENDERER_SETS & kwargs.keys())  # the renderer passes these itself: a TypeError, before
    if clash:
        name = clash[0]
        raise bad_request(f"chat_template_kwargs.{name}: the server sets this template variable itself"
                          + (f"; give {name} as the request's own field" if name in RENDERER_FIELDS else ""),
                          f"chat_template_kwargs.{name}")
    template = getattr(req, "chat_template", None)
    param = "chat_template"
    if "chat_template" in kwargs:
        template, param = kwargs.pop("chat_template"), "chat_template_kwargs.chat_template"
    if template is not None:
        if not trusted:
            raise bad_request(f"{param}: this server does not accept chat templates in requests; it renders "
                              f"with the model's own (start it with --trust-request-chat-template to allow them)",
                              param)
        if not isinstance(template, str):
            raise bad_request(f"{param} must be a string, got {type(template).__name__}", param)
        kwargs["chat_template"] = template
    if req.tools:
        kwargs["tools"] = req.tools
    return kwargs


def check_generation_prompt(req: ChatCompletionRequest | TokenizeRequest) -> None:
    """As vLLM: continue_final_message goes on the last message's text, so an explicit
    add_generation_prompt: true beside it asks for two endings of the prompt (a 400)."""
    if req.continue_final_message and req.add_generation_prompt and "add_generation_prompt" in req.model_fields_set:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true: the first "
                          "continues the last message, the second opens a new assistant turn", "continue_final_message")


async def chat_prompt_ids(state: ServerState, messages: list[ChatMessage], add_generation_prompt: bool,
                          continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
                          param: str = "messages") -> list[int]:
    # on the pool, as the rendering: a 16 MiB body holds 550,000 empty messages, 0.6 s of the event loop
    dicts, final = await state.preprocess.run(messages_to_dicts, messages), None
    if continue_final_message:
        try:
            dicts, final = open_final_message(dicts)
        except ValueError as e:
            raise bad_request(str(e), "continue_final_message") from None
    text = await state.preprocess.render(dicts, add_generation_prompt and not continue_final_message,
                                         kwargs or {}, param)
    if final is not None:
        try:
            text = cut_at_final_message(text, final)
        except ValueError as e:
            raise bad_request(str(e), "continue_final_message") from None
    return await state.preprocess.encode(text, param, add_special_tokens=False)


@dataclass(frozen=True)
class ChatPlan:
    """What a chat request becomes: the engine request, and how its output is shaped."""
    model: str
    ids: list[int]  # the prompt: the messages through the chat template
    params: SamplingParams
    shape: ChatOutput
    top_logprobs: int | None  # logprobs per generated token: the top k, or None (not asked for)
    tok: TokenText


async def prepare_chat(req: ChatCompletionRequest, state: ServerState, names: FieldNames = FieldNames()) -> ChatPlan:
    """Checks a chat request and makes its engine request (both /v1/chat/completions and
    /v1/responses, whose requests become chat requests, come through here)."""
    model = state.check_model(req.model)
    check_counts(req, state.limits, 1)
    check_generation_prompt(req)
    if req.stream and req.prompt_logprobs is not None:  # as vLLM: a chat stream has no place for them
        raise bad_request("prompt_logprobs are not available when stream=true; ask without streaming, or "
                          "stream /v1/completions with the rendered prompt", "prompt_logprobs")
    if req.tools == []:  # as vLLM and OpenAI: leave the field out for no tools
        raise bad_request("tools must not be an empty array: give at least one tool, or leave tools out", "tools")
    # a forced call's schema is validated like any structured output: on the preprocessing pool
    tool_so, tool_mode = (await state.preprocess.run(tool_constraint, req.tools, req.tool_choice, state.tool_parser)
                          if req.tools else tool_constraint(req.tools, req.tool_choice, state.tool_parser))
    kwargs = client_template(req, state.limits.trust_request_chat_template)
    if req.reasoning_effort is not None:  # a template variable, as vLLM passes it
        if kwargs.get("reasoning_effort", req.reasoning_effort) != req.reasoning_effort:
            raise bad_request(f"{names.reasoning_effort} and chat_template_kwargs.reasoning_effort differ; give one",
                              names.reasoning_effort)
        kwargs["reasoning_effort"] = req.reasoning_effort
    ids = await chat_prompt_ids(state, req.messages, req.add_generation_prompt, req.continue_final_message, kwargs,
                                names.messages)
    check_prompt_ids(ids, None, names.messages)
    structured = await structured_outputs(req, state.preprocess, names)
    if tool_so is not None:
        if structured is not None:
            raise bad_request("tool_choice forces a tool call; it cannot be combined with another "
                              "structured-output constraint", "tool_choice")
        structured = tool_so
    shape, structured = _output_shape(req, state, structured, tool_mode)
    if req.max_tokens is not None and req.max_completion_tokens is not None:
        raise bad_request("give max_tokens or max_completion_tokens, not both", "max_completion_tokens")
    param = names.max_tokens or ("max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens")
    mt = resolve_max_tokens(req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
                            len(ids), state.max_model_len, param, state.sampling_defaults.get("max_tokens"))
    if req.top_logprobs is not None and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs=true", "top_logprobs")
    k = (req.top_logprobs or 0) if req.logprobs else None
    check_logprob_entries(state.limits, [len(ids)], [mt], req.n, k, req.prompt_logprobs, 1)
    check_stop_chars(req.stop, state.preprocess)
    bad_words = await bad_words_ids(req, state.preprocess)
    (params,) = await sampling_params_per_prompt(state.preprocess, req, [mt], logprobs=k,
                                                 prompt_logprobs=req.prompt_logprobs, structured=structured,
                                                 vocab_size=state.vocab_size, defaults=state.sampling_defaults,
                                                 bad_words=bad_words, eos_token_ids=state.eos_token_ids)
    return ChatPlan(model, ids, params, shape, k, state.token_text(req.return_tokens_as_token_ids))


async def create_chat_completion(req: ChatCompletionRequest, request: Request, state: ServerState) -> Response:
    plan = await prepare_chat(req, state)
    rid = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    gen = await Generation(state, rid, [plan.ids], [plan.params], endpoint="/v1/chat/completions").start()
    ctx = dict(id=rid, created=int(time.time()), model=plan.model, system_fingerprint=state.system_fingerprint)
    if req.stream:
        return SSEResponse(_stream(req, gen, plan, ctx), on_close=gen.close)
    finals = await gen.finals(request)
    if finals is None:
        return Response(status_code=499)
    (out,), k, tok = finals, plan.top_logprobs, plan.tok

    def body() -> dict:
        choices = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            message, finish = plan.shape.message(c.text, c.finish_reason)
            choices.append({
                "index": c.index, "message": message,
                "logprobs": chat_logprobs(c.token_ids, c.logprobs or [], k, tok) if k is not None else None,
                "finish_reason": finish, "stop_reason": getattr(c, "stop_reason", None)})
        b = {**ctx, "object": "chat.completion", "choices": choices,
             "usage": usage(gen.prompt_tokens, gen.completion_tokens),
             "detent": {**state.fingerprint(), "seeds": seeds([out])}}
        if req.prompt_logprobs is not None:
            b["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, tok)
        return b
    return await respond(body, off_loop=k is not None or req.prompt_logprobs is not None)


def _output_shape(req: ChatCompletionRequest, state: ServerState, structured: StructuredOutputs | None,
                  tool_mode: str | None) -> tuple[ChatOutput, StructuredOutputs | None]:
    """How the choices' text becomes the response (server/chat_output.py), and the constraint
    to run. Under a reasoning parser a constraint binds after `</think>`, as vLLM's structured
    outputs do, when `</think>` is one token of the vocabulary (as in the models these parsers
    are for); otherwise the output is constrained from its first token and holds no reasoning."""
    auto = state.tool_parser if req.tools and req.tool_choice in (None, "auto") else None
    tools = tuple(req.tools) if auto is not None else ()  # qwen3_coder converts values by their schema
    if state.reasoning_parser is None:
        if not req.include_reasoning:
            raise bad_request("include_reasoning: false needs a reasoning parser to find the reasoning in the "
                              "output; start detent-serve with --reasoning-parser", "include_reasoning")
        return ChatOutput(tool_mode=tool_mode, tool_parser=auto, tools=tools), structured
    reasoner = ReasoningParser.for_request(state.reasoning_parser, req.chat_template_kwargs)
    if structured is not None and reasoner.thinking:
        end = state.tokenizer.encode(END, add_special_tokens=False)
        if len(end) == 1:  # a copy, not replace(), which checked the schema again on the event loop
            structured = copy.copy(structured)  # (its meta-schema: 223 ms for 1,000 properties)
            structured.start_after_token_ids = end
        else:
            reasoner = None
    return ChatOutput(reasoner, True, req.include_reasoning, tool_mode, auto, tools), structured


def _stream(req: ChatCompletionRequest, gen: Generation, plan: ChatPlan, ctx: dict) -> AsyncIterator[bytes]:
    ctx = {**ctx, "object": "chat.completion.chunk"}
    return sse_events(_chunks(req, gen, plan, ctx), gen, ctx, req.stream_options)


@dataclass(frozen=True)
class ChoiceStep:
    """One engine step of one choice, as its stream sees it."""
    output: Any  # the choice's cumulative output (token_ids, logprobs, finish_reason, ...)
    delta: dict[str, Any]  # server/chat_output.py's delta: content, reasoning, tool_calls pieces
    news: bool  # whether the delta carries anything
    tokens: tuple[int, int]  # the step's new tokens: output.token_ids[t0:t1]
    finished: bool


async def choice_steps(gen: Generation, streams: dict[int, ChoiceStream], stop: str | list[str] | None,
                       include_stop: bool) -> AsyncIterator[ChoiceStep]:
    """Per engine step and choice, the choice's next delta (ChoiceStream.next, after the stop
    strings' hold-back); a choice is done after its finished step. Chat and Responses streams."""
    deltas = {j: ChoiceDelta(list([stop] if isinstance(stop, str) else (stop or [])), include_stop) for j in streams}
    finished: set[int] = set()  # the engine keeps reporting a finished choice while its siblings run
    async for _, out in gen:
        err = output_error(out)
        if err is not None:
            raise err
        for c in out.outputs:
            if c.index in finished:
                continue
            done = c.finish_reason is not None
            if done:
                finished.add(c.index)
            text, t0, t1 = deltas[c.index].next(c.text, len(c.token_ids), done)
            delta, news = streams[c.index].next(text, done)
            yield ChoiceStep(c, delta, news, (t0, t1), done)


async def _chunks(req: ChatCompletionRequest, gen: Generation, plan: ChatPlan, ctx: dict) -> AsyncIterator[dict]:
    """Per choice: the role, then a delta per step (server/chat_output.py: content, reasoning,
    tool call fragments), the last one with the finish reason."""
    streams = {j: plan.shape.stream() for j in range(req.n)}
    for j in range(req.n):
        yield {**ctx, "choices": [{"index": j, "delta": streams[j].opening(), "logprobs": None,
                                   "finish_reason": None}], "usage": None}
    k = plan.top_logprobs
    async for step in choice_steps(gen, streams, req.stop, req.include_stop_str_in_output):
        (t0, t1), c = step.tokens, step.output
        if not step.news and t0 == t1 and not step.finished:
            continue  # tokens with no new piece still send their logprobs
        lps = None
        if k is not None:
            lps = chat_logprobs(c.token_ids[t0:t1], (c.logprobs or [])[t0:t1], k, plan.tok)
        done = step.finished
        yield {**ctx, "choices": [{
            "index": c.index, "delta": step.delta, "logprobs": lps,
            "finish_reason": streams[c.index].finish_reason(c.finish_reason) if done else None,
            "stop_reason": getattr(c, "stop_reason", None) if done else None}], "usage": None}
