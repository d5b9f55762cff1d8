"""`POST /v1/update_weights`: a trainer in another process pushes new weights.

Body: `{"path": "/dir/or/file.safetensors"}`. Behind the API key (the /v1/
middleware), and only for a path (after resolving symlinks) inside a
directory the operator allowed with `--allowed-weight-dir`; without that
flag the route refuses every call (403). The tensors are read from the
server's disk (never sent over HTTP) and applied by `LLM.update_weights`:
checked whole before anything is copied, then the prefix cache is reset.
409 while requests are running; 400 naming the tensors for a checkpoint
that does not fit the model.
"""
from __future__ import annotations

import os

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict

from detent.engine import CheckpointError, WeightUpdateBusy, WeightUpdateError, update_weights_from_file
from detent.server.errors import APIError
from detent.server.serving import ServerState, read_body


class UpdateWeightsRequest(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")
    path: str


def allowed_path(path: str, allowed_dirs: tuple[str, ...]) -> str:
    """The resolved path if it lies inside one of `allowed_dirs`; else a 403."""
    if not allowed_dirs:
        raise APIError(403, "weight updates are disabled on this server: start detent-serve with "
                            "--allowed-weight-dir DIR", param="path", code="weight_updates_disabled")
    if "\x00" in path:  # no file name holds one (os.path.realpath raised ValueError: a 500)
        raise APIError(400, "path holds a NUL character, which no file name can", param="path")
    real = os.path.realpath(path)
    for d in allowed_dirs:
        root = os.path.realpath(d)
        if os.path.commonpath([real, root]) == root:
            return real
    raise APIError(403, f"path {path!r} is not inside an allowed weight directory (--allowed-weight-dir)",
                   param="path", code="path_not_allowed")


def add_weight_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/update_weights")
    async def update_weights(request: Request) -> JSONResponse:
        req = await read_body(request, state, UpdateWeightsRequest)
        real = allowed_path(req.path, state.allowed_weight_dirs)
        try:  # runs where the engine lives, between two steps
            n = await state.engine.call(update_weights_from_file, real)
        except WeightUpdateBusy as e:
            raise APIError(409, str(e), param="path", code="requests_running") from None
        except (CheckpointError, WeightUpdateError) as e:
            raise APIError(400, str(e), param="path") from None
        return JSONResponse({"object": "weight_update", "path": real, "num_tensors": n})
