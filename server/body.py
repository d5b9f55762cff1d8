"""A request body from the socket to a checked JSON object, before pydantic sees it.

The checks here are the ones a typed model cannot make, or makes too late:
- size (413) and time (408: a body sent slower than its Content-Length
  would hold the connection and its buffer forever);
- JSON that Python's parser refuses in its own ways (RecursionError on deep
  nesting, ValueError on 4,300+ digit integers, NaN/Infinity literals);
- depth, so nothing downstream (pydantic, jsonschema, xgrammar) recurses
  through a client's nesting;
- strings that are not Unicode scalar values (a lone surrogate such as
  "\\ud800" is legal JSON, but no tokenizer, encoder or socket takes it);
- integers that do not fit 64 bits, and non-finite floats (1e999).
Each failure is a 4xx naming the JSON path and the limit.
"""
from __future__ import annotations

import asyncio
import json
import math
import sys
from typing import Any

from fastapi import Request

from detent.server.errors import APIError, bad_request, dotted
from detent.server.limits import JSON_INT_MAX, JSON_INT_MIN, MAX_JSON_DEPTH, ServerLimits


async def _receive(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body of {declared} bytes is over the limit of {limit} bytes "
                            f"(--max-request-bytes)", code="request_too_large")
    buf = bytearray()
    async for chunk in request.stream():
        buf += chunk
        if len(buf) > limit:
            raise APIError(413, f"request body is over the limit of {limit} bytes (--max-request-bytes)",
                           code="request_too_large")
    return bytes(buf)


async def receive_body(request: Request, limits: ServerLimits) -> bytes:
    """The raw body: 413 over --max-request-bytes, 408 if not all there within --request-timeout,
    415 if compressed (a gzip body was a 400 quoting the UTF-8 decoder on its magic bytes)."""
    encoding = request.headers.get("content-encoding", "").strip().lower()
    if encoding not in ("", "identity"):
        raise APIError(415, f"Content-Encoding {encoding[:40]!r} is not supported: send the JSON body uncompressed",
                       code="unsupported_content_encoding")
    try:
        return await asyncio.wait_for(_receive(request, limits.max_request_bytes), limits.request_timeout_s)
    except asyncio.TimeoutError:
        # the client may still be sending: answer and close, never read on
        raise APIError(408, f"the request body was not received within {limits.request_timeout_s:g} s "
                            f"(--request-timeout)", code="request_timeout",
                       headers={"Connection": "close"}) from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(raw: bytes, allow_list: bool = False) -> Any:
    """The body as a checked JSON object (or, with `allow_list`, array): a 400 naming what is wrong, and where."""
    try:
        obj = json.loads(raw, parse_constant=_no_constant)
    except RecursionError:
        raise bad_request(f"the JSON body is nested deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, 4,300+ digit integers, NaN
        if "int_max_str_digits" in str(e):  # Python's message names its own setting
            raise bad_request(f"malformed JSON body: an integer has more than {sys.get_int_max_str_digits():,} "
                              "digits") from None
        raise bad_request(f"malformed JSON body: {e}") from None
    if not isinstance(obj, (dict, list) if allow_list else dict):
        raise bad_request(f"the body must be a JSON object{' or array' if allow_list else ''}, "
                          f"got {type(obj).__name__}")
    check_json(obj)
    return obj


def _check_str(s: str, path: tuple) -> None:
    if s.isascii():
        return
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        where = dotted(path)
        raise bad_request(f"{where}: the string contains a lone UTF-16 surrogate "
                          f"({s[e.start]!r} at index {e.start}), which is not a Unicode character",
                          where) from None


def _check_int(v: int, path: tuple) -> None:
    if not JSON_INT_MIN <= v <= JSON_INT_MAX:
        where = dotted(path)
        raise bad_request(f"{where}: the integer {str(v)[:40]}{'...' if len(str(v)) > 40 else ''} is outside "
                          f"the 64-bit range [-2**63, 2**64 - 1]", where)


def _int_list(v: list) -> bool:
    """A flat list of ints (token ids) is checked in C, not element by element."""
    return bool(v) and set(map(type, v)) == {int}


def check_json(obj: Any) -> None:
    """Depth, strings, integers and floats of a parsed body, iteratively (no recursion)."""
    stack: list[tuple[Any, int, tuple]] = [(obj, 0, ())]
    while stack:
        v, depth, path = stack.pop()
        if isinstance(v, str):
            _check_str(v, path)
        elif isinstance(v, bool) or v is None:
            continue
        elif isinstance(v, int):
            _check_int(v, path)
        elif isinstance(v, float):
            if not math.isfinite(v):
                raise bad_request(f"{dotted(path)}: {v} is not a finite number", dotted(path))
        elif depth >= MAX_JSON_DEPTH:
            raise bad_request(f"{dotted(path)}: the JSON body is nested deeper than {MAX_JSON_DEPTH} levels",
                              dotted(path))
        elif isinstance(v, dict):
            for k, x in v.items():
                _check_str(k, path + (k,))
                stack.append((x, depth + 1, path + (k,)))
        elif _int_list(v):
            lo, hi = min(v), max(v)
            if lo < JSON_INT_MIN or hi > JSON_INT_MAX:
                i = v.index(lo if lo < JSON_INT_MIN else hi)
                _check_int(v[i], path + (i,))
        else:
            stack.extend((x, depth + 1, path + (i,)) for i, x in enumerate(v))
