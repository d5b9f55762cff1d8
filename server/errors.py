"""Errors in OpenAI's body, with the status a client expects.

Every failure the server reports is an `APIError` carrying its HTTP status,
OpenAI's error `type`, the offending `param` (when there is one) and a
message that names the field or limit. Handlers turn it (and pydantic's
validation errors) into `{"error": {"message", "type", "param", "code"}}`.
"""
from __future__ import annotations

from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "invalid_request_error",
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


class Overloaded(APIError):
    def __init__(self, queued: int, limit: int, retry_after_s: int = 1):
        super().__init__(503, f"server overloaded: {queued} requests are waiting, over the limit "
                              f"--max-queue-len={limit}; retry later", code="overloaded",
                         headers={"Retry-After": str(retry_after_s)})


class EngineDead(APIError):
    def __init__(self, why: str):
        super().__init__(503, f"the engine has stopped: {why}", code="engine_dead",
                         headers={"Retry-After": "30"})


def _loc(loc: tuple) -> str:
    parts = [str(p) for p in loc if p not in ("body",)]
    out = ""
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or "body"


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """One 400 for every wrong field type, naming each field and what it expected."""
    errs = exc.errors()
    # a union field fails once per member: report it once, listing the members
    by_field: dict[str, list[dict]] = {}
    for e in errs:
        loc = tuple(p for p in e.get("loc", ()) if p != "body")
        by_field.setdefault(str(loc[0]) if loc else "body", []).append(e)
    msgs, first = [], None
    for name, group in list(by_field.items())[:8]:
        e = group[0]
        got = e.get("input")
        shown = repr(got) if not isinstance(got, (dict, list)) or len(repr(got)) < 60 else type(got).__name__
        if len(group) > 1 and all(len(g.get("loc", ())) >= 2 and g.get("input") is got for g in group):
            kinds = [str(tuple(p for p in g["loc"] if p != "body")[1]) for g in group]
            where = name
            msgs.append(f"{where}: expected one of {', '.join(kinds)} (got {shown})")
        else:
            where = _loc(tuple(e.get("loc", ())))
            msgs.append(f"{where}: {e.get('msg', 'invalid')} (got {shown})")
        first = first or where
    more = f" (and {len(by_field) - 8} more fields)" if len(by_field) > 8 else ""
    return APIError(400, "invalid request: " + "; ".join(msgs) + more, param=first)


async def api_error_handler(_: Request, exc: APIError) -> JSONResponse:
    return exc.response()


async def request_validation_handler(_: Request, exc: RequestValidationError) -> JSONResponse:
    return validation_error(exc).response()


async def unhandled_handler(_: Request, exc: Exception) -> JSONResponse:
    return APIError(500, f"internal error: {type(exc).__name__}: {exc}").response()
