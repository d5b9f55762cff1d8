"""Re-executing a logged request: may it run here, and did it give the same bits?

`refusal_reason(record, fp, tuples)` says why a record cannot be re-executed on the
deployment `fp` (another selection mode, deployment or tuple), naming each
deployment fact or tuple pin that differs when the record (and the log's
server record, for the tuple) lets it. `compare_output(record, output)` checks the
re-executed output against the record with `==` — token ids, every logprob
entry `[token_id, logprob, rank]` (chosen token and top-k), prompt logprobs,
finish and stop reasons, text — and reports the first differing token of each
differing sample. Floats are compared by their shortest repr, which is exact
(and tells -0.0 from 0.0). The offline CLI (detent/verify.py) and `POST
/v1/verify` (server/verify.py) both use this; docs/verify.md.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from detent.engine.log_record import Record, output_json, position_json

SKIPPED_REASONS = ("abort", "error")  # cut short or failed: there are no full bits to reproduce


@dataclass
class Finding:
    """One record's result: status is equal, different, refused, skipped or error."""
    request_id: str
    status: str
    reason: str | None = None  # refused / skipped / error: why
    differences: list[dict[str, Any]] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        d: dict[str, Any] = {"request_id": self.request_id, "status": self.status}
        if self.reason is not None:
            d["reason"] = self.reason
        if self.differences:
            d["differences"] = self.differences
        return d


def _fact_diffs(a: dict, b: dict) -> list[str]:
    return [f"deployment fact {k!r} differs: the request ran with {a.get(k, '<absent>')!r}, this deployment "
            f"has {b.get(k, '<absent>')!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _tuple_diffs(a: dict, b: dict) -> list[str]:
    """The pins and knobs (family.part.name, per site too) on which two tuples' JSON forms differ."""
    def flat(t: dict) -> dict[str, Any]:
        out = {}
        for fam, ent in (t.get("families") or {}).items():
            for part in ("pins", "knobs"):
                for k, v in (ent.get(part) or {}).items():
                    out[f"{fam}.{part}.{k}"] = v
            for site, sv in (ent.get("sites") or {}).items():
                for part in ("pins", "knobs"):
                    for k, v in (sv.get(part) or {}).items():
                        out[f"{fam}.sites[{site}].{part}.{k}"] = v
        return out
    fa, fb = json.loads(json.dumps(flat(a))), json.loads(json.dumps(flat(b)))  # tuples and lists alike
    return [f"tuple {k} differs: {fa.get(k, '<absent>')!r} in the request's tuple, {fb.get(k, '<absent>')!r} here"
            for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)]


def refusal_reason(record: Record, fp: Any, tuples: dict[str, dict] | None = None) -> str | None:
    """Why `record` cannot be re-executed on the deployment with fingerprint `fp`, or None.
    `tuples` maps tuple hash -> tuple JSON (the log's server records)."""
    if record.selection != fp.selection:
        return (f"selection differs: the request ran under {record.selection!r}, this deployment runs "
                f"{fp.selection!r}")
    if record.deployment_hash != fp.deployment_hash:
        from detent.selection import deployment_hash
        why = f"deployment_hash differs ({record.deployment_hash[:16]} recorded, {fp.deployment_hash[:16]} here)"
        if record.facts is None:
            return why + "; the record holds no facts to say which"
        if deployment_hash(record.facts) != record.deployment_hash:
            return why + "; the record's facts do not hash to its deployment_hash (edited?)"
        return why + ": " + "; ".join(_fact_diffs(record.facts, fp.facts))
    if record.tuple_hash != fp.tuple_hash:
        why = (f"tuple_hash differs: the request ran under commitment tuple {record.tuple_hash[:16]}, this "
               f"deployment runs {fp.tuple_hash[:16]}")
        theirs = (tuples or {}).get(record.tuple_hash)
        if theirs is not None and fp.tuple is not None:
            diffs = _tuple_diffs(theirs, fp.tuple)
            if diffs:
                return why + ": " + "; ".join(diffs)
        if theirs is None:
            return why + " (no server record of the log holds that tuple, so its pins cannot be named)"
        return why
    return None


def skip_reason(record: Record) -> str | None:
    reasons = [r for r in record.finish_reasons if r in SKIPPED_REASONS]
    if reasons:
        return f"finish_reason {reasons[0]!r}: the request did not run to its end, so there is nothing to re-execute"
    return None


def _same(a: Any, b: Any) -> bool:
    return json.dumps(a) == json.dumps(b)


def _first(a: list, b: list) -> int | None:
    for i in range(max(len(a), len(b))):
        if i >= len(a) or i >= len(b) or not _same(a[i], b[i]):
            return i
    return None


def _at(seq: list | None, i: int) -> Any:
    return seq[i] if seq is not None and i < len(seq) else None


def compare_output(record: Record, output: Any) -> Finding:
    """`==` on everything the record holds of `output` (a finished RequestOutput)."""
    diffs: list[dict[str, Any]] = []
    rec_plp = record.raw.get("prompt_logprobs")
    new_plp = None if output.prompt_logprobs is None else [position_json(d) for d in output.prompt_logprobs]
    if not _same(rec_plp, new_plp):
        i = _first(rec_plp or [], new_plp or [])
        diffs.append({"field": "prompt_logprobs", "position": i, "recorded": _at(rec_plp, i),
                      "replayed": _at(new_plp, i)})
    new = [output_json(c) for c in sorted(output.outputs, key=lambda c: c.index)]
    for j, (r, n) in enumerate(zip(record.raw["outputs"], new)):
        if _same(r.get("token_ids"), n["token_ids"]) and _same(r.get("logprobs"), n["logprobs"]):
            others = [k for k in ("finish_reason", "stop_reason", "text") if not _same(r.get(k), n[k])]
            if others:
                diffs.append({"sample": j, "fields": others, "recorded": {k: r.get(k) for k in others},
                              "replayed": {k: n[k] for k in others}})
            continue
        ti = _first(r.get("token_ids") or [], n["token_ids"])
        li = _first(r.get("logprobs") or [], n["logprobs"] or []) if (r.get("logprobs") or n["logprobs"]) else None
        i = min(x for x in (ti, li) if x is not None)
        diffs.append({"sample": j, "token_index": i,
                      "recorded": {"token_id": _at(r.get("token_ids"), i), "logprobs": _at(r.get("logprobs"), i)},
                      "replayed": {"token_id": _at(n["token_ids"], i), "logprobs": _at(n["logprobs"], i)}})
    return Finding(record.request_id, "different" if diffs else "equal", differences=diffs)


def describe_difference(d: dict[str, Any]) -> str:
    """One line for a difference (the table's last column)."""
    if "token_index" in d:
        r, n = d["recorded"], d["replayed"]
        return (f"sample {d['sample']}, token {d['token_index']}: recorded {r['token_id']} {r['logprobs']}, "
                f"re-executed {n['token_id']} {n['logprobs']}")
    if d.get("field") == "prompt_logprobs":
        return f"prompt_logprobs, position {d['position']}: recorded {d['recorded']}, re-executed {d['replayed']}"
    return f"sample {d['sample']}: {', '.join(d['fields'])} differ: recorded {d['recorded']}, now {d['replayed']}"


def verify_report(findings: list[Finding], fp: Any) -> dict[str, Any]:
    """The JSON report: counts by status, the deployment that re-executed, one entry per record."""
    counts = {s: sum(f.status == s for f in findings) for s in ("equal", "different", "refused", "skipped", "error")}
    return {"equal": counts["different"] == 0 and counts["refused"] == 0 and counts["error"] == 0,
            "counts": counts, "tuple_hash": fp.tuple_hash, "deployment_hash": fp.deployment_hash,
            "selection": fp.selection, "records": [f.to_json() for f in findings]}
