"""The FastAPI application: routes, auth, verifiability headers, error handlers."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.middleware.cors import CORSMiddleware

from detent.server import chat, completions, responses
from detent.server.errors import (APIError, http_exception_handler, request_validation_handler, short_reason,
                                  unhandled_handler)
from detent.server.profile import PROFILE_PATHS, add_profile_routes
from detent.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ResponsesRequest,
                                    TokenizeRequest)
from detent.server.serving import ServerState, read_body, read_body_into
from detent.server.verify import add_verify_route
from detent.server.weights import add_weight_routes

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")
HASH_HEADERS = ("x-detent-tuple-hash", "x-detent-deployment-hash")
# vLLM's CORS defaults: any origin, method and header, no credentials
CORS_DEFAULTS = {"allow_origins": ["*"], "allow_methods": ["*"], "allow_headers": ["*"], "allow_credentials": False}


def route_path(scope, root_path: str) -> str:
    """The path the routes see: behind --root-path, without that prefix when the proxy kept
    it (as Starlette strips it)."""
    path = scope.get("path", "")
    if root_path and (path == root_path or path.startswith(root_path + "/")):
        return path[len(root_path):]
    return path


class DetentASGIMiddleware:
    """Adds the tuple and deployment hashes to every response; checks the API key on /v1/*.

    A plain ASGI middleware (not BaseHTTPMiddleware) so streaming responses
    and disconnect detection pass through untouched.
    """

    def __init__(self, app, state: ServerState):
        self.app, self.state = app, state
        self.headers = [(name.encode(), value.encode())
                        for name, value in zip(HASH_HEADERS, (state.tuple_hash, state.deployment_hash))]

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def send_with_headers(msg):
            if msg["type"] == "http.response.start":
                headers = list(msg.get("headers", [])) + self.headers
                if msg.get("status") == 500 and not any(k.lower() == b"connection" for k, _ in headers):
                    # uvicorn drops the connection after an unhandled error; say so,
                    # or a pooling client sends its next request into a closed socket
                    headers.append((b"connection", b"close"))
                msg = {**msg, "headers": headers}
            await send(msg)

        key = self.state.api_key
        path = route_path(scope, self.state.root_path)
        if key and (path.startswith("/v1/") or path in ("/tokenize", "/detokenize", *PROFILE_PATHS)):
            auth = dict(scope.get("headers", [])).get(b"authorization", b"").decode("latin-1")
            scheme, _, given = auth.partition(" ")
            if not auth:
                err = APIError(401, "missing API key: send the header `Authorization: Bearer <key>`",
                               code="invalid_api_key")
            elif scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), key.encode()):
                err = APIError(401, "incorrect API key provided", code="invalid_api_key")
            else:
                err = None
            if err is not None:
                return await err.response()(scope, receive, send_with_headers)
        await self.app(scope, receive, send_with_headers)


def build_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        if state.engine._thread is None:
            state.engine.start(asyncio.get_running_loop())
        ticker = None
        if state.log_stats:
            from detent.server.stats_log import interval_s, log_stats_forever
            ticker = asyncio.ensure_future(log_stats_forever(state.metrics, state.engine, interval_s()))
        yield
        if ticker is not None:
            ticker.cancel()
        state.engine.shutdown()
        state.preprocess.shutdown()
        if state.request_log is not None:
            state.request_log.close()

    # vLLM serves the schema and its two pages unless --disable-fastapi-docs
    docs = state.openapi
    app = FastAPI(title="Detent", lifespan=lifespan, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.root_path = state.root_path  # as vLLM sets it: routes match with the prefix or without
    app.state.detent = state

    async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
        if request.url.path in GENERATION_PATHS:
            state.metrics.rejected.inc()
        return exc.response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, request_validation_handler)
    app.add_exception_handler(HTTPException, http_exception_handler)
    app.add_exception_handler(Exception, unhandled_handler)

    @app.get("/health")
    @app.get("/ping")  # vLLM's (SageMaker's) name for the same probe, by GET or POST: one route each, so
    @app.post("/ping")  # each method has its own operation id in the OpenAPI schema
    async def health() -> Response:
        if state.engine.running:
            return JSONResponse({"status": "ok"})
        # the engine thread logged the full error; a prober gets one line without paths
        return JSONResponse({"status": "unhealthy", "reason": short_reason(state.engine.dead or "engine not running")},
                            status_code=503)

    @app.head("/health")  # load balancers probe by HEAD: the status alone
    async def health_head() -> Response:
        return Response(status_code=200 if state.engine.running else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        body = state.metrics.render(state.engine.stats(), state.engine.running, state.engine.step_times)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> Response:
        from detent import __version__
        return JSONResponse({"version": __version__, **state.fingerprint()})

    @app.get("/v1/models")
    async def models() -> Response:
        data = [{"id": n, "object": "model", "created": state.created, "owned_by": "detent",
                 "root": state.model_root, "parent": None, "max_model_len": state.max_model_len}
                for n in state.served_model_names]
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def create_completion(request: Request) -> Response:
        req = await read_body(request, state, CompletionRequest)
        return await completions.create_completion(req, request, state)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request) -> Response:
        req = await read_body(request, state, ChatCompletionRequest)
        return await chat.create_chat_completion(req, request, state)

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        req, chat_req, settings = await read_body_into(request, state, ResponsesRequest,
                                                       functools.partial(responses.translated, state))
        return await responses.create_response(req, chat_req, settings, request, state)

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> Response:
        from detent.server.tokenizer_info import tokenizer_info
        return JSONResponse(tokenizer_info(state.tokenizer))

    @app.post("/v1/tokenize")
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await read_body(request, state, TokenizeRequest)
        state.check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt or messages", param="prompt")
        if req.messages is not None:
            chat.check_generation_prompt(req)
            ids = await chat.chat_prompt_ids(state, req.messages, req.add_generation_prompt, req.continue_final_message,
                                             kwargs=chat.client_template(req, state.limits.trust_request_chat_template))
        else:
            ids = await state.preprocess.encode(req.prompt, "prompt", req.add_special_tokens)
        body = {"count": len(ids), "max_model_len": state.max_model_len, "tokens": ids}
        if req.return_token_strs:  # a lookup per id: bounded as the prompt is
            body["token_strs"] = [state.tokenizer.id_to_token(i) for i in ids]
        return JSONResponse(body)

    @app.post("/v1/detokenize")
    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await read_body(request, state, DetokenizeRequest)
        state.check_model(req.model)
        from detent.server.params import check_prompt_ids
        if req.tokens:
            check_prompt_ids(req.tokens, state.vocab_size, "tokens")
        return JSONResponse({"prompt": await state.preprocess.decode(req.tokens)})

    add_weight_routes(app, state)
    add_verify_route(app, state)
    add_profile_routes(app, state)
    # CORS outside the API key: a browser's preflight carries no key (vLLM's key check lets it
    # through too), and a 401 carries the CORS headers a page needs to read it, as the hash headers
    wrapped = CORSMiddleware(DetentASGIMiddleware(app, state), **(state.cors or CORS_DEFAULTS),
                             expose_headers=list(HASH_HEADERS))
    wrapped.fastapi = app  # type: ignore[attr-defined]
    return wrapped  # type: ignore[return-value]
