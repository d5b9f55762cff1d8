"""The request log's records: what `detent-serve --request-log` writes and
`detent verify` / `POST /v1/verify` read (docs/verify.md, "The request log").

One JSON object per line. A `"type": "server"` record opens each server
start (the deployment facts and the commitment tuple in force); every engine
request that finished adds a `"type": "request"` record: prompt token ids,
every sampling parameter with the seed the request sampled with, the hashes
and facts of the deployment that ran it, and per sample the token ids and,
per generated position, the logprob entries the engine returned (the chosen
token first, then the top-k it did not already name) as `[token_id,
logprob, rank]`. A logprob that is not finite is the string "-inf", "inf"
or "nan" (JSON has no such numbers). Floats are written with Python's
shortest round-trip repr, so a record read back holds the very bits the
engine returned.

This module writes and reads records; engine/replay.py compares them.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from detent.sampling.params import SamplingParams, StructuredOutputs

FORMAT = "detent-request-log/1"
_NONFINITE = {"-inf": -math.inf, "inf": math.inf, "nan": math.nan}


class RecordError(ValueError):
    """A record that is not a well-formed request record; `field` names where."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


# ---------------------------------------------------------------- writing
def _lp(v: float) -> float | str:
    v = float(v)
    if math.isfinite(v):
        return v
    return "nan" if math.isnan(v) else ("inf" if v > 0 else "-inf")


def position_json(d: dict | None) -> list | None:
    """One position's `{token_id: Logprob}` dict as `[[id, logprob, rank], ...]` in the engine's order."""
    if d is None:
        return None
    return [[int(t), _lp(getattr(x, "logprob", x)), getattr(x, "rank", None)] for t, x in d.items()]


def params_json(p: SamplingParams, seed: int | None) -> dict[str, Any]:
    """Every field of `p`, with `seed` (the one the request sampled with) in place of p.seed."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(p):
        v = getattr(p, f.name)
        if isinstance(v, StructuredOutputs):
            v = dataclasses.asdict(v)
        elif f.name == "logit_bias" and v is not None:
            v = {str(k): b for k, b in v.items()}
        elif f.name == "bad_words_token_ids" and v is not None:
            v = [list(w) for w in v]  # lists, or a TokenWords where the params were pickled
        out[f.name] = v
    out["seed"] = seed
    return out


def output_json(c: Any) -> dict[str, Any]:
    """One sample (a CompletionOutput) as the record holds it."""
    return {"index": c.index, "seed": c.seed, "text": c.text, "token_ids": list(c.token_ids),
            "logprobs": None if c.logprobs is None else [position_json(d) for d in c.logprobs],
            "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}


def fingerprint_json(fp: Any) -> dict[str, Any]:
    return {"selection": fp.selection, "tuple_hash": fp.tuple_hash, "deployment_hash": fp.deployment_hash,
            "facts": fp.facts}


def server_record(fp: Any, model: str, now: float, version: str) -> dict[str, Any]:
    """The record that opens a server start: the tuple is named here once, not per request."""
    return {"type": "server", "format": FORMAT, "time": now, "version": version, "model": model,
            **fingerprint_json(fp), "tuple": fp.tuple}


def request_record(*, request_id: str, endpoint: str, model: str, fp: Any, prompt: str | None,
                   prompt_token_ids: list[int], params: SamplingParams, output: Any, arrival: float,
                   finished: float) -> dict[str, Any]:
    """One finished engine request (a RequestOutput with `finished` set)."""
    outs = sorted(output.outputs, key=lambda c: c.index)
    seed = outs[0].seed if outs else params.seed
    return {"type": "request", "format": FORMAT, "request_id": request_id, "endpoint": endpoint, "model": model,
            "time_arrival": arrival, "time_finished": finished, **fingerprint_json(fp),
            "prompt": prompt, "prompt_token_ids": list(prompt_token_ids),
            "params": params_json(params, seed), "seed_given": params.seed is not None,
            "prompt_logprobs": None if output.prompt_logprobs is None else
            [position_json(d) for d in output.prompt_logprobs],
            "outputs": [output_json(c) for c in outs], "error": output.error}


# ---------------------------------------------------------------- reading
@dataclass(frozen=True)
class Record:
    """A request record, checked: what a replay needs, and the raw object to compare with."""
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    selection: str
    tuple_hash: str
    deployment_hash: str
    facts: dict[str, Any] | None
    raw: dict[str, Any]

    @property
    def finish_reasons(self) -> list[str | None]:
        return [o.get("finish_reason") for o in self.raw["outputs"]]


def _need(obj: dict, key: str, kind: type | tuple, where: str, optional: bool = False) -> Any:
    if key not in obj:
        if optional:
            return None
        raise RecordError(f"{where}{key}", "missing")
    v = obj[key]
    if v is None and optional:
        return None
    if not isinstance(v, kind) or isinstance(v, bool) and kind is int:
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise RecordError(f"{where}{key}", f"must be {names}, got {type(v).__name__}")
    return v


def _positions(v: Any, where: str) -> None:
    """A list of positions, each null or a list of [int, number or inf-string, int or null]."""
    if not isinstance(v, list):
        raise RecordError(where, f"must be a list, got {type(v).__name__}")
    for i, pos in enumerate(v):
        if pos is None:
            continue
        if not isinstance(pos, list) or not pos:
            raise RecordError(f"{where}[{i}]", "must be a non-empty list of [token_id, logprob, rank]")
        for e in pos:
            ok = (isinstance(e, list) and len(e) == 3 and isinstance(e[0], int) and not isinstance(e[0], bool)
                  and (isinstance(e[1], (int, float)) and not isinstance(e[1], bool) or e[1] in _NONFINITE)
                  and (e[2] is None or isinstance(e[2], int) and not isinstance(e[2], bool)))
            if not ok:
                raise RecordError(f"{where}[{i}]", f"entries are [token_id, logprob, rank], got {e!r:.80}")


def parse_record(obj: Any) -> Record:
    """A request record, or RecordError naming the first field that is wrong."""
    if not isinstance(obj, dict):
        raise RecordError("record", f"must be a JSON object, got {type(obj).__name__}")
    if obj.get("format") != FORMAT:
        raise RecordError("format", f"must be {FORMAT!r}, got {obj.get('format')!r}")
    if obj.get("type") != "request":
        raise RecordError("type", f"must be 'request' for a record to re-execute, got {obj.get('type')!r}")
    rid = _need(obj, "request_id", str, "")
    ids = _need(obj, "prompt_token_ids", list, "")
    if not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise RecordError("prompt_token_ids", "must be a non-empty list of token ids (integers >= 0)")
    for key in ("selection", "tuple_hash", "deployment_hash"):
        _need(obj, key, str, "")
    facts = _need(obj, "facts", dict, "", optional=True)
    raw_params = _need(obj, "params", dict, "")
    names = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(raw_params) - names)
    if unknown:
        raise RecordError(f"params.{unknown[0]}", "is not a sampling parameter")
    try:
        params = SamplingParams(**raw_params)
    except (TypeError, ValueError) as e:
        raise RecordError("params", str(e)) from None
    if raw_params.get("seed") is None and not params.greedy:
        raise RecordError("params.seed", "a sampled request's record must carry the seed it sampled with")
    outs = _need(obj, "outputs", list, "")
    if len(outs) != params.n:
        raise RecordError("outputs", f"holds {len(outs)} samples, params.n is {params.n}")
    for i, o in enumerate(outs):
        where = f"outputs[{i}]."
        if not isinstance(o, dict):
            raise RecordError(f"outputs[{i}]", "must be an object")
        toks = _need(o, "token_ids", list, where)
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in toks):
            raise RecordError(f"{where}token_ids", "must be a list of integers")
        lps = _need(o, "logprobs", list, where, optional=True)
        if lps is not None:
            _positions(lps, f"{where}logprobs")
            if len(lps) != len(toks):
                raise RecordError(f"{where}logprobs", f"has {len(lps)} positions for {len(toks)} tokens")
        _need(o, "finish_reason", str, where, optional=True)
    plp = _need(obj, "prompt_logprobs", list, "", optional=True)
    if plp is not None:
        _positions(plp, "prompt_logprobs")
    return Record(rid, list(ids), params, obj["selection"], obj["tuple_hash"], obj["deployment_hash"], facts, obj)


def check_tuple(t: dict) -> None:
    """A server record's `tuple` as re-execution reads it to name the pins that differ
    (engine/replay.py): RecordError naming the first part that is not an object where a
    commitment tuple has one (families, their pins, knobs and sites, a site's pins and knobs)."""
    def obj(v: Any, where: str) -> dict:
        if not isinstance(v, dict):
            raise RecordError(where, f"must be an object, got {type(v).__name__}")
        return v

    for fam, ent in obj(t.get("families", {}), "tuple.families").items():
        ent = obj(ent, f"tuple.families.{fam}")
        for part in ("pins", "knobs"):
            obj(ent.get(part, {}), f"tuple.families.{fam}.{part}")
        for site, sv in obj(ent.get("sites", {}), f"tuple.families.{fam}.sites").items():
            sv = obj(sv, f"tuple.families.{fam}.sites.{site}")
            for part in ("pins", "knobs"):
                obj(sv.get(part, {}), f"tuple.families.{fam}.sites.{site}.{part}")
