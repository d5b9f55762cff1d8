"""One HTTP request's engine requests, merged.

A completion with several prompts is several engine requests (ids
`<id>-0`, `<id>-1`, ...); each may carry `n` samples. `Generation` runs them
through the `AsyncEngine` (whose observer, server/request_stats.py, feeds the
metrics) and aborts what is unfinished when the consumer stops early.
With `--request-log`, each engine request that finishes is handed to the
request log (server/request_log.py), which builds and writes its record off
the event loop.
"""
from __future__ import annotations

import functools
import logging
import time
import uuid
from typing import Any, AsyncIterator

from detent.server.errors import APIError
from detent.server.formatting import usage
from detent.server.serving import ClientGone, ServerState, merge, sse, unless_disconnected

log = logging.getLogger("detent.server.requests")


def _generated(out: Any) -> int:
    return sum(len(c.token_ids) for c in out.outputs)


def seeds(finals: list[Any]) -> list[int | None]:
    """Per choice, the seed it sampled with (drawn at admission if the request gave none)."""
    return [getattr(c, "seed", None) for o in finals if o is not None
            for c in sorted(o.outputs, key=lambda c: c.index)]


def _entries(prompt: list[int], params: Any, out: Any) -> int:
    """About how many values a request's record holds: tokens x (top-k + 1), prompt and output."""
    n = len(prompt) * ((params.prompt_logprobs or 0) + 1)
    return n + sum(len(c.token_ids) for c in out.outputs) * ((params.logprobs or 0) + 1)


def output_error(out: Any) -> APIError | None:
    """A request the engine failed on its own (e.g. a grammar that did not compile): a 400."""
    for c in out.outputs:
        if c.finish_reason == "error":
            why = getattr(c, "error", None) or getattr(out, "error", None) or getattr(c, "stop_reason", None)
            return APIError(400, f"the request failed in the engine: {why or 'unknown error'}",
                            param="structured_outputs" if why and "grammar" in str(why).lower() else None)
    return None


def usage_options(stream_options: Any, force: bool = False) -> tuple[bool, bool]:
    """(include_usage, continuous_usage_stats); as vLLM, the second counts only with the first, and
    `force` (--enable-force-include-usage) turns both on."""
    if force:
        return True, True
    if stream_options is None:
        return False, False
    return stream_options.include_usage, stream_options.include_usage and stream_options.continuous_usage_stats


async def sse_events(chunks: AsyncIterator[dict], gen: "Generation", ctx: dict,
                     stream_options: Any) -> AsyncIterator[bytes]:
    """An OpenAI event stream: each chunk (carrying the request's usage so far under
    continuous_usage_stats), then the usage chunk when asked for; an error after the
    stream started is reported in-band; always ends [DONE]."""
    include_usage, continuous = usage_options(stream_options, gen.state.force_include_usage)
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
    yield b"data: [DONE]\n\n"


class Generation:
    def __init__(self, state: ServerState, base_id: str, prompts: list[list[int]], params: list[Any], *,
                 endpoint: str = "", texts: list[str | None] | None = None, log_record: bool = True):
        self.state, self.base_id = state, base_id
        self.prompts, self.params = prompts, params
        self.endpoint, self.texts = endpoint, texts or [None] * len(prompts)
        self.log_record = log_record and state.request_log is not None  # POST /v1/verify's replays: not logged
        self.arrival = time.time()
        self._streams: list[AsyncIterator[Any]] = []
        self.final: list[Any] = [None] * len(prompts)
        self.generated = [0] * len(prompts)  # tokens so far, per engine request
        self.reports_output = True  # False: the response drops the generated tokens (echo, max_tokens 0)
        # the engine's ids carry a random suffix, as vLLM's: a client's request_id need not be unique
        # (a retry, or a trace id on several requests), and two requests never share an engine request
        self._engine_tag = uuid.uuid4().hex[:8]

    async def start(self) -> "Generation":
        """Admits every engine request (a refusal is raised here, before any response starts)."""
        self.state.engine.check_admission()
        if self.state.log_requests:
            p = self.params[0]
            log.info("request %s: %d prompt(s), %d prompt tokens, n=%d max_tokens=%s temperature=%s top_p=%s "
                     "top_k=%s seed=%s", self.base_id, len(self.prompts), self.prompt_tokens, p.n,
                     [q.max_tokens for q in self.params], p.temperature, p.top_p, p.top_k, p.seed)
            if log.isEnabledFor(logging.DEBUG):  # the prompts, as vLLM logs them: cut to --max-log-len
                cut = self.state.max_log_len
                for i, (ids, text) in enumerate(zip(self.prompts, self.texts)):
                    log.debug("request %s details: prompt: %r, prompt_token_ids: %s", self.rid(i),
                              text if text is None or cut is None else text[:cut], ids if cut is None else ids[:cut])
        try:
            prompts = await self._engine_prompts()
            for i, (ids, p) in enumerate(zip(prompts, self.params)):
                self._streams.append(await self.state.engine.add(self.engine_id(i), ids, p))
        except BaseException:
            self.close()
            raise
        return self

    async def _engine_prompts(self) -> list[Any]:
        """The prompts as the engine gets them: given its block size, each with its blocks' prefix-cache
        hashes made on the pool (`HashedPrompt`, under the engine's extra keys: none), which its step
        thread then takes (a 32k-token prompt's took 6.4 ms there, a pause of every running request)."""
        st = self.state
        if st.block_size is None or st.preprocess is None:
            return self.prompts
        from detent.engine import HashedPrompt
        return await st.preprocess.run(lambda: [HashedPrompt.of(ids, st.block_size) for ids in self.prompts])

    def rid(self, i: int) -> str:
        """The i-th sample's id as the client and the request log see it."""
        return f"{self.base_id}-{i}"

    def engine_id(self, i: int) -> str:
        return f"{self.rid(i)}-{self._engine_tag}"

    def close(self) -> None:
        """Aborts whatever it admitted that has not finished (the client left, or the response
        never started): its own engine requests only."""
        for i in range(len(self._streams)):
            if self.final[i] is None:
                self.state.engine.cancel(self.engine_id(i))

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
                    if self.log_record:
                        self._log(i, out)
                yield i, out
        finally:
            await it.aclose()

    def _log(self, i: int, out: Any) -> None:
        from detent.engine import request_record
        st = self.state
        st.request_log.submit(functools.partial(
            request_record, request_id=self.rid(i), endpoint=self.endpoint, model=st.model_name,
            fp=st.engine_fingerprint, prompt=self.texts[i], prompt_token_ids=self.prompts[i],
            params=self.params[i], output=out, arrival=self.arrival, finished=time.time()),
            entries=_entries(self.prompts[i], self.params[i], out))

    async def run(self) -> list[Any]:
        """Until every engine request finished: the final cumulative outputs."""
        try:
            async for _ in self:
                pass
        finally:
            self.close()
        return self.final

    async def finals(self, request: Any) -> list[Any] | None:
        """`run()` for a non-streamed response: None when the client left first (its requests
        aborted); a request the engine failed on is raised (`output_error`)."""
        try:
            finals = await unless_disconnected(request, self.run())
        except ClientGone:
            return None
        for out in finals:
            err = output_error(out)
            if err is not None:
                raise err
        return finals
