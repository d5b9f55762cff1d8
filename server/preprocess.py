"""Tokenizing and chat-template rendering: off the event loop, and bounded.

Both cost time in proportion to what a client sends (a 15 MB prompt took
10 s to tokenize; a template with nested loops froze every route, /health
included). So they run on a small thread pool, never on the event loop,
and each is bounded before or while it runs:
- a prompt's characters are checked against `max_model_len x
  --max-chars-per-token` before it is tokenized: longer text cannot fit;
- rendering stops once its output passes that many characters, or after
  `--chat-template-timeout` seconds, checked between the pieces Jinja
  produces and on every step of `range` (the template's only way to loop
  without data). A client's own template is refused unless the server runs
  with --trust-request-chat-template (vLLM's rule): a template is code.
At most `--preprocess-workers` jobs run at once; the rest wait their turn
on the event loop, costing nothing.
"""
from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, TypeVar

from detent.server.errors import APIError, bad_request
from detent.server.limits import ServerLimits

T = TypeVar("T")
_CHECK_EVERY = 1024  # range steps between clock reads


class TimedRange:
    """Jinja's `range` for one rendering: Python's range (with the sandbox's size
    limit) whose iteration stops the rendering at the deadline."""

    def __init__(self, r: range, deadline: float, limit_s: float):
        self.r, self.deadline, self.limit_s = r, deadline, limit_s

    @classmethod
    def factory(cls, deadline: float, limit_s: float) -> Callable[..., "TimedRange"]:
        from jinja2.sandbox import MAX_RANGE

        def timed_range(*args: int) -> TimedRange:
            r = range(*args)
            if len(r) > MAX_RANGE:
                raise OverflowError(f"range of {len(r)} items is over the template limit of {MAX_RANGE}")
            return cls(r, deadline, limit_s)
        return timed_range

    def __len__(self) -> int:
        return len(self.r)

    def __getitem__(self, i):
        return self.r[i]

    def __contains__(self, x) -> bool:
        return x in self.r

    def __iter__(self) -> Iterator[int]:
        for k, i in enumerate(self.r):
            if k % _CHECK_EVERY == 0:
                _check_deadline(self.deadline, self.limit_s)
            yield i

    def __reversed__(self) -> Iterator[int]:
        return iter(TimedRange(self.r[::-1], self.deadline, self.limit_s))


def _too_slow(limit_s: float, param: str = "messages") -> APIError:
    return bad_request(f"rendering the chat template took over {limit_s:g} s (--chat-template-timeout)", param)


def _check_deadline(deadline: float, limit_s: float, param: str = "messages") -> None:
    if time.monotonic() > deadline:
        raise _too_slow(limit_s, param)


class Preprocessor:
    def __init__(self, tokenizer: Any, limits: ServerLimits, max_model_len: int):
        self.tokenizer, self.limits, self.max_model_len = tokenizer, limits, max_model_len
        self.max_chars = limits.max_prompt_chars(max_model_len)
        self.pool = ThreadPoolExecutor(limits.preprocess_workers, thread_name_prefix="detent-preprocess")
        self._slots: asyncio.Semaphore | None = None

    def shutdown(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, fn: Callable[..., T], *args: Any, timeout_s: float | None = None) -> T:
        """`fn(*args)` on the pool; a slot is held until the thread is done with it,
        even when the request that asked has gone (a thread cannot be stopped).
        With `timeout_s`, the caller stops waiting that long after the job started."""
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.limits.preprocess_workers)
        await self._slots.acquire()
        try:
            fut = asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)
        except BaseException:
            self._slots.release()
            raise
        fut.add_done_callback(lambda _: self._slots.release())
        return await asyncio.wait_for(asyncio.shield(fut), timeout_s)

    def check_chars(self, n: int, param: str) -> None:
        if n > self.max_chars:
            raise APIError(400, f"{param} has {n} characters, over the limit of {self.max_chars}: "
                                f"{self.max_model_len} tokens of context (--max-model-len) x "
                                f"{self.limits.chars_per_token} characters per token (--max-chars-per-token); "
                                f"it cannot fit the context", param=param, code="context_length_exceeded")

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        self.check_chars(len(text), param)
        return await self.run(self.tokenizer.encode, text, add_special_tokens)

    async def decode(self, ids: list[int]) -> str:
        return await self.run(self.tokenizer.decode, ids, False)

    async def render(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict[str, Any],
                     param: str = "messages") -> str:
        """The conversation through the chat template; errors name `param` (the request's messages)."""
        limit_s = self.limits.chat_template_timeout_s
        try:
            # the thread checks its own deadline; this answers the client even when
            # the template is stuck in one operation the thread cannot interrupt
            return await self.run(self._render, messages, add_generation_prompt, kwargs, param,
                                  timeout_s=limit_s + 1.0)
        except asyncio.TimeoutError:
            raise _too_slow(limit_s, param) from None

    def _render(self, messages: list[dict], add_generation_prompt: bool, kwargs: dict[str, Any], param: str) -> str:
        """On a pool thread: the rendering, stopped at the time and size bounds."""
        self.check_chars(sum(len(m.get("content") or "") for m in messages), param)  # a pass over every message
        limit_s = self.limits.chat_template_timeout_s
        deadline = time.monotonic() + limit_s
        kw = {**kwargs, "range": TimedRange.factory(deadline, limit_s)}
        chunks = getattr(self.tokenizer, "chat_template_chunks", None)
        try:
            if chunks is None:  # a tokenizer without piecewise rendering: bounded by range only
                pieces: Any = iter([self.tokenizer.apply_chat_template(messages, add_generation_prompt, **kw)])
            else:
                pieces = chunks(messages, add_generation_prompt, **kw)
            out, n = [], 0
            for piece in pieces:
                n += len(piece)
                if n > self.max_chars:
                    raise bad_request(f"the chat template's output passed {self.max_chars} characters "
                                      f"(--max-model-len x --max-chars-per-token) and was stopped", param)
                _check_deadline(deadline, limit_s, param)
                out.append(piece)
        except APIError:
            raise
        except Exception as e:  # a template that raises on these messages is the request's fault
            raise bad_request(f"the chat template could not render these messages: {e}", param) from None
        return "".join(out)
