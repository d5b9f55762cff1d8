"""What every endpoint shares: the server state, reading a body, model
checks, running engine requests while watching for the client to leave,
and the SSE response that aborts its requests when the client goes.
"""
from __future__ import annotations

import asyncio
import functools
import json
import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse as _JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.responses import Response, StreamingResponse

from detent.server.async_engine import AsyncEngine
from detent.server.body import parse_json, receive_body
from detent.server.errors import APIError, validation_error
from detent.server.formatting import TokenText
from detent.server.limits import ServerLimits
from detent.server.metrics import Metrics, metric_label
from detent.server.preprocess import Preprocessor
from detent.server.request_stats import RequestStats

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Any  # detent.server.tokens.TokenizerAdapter
    served_model_names: list[str]
    model_root: str
    max_model_len: int
    tuple_hash: str
    deployment_hash: str
    selection: str = "pinned"
    vocab_size: int | None = None
    eos_token_ids: tuple[int, ...] | None = None  # the engine's (EngineLimits): requests' mask tables built on the pool
    block_size: int | None = None  # the engine's (EngineLimits): prompts' block hashes made on the pool (Generation)
    api_key: str | None = None
    limits: ServerLimits = field(default_factory=ServerLimits)
    metrics: Metrics | None = None
    preprocess: Preprocessor | None = None
    allowed_weight_dirs: tuple[str, ...] = ()  # POST /v1/update_weights reads only inside these (server/weights.py)
    created: int = field(default_factory=lambda: int(time.time()))
    sampling_defaults: dict[str, Any] = field(default_factory=dict)  # --generation-config (server/generation_config.py)
    log_stats: bool = False  # the periodic stats line (server/stats_log.py); --disable-log-stats: off
    log_requests: bool = False  # --enable-log-requests: one INFO line per request (server/generation.py)
    max_log_len: int | None = None  # --max-log-len: prompt characters and token ids a DEBUG request line shows
    engine_fingerprint: Any = None  # LLMEngine.fingerprint(): hashes, facts, tuple (request log, /v1/verify)
    request_log: Any = None  # --request-log: server/request_log.RequestLog
    profiler_config: Any = None  # --profiler-config: engine/profiler.ProfilerConfig (server/profile.py)
    cache_config: dict[str, str] = field(default_factory=dict)  # the KV cache, for detent:cache_config_info
    reasoning_parser: str | None = None  # --reasoning-parser (server/reasoning.py)
    tool_parser: str | None = None  # --tool-call-parser, under --enable-auto-tool-choice (server/tool_parsers.py)
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: the request field's default
    force_include_usage: bool = False  # --enable-force-include-usage: every stream carries usage (server/generation.py)
    # the HTTP app (server/app.py): --root-path, --disable-fastapi-docs, and CORSMiddleware's arguments
    # (--allowed-origins, --allowed-methods, --allowed-headers, --allow-credentials; None: vLLM's defaults)
    root_path: str = ""
    openapi: bool = True
    cors: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.preprocess is None:
            self.preprocess = Preprocessor(self.tokenizer, self.limits, self.max_model_len)
        if self.metrics is None:
            self.metrics = Metrics(metric_label(self.served_model_names[0]), self.max_model_len, self.fingerprint(),
                                   self.cache_config)
        self.engine.observer = RequestStats(self.metrics)  # the engine's outputs feed the per-request metrics

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> str:
        if model is None or model in self.served_model_names:
            return self.model_name if model is None else model
        raise APIError(404, f"The model `{model}` does not exist; this server serves "
                            f"{', '.join(repr(n) for n in self.served_model_names)}.",
                       param="model", code="model_not_found")

    def fingerprint(self) -> dict[str, str]:
        """The verifiability record every response carries."""
        return {"tuple_hash": self.tuple_hash, "deployment_hash": self.deployment_hash,
                "selection": self.selection}

    def token_text(self, as_ids: bool | None) -> TokenText:
        """Logprobs' token strings; `as_ids`: the request's return_tokens_as_token_ids (None: the server's)."""
        return TokenText(lambda ids: self.tokenizer.decode(ids, skip_special_tokens=False),
                         self.return_tokens_as_token_ids if as_ids is None else as_ids)

    @property
    def system_fingerprint(self) -> str:
        return f"detent-{self.deployment_hash[:16]}-{self.tuple_hash[:16]}"


# Bodies over this many bytes are parsed, checked and validated on the preprocessing pool: on
# the event loop, a 16 MiB body of empty lists held /health and every stream for 12 s (its
# parse, server/body.py's walk and pydantic all cost time in the number of values it holds).
OFF_LOOP_BODY_BYTES = 64 << 10


async def checked_body(state: ServerState, raw: bytes, build: Callable[[bytes], T]) -> T:
    """`build(raw)` (parse, check, validate): on the event loop for a small body, the pool for a large one."""
    if len(raw) <= OFF_LOOP_BODY_BYTES:
        return build(raw)
    return await state.preprocess.run(build, raw)


async def read_body(request: Request, state: ServerState, cls: type[M]) -> M:
    """The JSON body as `cls`: 413/408 over the size/time limits, 400 if malformed or mistyped."""
    return await read_body_into(request, state, cls, _itself)


async def read_body_into(request: Request, state: ServerState, cls: type[M], then: Callable[[M], T]) -> T:
    """`then(body)` of the body as `cls`, run where the body is validated (on the pool for a large
    one): work in the body's size, as /v1/responses' translation into a chat request."""
    return await checked_body(state, await receive_body(request, state.limits),
                              functools.partial(_validated, cls, state.vocab_size, then))


def _itself(body: M) -> M:
    return body


def _validated(cls: type[M], vocab_size: int | None, then: Callable[[M], T], raw: bytes) -> T:
    try:  # the vocabulary bounds logit_bias's size (server/protocol.py)
        body = cls.model_validate(parse_json(raw), context={"vocab_size": vocab_size})
    except ValidationError as e:
        raise validation_error(e) from None
    return then(body)


async def wait_disconnect(request: Request) -> None:
    while True:
        msg = await request.receive()
        if msg["type"] == "http.disconnect":
            return


class ClientGone(Exception):
    pass


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Runs `work`; if the client disconnects first, cancels it (which aborts its requests)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    raise ClientGone()


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """Interleaves several async iterators as (index, item); closing it closes them all."""
    q: asyncio.Queue = asyncio.Queue()
    _END = object()

    async def pump(i: int, it: AsyncIterator[T]) -> None:
        try:
            async for item in it:
                await q.put((i, item))
            await q.put((i, _END))
        except BaseException as e:  # noqa: BLE001 - re-raised on the consumer side
            await q.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    live = len(tasks)
    try:
        while live:
            i, item = await q.get()
            if item is _END:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


# A lone UTF-16 surrogate in a response string is written as its JSON escape ("\\ud800"),
# the same string to a JSON parser: as itself it cannot be encoded, and the response was a
# 500 or a stream cut off mid-body. Requests cannot carry one (server/body.py), but the
# model's JSON can: a tool call whose arguments hold "\\ud800" parses to one.
_LONE_SURROGATES = "backslashreplace"


class JSONResponse(_JSONResponse):
    """Starlette's JSON response, always encodable (_LONE_SURROGATES): the generation routes' bodies."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=False, allow_nan=False, indent=None,
                          separators=(",", ":")).encode("utf-8", _LONE_SURROGATES)


async def built(build: Callable[[], T], off_loop: bool) -> T:
    """`build()` of a response body: with `off_loop` (logprobs asked for) in a worker thread. Up
    to --max-logprob-entries entries make a body of tens of MB, whose formatting held the event
    loop, and so /health and every stream, for seconds (2.4 s for 51 MB on 2 cores)."""
    if off_loop:
        return await asyncio.to_thread(build)
    return build()


async def respond(build: Callable[[], dict], off_loop: bool) -> JSONResponse:
    """A generation route's whole JSON response from `build()`, built and encoded as `built` says."""
    return await built(lambda: JSONResponse(build()), off_loop)


def json_text_response(text: str) -> Response:
    """A JSON body already encoded as text (JSONResponse's encoding, done by its caller)."""
    return Response(text.encode("utf-8", _LONE_SURROGATES), media_type="application/json")


def sse(obj: Any, event: str | None = None) -> bytes:
    """One server-sent event; `event` names it (the Responses API's events are named by their type)."""
    return sse_data(json.dumps(obj, ensure_ascii=False, separators=(',', ':')), event)


def sse_data(data: str, event: str | None = None) -> bytes:
    """One server-sent event whose data is JSON text already."""
    head = f"event: {event}\n" if event is not None else ""
    return f"{head}data: {data}\n\n".encode("utf-8", _LONE_SURROGATES)


class SSEResponse(StreamingResponse):
    """Server-sent events that stop (and so abort their requests) when the client leaves.

    Whatever the ASGI spec version, a task listens for `http.disconnect`
    while the stream runs; either ending cancels the other, and the body
    generator is closed so its `finally` aborts the engine requests.
    """

    def __init__(self, content: AsyncIterator[bytes], on_close: Callable[[], None] | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", **(headers or {})})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:  # type: ignore[override]
        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass

        streamer = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(watch())
        done: set = set()
        try:
            done, _ = await asyncio.wait({streamer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (streamer, watcher):
                t.cancel()
            await asyncio.gather(streamer, watcher, return_exceptions=True)
            await self.body_iterator.aclose()  # type: ignore[union-attr]
            if self.on_close is not None:
                self.on_close()
        if streamer in done and streamer.exception() is not None and not isinstance(streamer.exception(), OSError):
            raise streamer.exception()
