"""/v1/completions: prompt as text, texts, token ids or lists of token ids."""
from __future__ import annotations

import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from detent.server.errors import bad_request
from detent.server.formatting import ChoiceDelta, TokenText, completion_logprobs, prompt_logprobs_json, usage
from detent.server.generation import Generation, output_error, seeds, sse_events
from detent.server.params import (bad_words_ids, check_counts, check_logprob_entries, check_prompt_ids,
                                  check_stop_chars, resolve_max_tokens, sampling_params_per_prompt,
                                  structured_outputs)
from detent.server.protocol import CompletionRequest
from detent.server.serving import ServerState, SSEResponse, respond


def _split(p: Any) -> tuple[list[str] | None, list[list[int]] | None]:
    """(texts, token id lists): exactly one is not None."""
    if isinstance(p, str):
        return [p], None
    if not p:
        raise bad_request("prompt is empty", "prompt")
    if isinstance(p[0], str):
        return p, None
    if isinstance(p[0], int):
        return None, [p]
    return None, p


async def _prompts(texts: list[str] | None, ids_list: list[list[int]] | None,
                   state: ServerState, add_special_tokens: bool = True) -> list[tuple[str | None, list[int]]]:
    out = []
    if texts is not None:
        for i, t in enumerate(texts):
            param = f"prompt[{i}]" if len(texts) > 1 else "prompt"
            ids = await state.preprocess.encode(t, param, add_special_tokens)
            check_prompt_ids(ids, None, param)
            out.append((t, ids))
    else:
        for i, ids in enumerate(ids_list):
            check_prompt_ids(list(ids), state.vocab_size, f"prompt[{i}]" if len(ids_list) > 1 else "prompt")
            out.append((None, list(ids)))
    return out


async def create_completion(req: CompletionRequest, request: Request, state: ServerState) -> Response:
    model = state.check_model(req.model)
    texts, ids_list = _split(req.prompt)
    check_counts(req, state.limits, len(texts or ids_list))
    if req.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of must equal n ({req.n}) when given, got {req.best_of}", "best_of")
    prompts = await _prompts(texts, ids_list, state, req.add_special_tokens)
    structured = await structured_outputs(req, state.preprocess)
    prompt_lp = req.prompt_logprobs
    if req.echo and req.logprobs is not None:
        prompt_lp = max(prompt_lp or 0, req.logprobs)
    # echo with max_tokens 0 (prompt scoring, as vLLM): the engine runs one step for the
    # prompt's logprobs; the token it samples is dropped from the response
    mt0 = 1 if _echo_only(req) else req.max_tokens
    mts = [resolve_max_tokens(mt0, len(ids), state.max_model_len, "max_tokens",
                              state.sampling_defaults.get("max_tokens")) for _, ids in prompts]
    # each choice repeats its prompt's logprobs: once as prompt_logprobs, once more when echoed
    copies = req.n * ((req.prompt_logprobs is not None) + (req.echo and req.logprobs is not None))
    check_logprob_entries(state.limits, [len(ids) for _, ids in prompts], mts, req.n, req.logprobs, prompt_lp,
                          copies)
    check_stop_chars(req.stop, state.preprocess)
    bad = await bad_words_ids(req, state.preprocess)
    params = await sampling_params_per_prompt(state.preprocess, req, mts, logprobs=req.logprobs,
                                              prompt_logprobs=prompt_lp, structured=structured,
                                              vocab_size=state.vocab_size, defaults=state.sampling_defaults,
                                              bad_words=bad, eos_token_ids=state.eos_token_ids)
    rid = req.request_id or f"cmpl-{uuid.uuid4().hex}"
    gen = Generation(state, rid, [ids for _, ids in prompts], params, endpoint="/v1/completions",
                     texts=[t for t, _ in prompts])
    gen.reports_output = not _echo_only(req)
    await gen.start()
    tok = state.token_text(req.return_tokens_as_token_ids)
    ctx = dict(id=rid, object="text_completion", created=int(time.time()), model=model,
               system_fingerprint=state.system_fingerprint)
    if req.stream:
        return SSEResponse(_stream(req, state, gen, prompts, tok, ctx), on_close=gen.close)
    finals = await gen.finals(request)
    if finals is None:
        return Response(status_code=499)

    def body() -> dict:
        choices = []
        for i, out in enumerate(finals):
            text0, ids = prompts[i]
            for c in sorted(out.outputs, key=lambda c: c.index):
                choices.append(_choice(req, state, tok, i * req.n + c.index, text0, ids, out, c))
        return {**ctx, "choices": choices, "usage": usage(gen.prompt_tokens, gen.completion_tokens),
                "detent": {**state.fingerprint(), "seeds": seeds(finals)}}
    # echo repeats each prompt's text in each of its n choices: up to --max-sequences-per-request copies
    # of a context's text (256 x 32k tokens: a 32 MB body, 0.2 s to encode), from a body of token ids
    return await respond(body, off_loop=req.echo or req.logprobs is not None or prompt_lp is not None)


def _echo_only(req: CompletionRequest) -> bool:
    return req.echo and req.max_tokens == 0


def _generated(req: CompletionRequest, c, t0: int = 0, t1: int | None = None) -> tuple[str, list[int], list]:
    """A choice's generated text, token ids and logprobs in [t0, t1); none for an echo-only request."""
    if _echo_only(req):
        return "", [], []
    return c.text, list(c.token_ids[t0:t1]), list((c.logprobs or [])[t0:t1])


def _prompt_text(state: ServerState, text0: str | None, ids: list[int]) -> str:
    return text0 if text0 is not None else state.tokenizer.decode(ids, skip_special_tokens=False)


def _choice(req, state, tok, index, text0, ids, out, c) -> dict[str, Any]:
    lps = None
    text, tids, tlps = _generated(req, c)
    prefix = _prompt_text(state, text0, ids) if req.echo else ""
    if req.logprobs is not None:
        if req.echo:
            tids, tlps = list(ids) + tids, list(out.prompt_logprobs or [None] * len(ids)) + tlps
        lps = completion_logprobs(tids, tlps, tok)
    ch = {"index": index, "text": prefix + text, "logprobs": lps, "finish_reason": c.finish_reason,
          "stop_reason": getattr(c, "stop_reason", None)}
    if req.prompt_logprobs is not None:
        ch["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, tok)
    return ch


def _stream(req: CompletionRequest, state: ServerState, gen: Generation,
            prompts: list[tuple[str | None, list[int]]], tok: TokenText, ctx: dict) -> AsyncIterator[bytes]:
    return sse_events(_chunks(req, state, gen, prompts, tok, ctx), gen, ctx, req.stream_options)


async def _chunks(req: CompletionRequest, state: ServerState, gen: Generation,
                  prompts: list[tuple[str | None, list[int]]], tok: TokenText, ctx: dict) -> AsyncIterator[dict]:
    deltas: dict[int, ChoiceDelta] = {}
    stop = list([req.stop] if isinstance(req.stop, str) else (req.stop or []))
    async for i, out in gen:
        err = output_error(out)
        if err is not None:
            raise err
        text0, ids = prompts[i]
        for c in out.outputs:
            index = i * req.n + c.index
            d = deltas.get(index)
            first = d is None
            if first:
                d = deltas[index] = ChoiceDelta(stop, req.include_stop_str_in_output)
            done = c.finish_reason is not None
            full, _, _ = _generated(req, c)
            text, t0, t1 = d.next(full, 0 if _echo_only(req) else len(c.token_ids), done)
            if not text and t0 == t1 and not done and not (first and req.echo):
                continue
            lps = None
            if req.logprobs is not None:
                _, tids, tlps = _generated(req, c, t0, t1)
                if first and req.echo:
                    tids, tlps = list(ids) + tids, list(out.prompt_logprobs or [None] * len(ids)) + tlps
                lps = completion_logprobs(tids, tlps, tok)
            if first and req.echo:
                text = _prompt_text(state, text0, ids) + text
            ch = {"index": index, "text": text, "logprobs": lps,
                  "finish_reason": c.finish_reason if done else None,
                  "stop_reason": getattr(c, "stop_reason", None) if done else None}
            if first and req.prompt_logprobs is not None:
                ch["prompt_logprobs"] = prompt_logprobs_json(out.prompt_logprobs, tok)
            yield {**ctx, "choices": [ch], "usage": None}
