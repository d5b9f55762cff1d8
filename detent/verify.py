"""`detent verify`: re-execute a request someone got an answer for, on a
running `detent-serve`, and compare the answers' bits with `==`
(docs/verify.md; a whole request log: detent/verify_log.py).

Input: the request body as sent to /v1/completions, /v1/chat/completions or
/v1/responses, and the response body received (its `detent` field carries
the tuple hash, the deployment hash and the seed each choice sampled with).
The request is refused when this server's tuple or deployment hash is not
the response's: another tuple or deployment may give other bits, and that
is no finding. Ids the server draws at random (a tool call's `id`, a
Responses item's `id` and `call_id`) are not compared.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from detent.battery import first_difference


class VerifyRefused(ValueError):
    """The request cannot be re-executed here (another deployment or tuple, no seed)."""


@dataclass(frozen=True)
class Verdict:
    equal: bool
    differences: list[str]  # one line per differing choice or field; empty when equal


def server_fingerprint(url: str, headers: dict, timeout: float) -> dict[str, str | None]:
    import httpx
    r = httpx.get(url + "/v1/models", headers=headers, timeout=timeout)
    r.raise_for_status()
    return {"tuple_hash": r.headers.get("x-detent-tuple-hash"),
            "deployment_hash": r.headers.get("x-detent-deployment-hash")}


def check_fingerprint(recorded: dict, here: dict) -> None:
    for key, what in (("deployment_hash", "deployment (model, dtype, device, tp, page size, limits)"),
                      ("tuple_hash", "commitment tuple")):
        if recorded.get(key) is None:
            raise VerifyRefused(f"the response has no detent.{key}: it was not served by detent-serve")
        if recorded[key] != here[key]:
            raise VerifyRefused(f"{key} differs: the response came from another {what} "
                                f"({recorded[key]}), this server runs {here[key]}")


def replay_body(request: dict, response: dict) -> dict:
    """The request as it ran: not streamed, with the seed the response reports."""
    body = {**request, "stream": False}
    body.pop("stream_options", None)
    seeds = set(response.get("detent", {}).get("seeds") or [])
    if body.get("seed") is None:
        if len(seeds) != 1 or None in seeds:
            raise VerifyRefused(f"the request has no seed and the response reports seeds {sorted(seeds, key=str)}: "
                                "one seed is needed to re-execute it")
        body["seed"] = seeds.pop()
    return body


def _positions(choice: dict) -> tuple[str, list] | None:
    """Per generated token, what the choice reports for it (completions or chat logprobs)."""
    lp = choice.get("logprobs")
    if not lp:
        return None
    if "content" in lp:
        return "logprobs.content", lp["content"] or []
    return "logprobs", [{"token": t, "logprob": v, "top_logprobs": top} for t, v, top in
                        zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"])]


_RANDOM_IDS = ("id", "call_id")  # drawn per response (uuid4): not part of the output's bits


def _without_ids(value: Any) -> Any:
    """A choice's tool calls, or a Responses output item, without the ids drawn at random."""
    if isinstance(value, list):
        return [_without_ids(v) for v in value]
    if isinstance(value, dict):
        return {k: _without_ids(v) for k, v in value.items() if k not in _RANDOM_IDS}
    return value


def _choices(body: dict) -> list[dict]:
    """The choices to compare: a Responses body's output is its one choice (logprobs from its message)."""
    if "output" not in body:
        return [{**c, "message": _without_ids(c["message"])} if isinstance(c.get("message"), dict) else c
                for c in body.get("choices", [])]
    items = _without_ids(body["output"])
    parts = [p for item in items if item.get("type") == "message" for p in item.get("content", [])]
    lps = [e for p in parts for e in p.get("logprobs") or []]
    return [{"index": 0, "status": body.get("status"), "output": items,
             "logprobs": {"content": lps} if lps else None}]


def compare(recorded: dict, replayed: dict) -> Verdict:
    """`==` on every choice; for a differing one, the first differing token and logprob."""
    diffs = []
    a, b = _choices(recorded), _choices(replayed)
    if len(a) != len(b):
        diffs.append(f"{len(a)} choices recorded, {len(b)} now")
    for ca, cb in zip(a, b):
        if ca == cb:
            continue
        idx = ca.get("index")
        pa, pb = _positions(ca), _positions(cb)
        if pa and pb and pa[1] != pb[1]:
            i, x, y = first_difference(pa[1], pb[1])
            diffs.append(f"choice {idx}: first difference at token {i}: recorded {x}, now {y}")
            continue
        keys = sorted(k for k in set(ca) | set(cb) if ca.get(k) != cb.get(k))
        diffs.append(f"choice {idx}: {', '.join(keys)} differ: recorded "
                     f"{ {k: ca.get(k) for k in keys} }, now { {k: cb.get(k) for k in keys} }")
    return Verdict(not diffs, diffs)


def verify(url: str, request: dict, response: dict, api_key: str | None = None, timeout: float = 300) -> Verdict:
    import httpx
    url = url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    check_fingerprint(response.get("detent") or {}, server_fingerprint(url, headers, timeout))
    path = ("/v1/chat/completions" if "messages" in request else "/v1/responses" if "input" in request
            else "/v1/completions")
    r = httpx.post(url + path, json=replay_body(request, response), headers=headers, timeout=timeout)
    if r.status_code != 200:
        raise VerifyRefused(f"the server refused the request ({r.status_code}): {r.text[:500]}")
    replayed: dict[str, Any] = r.json()
    check_fingerprint(replayed.get("detent") or {}, response["detent"])
    return compare(response, replayed)
