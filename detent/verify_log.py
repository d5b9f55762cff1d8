"""`detent verify LOG`: re-execute a `detent-serve --request-log` in process
and compare every request's bits with `==` (docs/verify.md).

The engine is built as the log's deployment facts describe it (the context
length, step budget, sequence limit, page size, dtype, device and TP degree
the server ran with), with `--model`, `--tuple` and the log's selection mode
(or `--selection`). Facts it cannot reproduce — another model shape, device,
GPU or engine version — leave the deployment hash different, and each
record is then refused naming those facts. The records it can re-execute
are added to the engine in batches and run as one workload, with the seeds,
sampling parameters and prompt token ids the log holds.
"""
from __future__ import annotations

import json
import logging
from typing import Any

from detent.engine import (Finding, RecordError, check_tuple, compare_output, describe_difference, parse_record,
                           refusal_reason, skip_reason, verify_report)

log = logging.getLogger("detent.verify")


def read_log(path: str) -> tuple[list[Any], dict[str, dict], list[str]]:
    """(records, tuple hash -> tuple, problems): each request line as a Record or a
    Finding(status error) naming the line; a last line cut short (a crash mid-write) is
    left out with a note."""
    with open(path, "rb") as f:
        lines = f.read().split(b"\n")
    records: list[Any] = []
    tuples: dict[str, dict] = {}
    notes: list[str] = []
    for no, raw in enumerate(lines, start=1):
        if not raw.strip():
            continue
        why = None
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:  # a log is UTF-8 JSON lines; one bad line fails alone
            line, why = None, f"line {no} is not UTF-8 text (byte {e.start + 1})"
        if line is not None:
            try:
                obj = json.loads(line)
            except ValueError as e:
                why = f"line {no} is not JSON: {e}"
        if why is not None:
            if no == len(lines):  # no newline after it: the writer was cut off (mid-character, too)
                notes.append(f"line {no}: an unfinished last line (the server stopped while writing it), left out")
            else:
                records.append(Finding(f"line {no}", "error", why))
            continue
        if isinstance(obj, dict) and obj.get("type") == "server":
            if isinstance(obj.get("tuple"), dict):
                try:  # refusals walk it to name the pins that differ
                    check_tuple(obj["tuple"])
                    tuples[obj.get("tuple_hash")] = obj["tuple"]
                except RecordError as e:
                    notes.append(f"line {no}: a server record whose tuple is malformed ({e}), left out")
            continue
        try:
            records.append(parse_record(obj))
        except RecordError as e:
            records.append(Finding(f"line {no}", "error", f"line {no} is not a request record: {e}"))
    return records, tuples, notes


def engine_args(records: list[Any]) -> dict[str, Any]:
    """The LLM arguments that reproduce the first record's deployment facts."""
    facts = next((r.facts for r in records if getattr(r, "facts", None)), None)
    if facts is None:
        return {}
    return {"max_model_len": facts["max_context"], "max_num_batched_tokens": facts["max_num_batched_tokens"],
            "max_num_seqs": facts["max_num_seqs"], "block_size": facts["page_size"], "dtype": facts["dtype"],
            "device": facts["device"], "tensor_parallel_size": facts["tp"]}


def replay(engine: Any, records: list[Any], batch: int = 32, done: dict[int, Any] | None = None) -> dict[int, Any]:
    """Index -> finished RequestOutput (or the ValueError the engine refused it with),
    `batch` records at a time through the public LLMEngine loop, into `done` when given (so a
    caller whose replay raised still has what finished). A loop that raises or is interrupted
    withdraws its unfinished requests before re-raising, as `LLM.generate` does."""
    done = {} if done is None else done
    for start in range(0, len(records), batch):
        ids: dict[str, int] = {}
        rid = None
        try:
            for i in range(start, min(start + batch, len(records))):
                r = records[i]
                rid = f"verify-{i}"
                try:
                    engine.add_request(rid, r.prompt_token_ids, r.params, prompt=r.raw.get("prompt"))
                except ValueError as e:
                    done[i] = e
                    continue
                ids[rid] = i
            rid = None
            while ids:
                outs = engine.step()
                engine.pause_if_idle(outs)  # only requests waiting on a grammar compile: do not spin
                for out in outs:
                    if out.finished and out.request_id in ids:
                        done[ids.pop(out.request_id)] = out
        except BaseException:  # an engine error or Ctrl-C: none of them runs on in the engine unseen
            engine.withdraw_requests([*ids, *([rid] if rid else [])])
            raise
    return done


NOT_RUN = "not re-executed: "  # a Finding's reason for a record the stopped replay never finished


class Interrupted(KeyboardInterrupt):
    """Ctrl-C during `verify_log` or `verify_remote`: `findings` is its report so far (each
    record it did not finish an error whose reason starts with NOT_RUN); `report`, verify_remote's
    report of them."""

    def __init__(self, findings: list[Finding], report: dict[str, Any] | None = None):
        super().__init__("interrupted")
        self.findings, self.report = findings, report


def verify_log(llm: Any, records: list[Any], tuples: dict[str, dict], batch: int = 32) -> list[Finding]:
    """One Finding per record. If the engine stops midway (an exception out of its step), the
    records re-executed so far keep their results and the others are errors saying why;
    Ctrl-C raises Interrupted with the same findings. The engine keeps none of the requests."""
    fp = llm.llm_engine.fingerprint()
    findings: list[Any] = list(records)  # a Finding already for lines that did not parse
    todo = []
    for i, r in enumerate(records):
        if isinstance(r, Finding):
            continue
        why = refusal_reason(r, fp, tuples)
        skip = None if why else skip_reason(r)
        if why or skip:
            findings[i] = Finding(r.request_id, "refused" if why else "skipped", why or skip)
        else:
            todo.append(i)
    outs: dict[int, Any] = {}
    stopped = interrupted = None
    try:
        replay(llm.llm_engine, [records[i] for i in todo], batch, outs)
    except KeyboardInterrupt as e:
        stopped, interrupted = "interrupted (Ctrl-C)", e
    except Exception as e:  # noqa: BLE001 - the engine stopped: what ran is still reported
        log.error("the engine stopped while re-executing the log", exc_info=True)
        stopped = f"the engine stopped: {type(e).__name__}: {e}"
    for k, i in enumerate(todo):
        out = outs.get(k)
        if out is None:
            findings[i] = Finding(records[i].request_id, "error", NOT_RUN + stopped)
        elif isinstance(out, ValueError):
            findings[i] = Finding(records[i].request_id, "error", f"the engine refused it: {out}")
        elif any(c.finish_reason == "error" for c in out.outputs):
            findings[i] = Finding(records[i].request_id, "error", f"the re-execution failed: {out.error}")
        else:
            findings[i] = compare_output(records[i], out)
    if interrupted is not None:
        raise Interrupted(findings) from interrupted
    return findings


def verify_remote(url: str, records: list[Any], tuples: dict[str, dict], api_key: str | None = None,
                  batch: int = 16, timeout: float = 600) -> tuple[list[Finding], dict[str, Any]]:
    """The same report from a running server's POST /v1/verify, `batch` records per call
    (each call carries the log's tuples, so refusals name pins); lines that did not parse
    stay errors here. If the connection fails, or the server refuses a call (a 503 when it is
    overloaded), after it answered one, the batches answered keep their results and the other
    records are errors saying why (a failure at the first call raises: nothing was verified);
    Ctrl-C raises Interrupted with the batches answered so far (the server aborts the call it
    was answering when the connection closes)."""
    import httpx
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    servers = [{"type": "server", "tuple_hash": h, "tuple": t} for h, t in tuples.items()]
    parsed = [r for r in records if not isinstance(r, Finding)]
    entries: list[dict] = [f.to_json() for f in records if isinstance(f, Finding)]
    rep: dict[str, Any] = {}
    done = 0
    stopped = interrupted = None
    try:
        for start in range(0, len(parsed), batch):
            body = servers + [r.raw for r in parsed[start:start + batch]]
            r = httpx.post(url.rstrip("/") + "/v1/verify", json=body, headers=headers, timeout=timeout)
            if r.status_code != 200:
                stopped = (f"the server refused records {start}..{start + batch - 1} ({r.status_code}): "
                           f"{r.text[:500]}")
                if not done:
                    raise ValueError(stopped)
                break
            rep = r.json()
            entries += rep["records"]
            done = start + batch
    except KeyboardInterrupt as e:
        stopped, interrupted = "interrupted (Ctrl-C)", e
    except httpx.HTTPError as e:
        if not done:
            raise
        stopped = f"the connection to the server failed: {type(e).__name__}: {e}"
    if stopped is not None:
        entries += [{"request_id": r.request_id, "status": "error", "reason": NOT_RUN + stopped}
                    for r in parsed[done:]]
    findings = [Finding(e["request_id"], e["status"], e.get("reason"), e.get("differences", [])) for e in entries]
    report = verify_report(findings, _Fp(rep.get("tuple_hash"), rep.get("deployment_hash"), rep.get("selection")))
    if interrupted is not None:
        raise Interrupted(findings, report) from interrupted
    return findings, report


class _Fp:
    """The fingerprint a server's report names (for verify_report)."""

    def __init__(self, tuple_hash, deployment_hash, selection):
        self.tuple_hash, self.deployment_hash, self.selection = tuple_hash, deployment_hash, selection


def table(findings: list[Finding]) -> str:
    rows = [("request", "result", "detail")]
    for f in findings:
        detail = f.reason or ("; ".join(describe_difference(d) for d in f.differences) if f.differences else "")
        rows.append((f.request_id, f.status, detail))
    w0, w1 = (max(len(r[i]) for r in rows) for i in (0, 1))
    return "\n".join(f"{a:<{w0}}  {b:<{w1}}  {c}".rstrip() for a, b, c in rows)


def exit_code(rep: dict[str, Any]) -> int:
    """0: every record equal (or skipped); 1: a difference; 3: refused or failed records, no difference."""
    c = rep["counts"]
    return 1 if c["different"] else 3 if c["refused"] or c["error"] else 0


__all__ = ["NOT_RUN", "Interrupted", "engine_args", "exit_code", "read_log", "replay", "table", "verify_log",
           "verify_remote", "verify_report"]
