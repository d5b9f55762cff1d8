"""`POST /v1/verify`: re-execute logged requests on this server and compare bits.

Body: one request record of a `--request-log` (docs/verify.md), or an array
of up to `--max-verify-records` of them; "server" records in the array name
the commitment tuples, so a refusal can name the pins that differ. Each
record is checked whole before anything runs (a malformed one is a 400
naming the record and field; n, logprobs, context and logprob volume have
the bounds of /v1/completions); then the records this deployment can
re-execute run through the engine as ordinary requests, queued and batched
with the others, never logged. The answer (200) is the report `detent
verify` writes: per record equal, different (with the first differing
token), refused (another selection, deployment or tuple, naming which
fact), or skipped (aborted or failed requests).
"""
from __future__ import annotations

import functools
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from detent.engine import (Finding, RecordError, check_limits, check_spec_size, check_tuple, compare_output,
                           parse_record, refusal_reason, skip_reason, verify_report)
from detent.server.body import parse_json, receive_body
from detent.server.errors import APIError, bad_request
from detent.server.generation import Generation
from detent.server.params import (MAX_LOGPROBS, check_logprob_entries, check_prompt_ids, check_stop_chars,
                                  resolve_max_tokens)
from detent.server.serving import ClientGone, ServerState, checked_body, unless_disconnected


def _records(body: Any, limit: int) -> tuple[list[Any], dict[str, dict]]:
    """(request records, tuple hash -> tuple) of a body: a record or an array of records."""
    items = body if isinstance(body, list) else [body]
    # counted before any record is parsed: parsing validates a record's parameters and spec
    # (jsonschema's meta-schema, in Python), and 297 records over the limit spent 56 s on the
    # pool before their 400. Anything not a server record is a request record or a 400.
    n = sum(1 for item in items if not (isinstance(item, dict) and item.get("type") == "server"))
    if n > limit:
        raise bad_request(f"{n} request records in one body, over the limit of {limit} (--max-verify-records)")
    requests, tuples = [], {}
    for i, item in enumerate(items):
        where = f"[{i}]" if isinstance(body, list) else "body"
        kind = item.get("type") if isinstance(item, dict) else None
        try:
            if kind == "server":
                if isinstance(item.get("tuple"), dict) and isinstance(item.get("tuple_hash"), str):
                    check_tuple(item["tuple"])  # a refusal names the pins that differ from it
                    tuples[item["tuple_hash"]] = item["tuple"]
                continue
            _check_spec_size(item, where)
            requests.append(parse_record(item))
        except RecordError as e:
            raise bad_request(f"{where}: not a {'server' if kind == 'server' else 'request'} record of the request "
                              f"log: {e}", f"{where}.{e.field}" if isinstance(body, list) else e.field) from None
    if not requests:
        raise bad_request("the body holds no request record to re-execute")
    return requests, tuples


def _check_spec_size(item: Any, where: str) -> None:
    """A record's structured-output spec against the engine's size bound, before parsing the
    record validates it (a 2 MB schema took 11 s against its meta-schema), as the generation
    routes bound theirs (server/params.py)."""
    params = item.get("params") if isinstance(item, dict) else None  # not an object: parse_record names it
    so = params.get("structured_outputs") if isinstance(params, dict) else None
    for kind, value in (so.items() if isinstance(so, dict) else ()):
        if kind in ("json", "regex", "grammar", "choice") and value is not None:
            try:
                check_spec_size(kind, value)
            except ValueError as e:
                raise bad_request(f"{where}: {e}", f"params.structured_outputs.{kind}") from None


def _check_bounds(state: ServerState, records: list[Any]) -> None:
    """The bounds /v1/completions puts on a request, per record (a 400 naming the record and field)."""
    lim = state.limits
    for i, r in enumerate(records):
        try:
            _check_record(state, r)
        except APIError as e:
            e.message = f"record {i} ({r.request_id}): {e.message}"
            raise
    if sum(r.params.n for r in records) > lim.max_sequences:
        raise bad_request(f"the records ask for {sum(r.params.n for r in records)} sequences, over the limit of "
                          f"{lim.max_sequences} (--max-sequences-per-request)", "params.n")


def _check_record(state: ServerState, r: Any) -> None:
    p, lim = r.params, state.limits
    if p.n > lim.max_n:
        raise bad_request(f"params.n={p.n} is over the limit of {lim.max_n} (--max-n)", "params.n")
    for name in ("logprobs", "prompt_logprobs"):
        if (getattr(p, name) or 0) > MAX_LOGPROBS:
            raise bad_request(f"params.{name} must be at most {MAX_LOGPROBS}", f"params.{name}")
    if p.max_tokens is None:
        raise bad_request("params.max_tokens must be a number (the server logs the one it ran)", "params.max_tokens")
    check_prompt_ids(r.prompt_token_ids, state.vocab_size, "prompt_token_ids")
    check_stop_chars(p.stop, state.preprocess, "params.stop")
    resolve_max_tokens(p.max_tokens, len(r.prompt_token_ids), state.max_model_len, "params.max_tokens")
    check_logprob_entries(lim, [len(r.prompt_token_ids)], [p.max_tokens], p.n, p.logprobs, p.prompt_logprobs, 1)


# verify_vocab's names for the fields of a record's params it checks
_VOCAB_FIELDS = {"bad_words": "bad_words_token_ids"}


def _check_admission(records: list[tuple[int, Any]], vocab_size: int | None) -> None:
    """What the engine refuses a record's params for at admission (token ids outside the
    vocabulary, a spec over its grammar limits), for the records that will run: a 400 naming the
    record and its params' field. The engine's refusal named a generation route's field
    (bad_words, structured_outputs) and no record, once the records before it were admitted."""
    for i, r in records:
        p, so = r.params, r.params.structured_outputs
        try:
            if vocab_size is not None:
                p.verify_vocab(vocab_size)
        except ValueError as e:  # its message opens with the field's name
            name, _, rest = str(e).partition(" ")
            field = f"params.{_VOCAB_FIELDS.get(name, name)}"
            raise bad_request(f"record {i} ({r.request_id}): {field} {rest}", field) from None
        if so is not None:
            field = f"params.structured_outputs.{so.kind}"
            try:
                check_limits(so, field=field)
            except ValueError as e:
                raise bad_request(f"record {i} ({r.request_id}): {e}", field) from None


async def verify_records(request: Request, state: ServerState) -> Response:
    if state.engine_fingerprint is None:  # a test server over a fake engine
        raise APIError(501, "this server's engine reports no fingerprint: it cannot verify records")
    body = await checked_body(state, await receive_body(request, state.limits),
                              functools.partial(parse_json, allow_list=True))
    # parsing a record validates its sampling parameters and structured-output spec: on the pool
    records, tuples = await state.preprocess.run(_records, body, state.limits.max_verify_records)
    _check_bounds(state, records)
    findings: list[Finding | None] = []
    runnable = []
    for r in records:
        why = refusal_reason(r, state.engine_fingerprint, tuples)
        skip = None if why else skip_reason(r)
        findings.append(Finding(r.request_id, "refused", why) if why else
                        Finding(r.request_id, "skipped", skip) if skip else None)
        if why is None and skip is None:
            runnable.append(len(findings) - 1)
    if runnable:
        # on the pool: a record's id lists are as long as its body allows
        await state.preprocess.run(_check_admission, [(i, records[i]) for i in runnable], state.vocab_size)
        gen = Generation(state, f"verify-{uuid.uuid4().hex}", [records[i].prompt_token_ids for i in runnable],
                         [records[i].params for i in runnable], endpoint="/v1/verify", log_record=False)
        await gen.start()
        try:
            finals = await unless_disconnected(request, gen.run())
        except ClientGone:
            return Response(status_code=499)
        for i, out in zip(runnable, finals):
            errors = [c for c in out.outputs if c.finish_reason == "error"]
            findings[i] = (Finding(records[i].request_id, "error", f"the re-execution failed in the engine: "
                                   f"{out.error or 'unknown error'}") if errors else compare_output(records[i], out))
    return JSONResponse(verify_report(findings, state.engine_fingerprint))


def add_verify_route(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/verify")
    async def verify(request: Request) -> Response:
        return await verify_records(request, state)
