"""One HTTP request's engine requests, merged.

A completion with several prompts is several engine requests (ids
`<id>-0`, `<id>-1`, ...); each may carry `n` samples. `Generation` runs them
through the `AsyncEngine` (whose observer, server/request_stats.py, feeds the
metrics) and aborts what is unfinished when the consumer stops early.
"""
from __future__ import annotations

import logging
from typing import Any, AsyncIterator

from detent.server.errors import APIError
from detent.server.formatting import usage
from detent.server.serving import ServerState, merge, sse

log = logging.getLogger("detent.server.requests")


def _generated(out: Any) -> int:
    return sum(len(c.token_ids) for c in out.outputs)


def seeds(finals: list[Any]) -> list[int | None]:
    """Per choice, the seed it sampled with (drawn at admission if the request gave none)."""
    return [getattr(c, "seed", None) for o in finals if o is not None
            for c in sorted(o.outputs, key=lambda c: c.index)]


def output_error(out: Any) -> APIError | None:
    """A request the engine failed on its own (e.g. a grammar that did not compile): a 400."""
    for c in out.outputs:
        if c.finish_reason == "error":
            why = getattr(c, "error", None) or getattr(out, "error", None) or getattr(c, "stop_reason", None)
            return APIError(400, f"the request failed in the engine: {why or 'unknown error'}",
                            param="structured_outputs" if why and "grammar" in str(why).lower() else None)
    return None


def usage_options(stream_options: Any) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats); as vLLM, the second counts only with the first."""
    if stream_options is None:
        return False, False
    return stream_options.include_usage, stream_options.include_usage and stream_options.continuous_usage_stats


async def sse_events(chunks: AsyncIterator[dict], gen: "Generation", ctx: dict,
                     stream_options: Any) -> AsyncIterator[str]:
    """An OpenAI event stream: each chunk (carrying the request's usage so far under
    continuous_usage_stats), then the usage chunk when asked for; an error after the
    stream started is reported in-band; always ends [DONE]."""
    include_usage, continuous = usage_options(stream_options)
    try:
        async for chunk in chunks:
            if continuous:
                chunk = {**chunk, "usage": usage(gen.prompt_tokens, gen.tokens_so_far)}
            yield sse(chunk)
        if include_usage:
            yield sse({**ctx, "choices": [], "usage": usage(gen.prompt_tokens, gen.completion_tokens),
                       "detent": {**gen.state.fingerprint(), "seeds": seeds(gen.final)}})
    except APIError as e:
        yield sse(e.body())
    except Exception as e:  # noqa: BLE001 - the stream has started: report in-band
        yield sse(APIError(500, f"internal error: {type(e).__name__}: {e}").body())
    yield "data: [DONE]\n\n"


class Generation:
    def __init__(self, state: ServerState, base_id: str, prompts: list[list[int]], params: list[Any]):
        self.state, self.base_id = state, base_id
        self.prompts, self.params = prompts, params
        self._streams: list[AsyncIterator[Any]] = []
        self.final: list[Any] = [None] * len(prompts)
        self.generated = [0] * len(prompts)  # tokens so far, per engine request
        self.reports_output = True  # False: the response drops the generated tokens (echo, max_tokens 0)

    async def start(self) -> "Generation":
        """Admits every engine request (a refusal is raised here, before any response starts)."""
        self.state.engine.check_admission()
        if self.state.log_requests:
            p = self.params[0]
            log.info("request %s: %d prompt(s), %d prompt tokens, n=%d max_tokens=%s temperature=%s top_p=%s "
                     "top_k=%s seed=%s", self.base_id, len(self.prompts), self.prompt_tokens, p.n,
                     [q.max_tokens for q in self.params], p.temperature, p.top_p, p.top_k, p.seed)
        try:
            for i, (ids, p) in enumerate(zip(self.prompts, self.params)):
                self._streams.append(await self.state.engine.add(self.rid(i), ids, p))
        except BaseException:
            self.close()
            raise
        return self

    def rid(self, i: int) -> str:
        return f"{self.base_id}-{i}"

    def close(self) -> None:
        """Aborts whatever has not finished (the client left, or the response never started)."""
        for i in range(len(self.prompts)):
            if self.final[i] is None:
                self.state.engine.cancel(self.rid(i))

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def completion_tokens(self) -> int:
        """What `usage` reports: the finished requests' tokens, the response's only."""
        return sum(_generated(o) for o in self.final if o is not None) if self.reports_output else 0

    @property
    def tokens_so_far(self) -> int:
        return sum(self.generated) if self.reports_output else 0

    async def __aiter__(self) -> AsyncIterator[tuple[int, Any]]:
        it = merge(self._streams)
        try:
            async for i, out in it:
                self.generated[i] = _generated(out)
                if out.finished:
                    self.final[i] = out
                yield i, out
        finally:
            await it.aclose()

    async def run(self) -> list[Any]:
        """Until every engine request finished: the final cumulative outputs."""
        try:
            async for _ in self:
                pass
        finally:
            self.close()
        return self.final
