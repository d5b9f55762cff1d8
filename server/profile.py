"""`POST /start_profile` and `POST /stop_profile`: vLLM's profiler routes (`vllm bench serve
--profile` calls them around a load). The window runs where the engine steps, as
`--profiler-config` set it (engine/profiler.py); without that flag both answer 404 saying
how to turn profiling on. Behind the API key when one is set: a window writes files on the
server. The body is ignored (the load generator sends a completion request's).
"""
from __future__ import annotations

from fastapi import FastAPI
from fastapi.responses import JSONResponse

from detent.engine import start_profile, stop_profile
from detent.server.errors import APIError
from detent.server.serving import ServerState

PROFILE_PATHS = ("/start_profile", "/stop_profile")


def _config(state: ServerState):
    if state.profiler_config is None:
        raise APIError(404, "profiling is off on this server: start detent-serve with --profiler-config "
                            "'{\"profiler\": \"torch\", \"torch_profiler_dir\": \"DIR\"}'", code="profiler_off")
    return state.profiler_config


def add_profile_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/start_profile")
    async def start() -> JSONResponse:
        r = await state.engine.call(start_profile, _config(state))
        if not r["started"]:
            raise APIError(409, "a profiling window is already open: POST /stop_profile first",
                           code="profiler_running")
        return JSONResponse(r)

    @app.post("/stop_profile")
    async def stop() -> JSONResponse:
        _config(state)
        return JSONResponse(await state.engine.call(stop_profile))
