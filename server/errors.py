"""Errors in OpenAI's body, with the status a client expects.

Every failure the server reports is an `APIError` carrying its HTTP status,
OpenAI's error `type`, the offending `param` (when there is one) and a
message that names the field or limit. Handlers turn it (and pydantic's
validation errors) into `{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

import re
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from detent.sampling.params import SamplingParams

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    503: "service_unavailable_error",
    500: "internal_server_error",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.code = code
        self.headers = headers or {}

    @property
    def type(self) -> str:
        return _TYPES.get(self.status, "invalid_request_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code if self.code is not None else self.status}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


# the names an engine refusal may open with: the sampling parameters', and the request's own
_REFUSAL_PARAMS = frozenset(SamplingParams.__dataclass_fields__) | {"prompt", "request_id"}


def engine_refusal(e: Exception) -> APIError:
    """The engine's refusal of a request at admission (a ValueError naming the field its message
    opens with, "min_tokens=2 bans ..." or "structured_outputs.json nests ...") as a 400 with
    that field as its param: a request field's name only, never a guess."""
    m = re.match(r"[a-z_]+", str(e))
    return bad_request(str(e), m.group(0) if m and m.group(0) in _REFUSAL_PARAMS else None)


class Overloaded(APIError):
    def __init__(self, queued: int, limit: int, retry_after_s: int = 1):
        super().__init__(503, f"server overloaded: {queued} requests are waiting, over the limit "
                              f"--max-queue-len={limit}; retry later", code="overloaded",
                         headers={"Retry-After": str(retry_after_s)})


class CompilesOverloaded(APIError):
    """The engine refused a structured-output request because its grammar's compile lane is
    full (CompileQueueFull): a 503 with Retry-After, as a full request queue (the request is
    valid and may succeed later: a 400 would tell the client not to retry; a 429 would say
    it, not the server, sent too much), with the same code, so clients that retry on
    "overloaded" need nothing new."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(503, message, param="structured_outputs", code="overloaded",
                         headers={"Retry-After": str(retry_after_s)})


_FILE = re.compile(r"(?:[A-Za-z]:)?[\\/]?(?:[\w.+-]+[\\/])+[\w.+-]+\.(?:py|pyx|c|cc|cpp|cu|cuh|h|hpp|so)\b(?::\d+)?")


def short_reason(why: str, limit: int = 200) -> str:
    """A failure's reason for a client: its first line, without file paths, at most
    `limit` characters. The full text (a C++ stack trace, say) goes to the log."""
    first = next((ln.strip() for ln in str(why).splitlines() if ln.strip()), "unknown error")
    first = _FILE.sub("<file>", first)
    return first if len(first) <= limit else first[: limit - 3] + "..."


class EngineDead(APIError):
    def __init__(self, why: str):
        super().__init__(503, f"the engine has stopped: {short_reason(why)}", code="engine_dead",
                         headers={"Retry-After": "30"})


_TYPE_TAG = re.compile(r"^(str|int|float|bool|none|list|dict|[a-z-]+\[.*\])$")


def _path(loc: tuple) -> tuple[tuple, tuple]:
    """(path to the field, union member tags): pydantic puts a union member's name in `loc`."""
    loc = tuple(p for p in loc if p != "body")
    for i, p in enumerate(loc):
        if isinstance(p, str) and _TYPE_TAG.match(p):
            return loc[:i], (p,)
    return loc, ()


_KEY_CHARS = 64  # a longer key in a path is cut: as itself, a 1M-character key made a 2 MB 400 (message and param)


def dotted(path: tuple) -> str:
    out = ""
    for p in path:
        if isinstance(p, str) and len(p) > _KEY_CHARS:
            p = p[:_KEY_CHARS] + "..."
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    # a key holding a lone surrogate (server/body.py refuses it by this path) is escaped: as
    # itself it would make the error body unencodable, a 500 in place of the 400
    return (out or "body").encode("utf-8", "backslashreplace").decode("utf-8")


def _show(v: Any) -> str:
    r = repr(v)
    return r if len(r) < 60 else type(v).__name__


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """One 400 for every wrong field type, naming each field and what it expected.

    A union field fails once per member; it is reported once, as the
    members it accepts and the value it got."""
    groups: dict[tuple, list[tuple[tuple, dict]]] = {}  # by the whole path: dotted() cuts a long key
    for e in exc.errors():
        path, tags = _path(tuple(e.get("loc", ())))
        groups.setdefault(path, []).append((tags, e))
    msgs = []
    for path, group in list(groups.items())[:8]:
        where = dotted(path)
        if len(group) > 1 or group[0][0]:
            kinds = list(dict.fromkeys(t[0] for t, _ in group if t))
            got = min(group, key=lambda g: len(g[1].get("loc", ())))[1].get("input")
            msgs.append(f"{where}: expected {' or '.join(kinds)} (got {_show(got)})")
        else:
            e = group[0][1]
            msgs.append(f"{where}: {e.get('msg', 'invalid')} (got {_show(e.get('input'))})")
    more = f" (and {len(groups) - 8} more fields)" if len(groups) > 8 else ""
    first = next(iter(groups), None)
    return APIError(400, "invalid request: " + "; ".join(msgs) + more, param=None if first is None else dotted(first))


async def request_validation_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(exc).response()


async def http_exception_handler(request: Request, exc: HTTPException) -> JSONResponse:
    """Routing errors (404 no such path, 405 wrong method) in OpenAI's body, not FastAPI's `detail`."""
    if exc.status_code == 404:
        msg, code = f"no route {request.method} {request.url.path}", "not_found"
    elif exc.status_code == 405:
        allow = (exc.headers or {}).get("Allow") or (exc.headers or {}).get("allow")
        msg, code = f"method {request.method} is not allowed on {request.url.path}" + \
            (f" (allowed: {allow})" if allow else ""), "method_not_allowed"
    else:
        msg, code = str(exc.detail), None
    return APIError(exc.status_code, msg, code=code, headers=dict(exc.headers or {})).response()


async def unhandled_handler(_: Request, exc: Exception) -> JSONResponse:
    # Starlette re-raises after this response, and uvicorn logs the traceback
    return APIError(500, f"internal error: {type(exc).__name__}: {short_reason(str(exc))}").response()
