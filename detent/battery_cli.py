"""`detent battery` (docs/battery.md) and `detent verify` (docs/verify.md)."""
from __future__ import annotations

import argparse
import json
import sys

from detent.engine.config import SELECTION_MODES


def add_subparsers(sub) -> None:
    p = sub.add_parser("battery", help="run the batch-invariance battery on a deployment",
                       description="Run a target request alone and under each cell's batch condition; "
                       "compare token ids and logprobs with ==. Exit 1 if any cell fails.")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--model", default=None, help="run in process on this model (default: embedded SmolLM2)")
    where.add_argument("--url", default=None, help="run against a running detent-serve at this URL")
    p.add_argument("--api-key", default=None, help="--url: the server's API key")
    p.add_argument("--vocab", type=int, default=1000, help="--url: prompt token ids are drawn below this")
    p.add_argument("--selection", default="pinned", choices=SELECTION_MODES)
    p.add_argument("--tuple", default=None, help="commitment tuple (t.json)")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--device", default="auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-num-batched-tokens", type=int, default=32,
                   help="in process: the step budget (small, so the target's prefill is chunked)")
    p.add_argument("--cells", default="all", help="all (26 + 9 strong), strong, quick (6), or cell names "
                   "separated by commas")
    p.add_argument("--json", default=None, help="write the results to this file")
    p.set_defaults(func=_battery)

    v = sub.add_parser("verify", help="re-execute logged requests and compare their bits",
                       description="LOG: re-execute every request of a detent-serve --request-log in process, "
                       "on an engine built as the log's deployment facts say, with --model and --tuple (with "
                       "--url: by that server's POST /v1/verify); or --url with --request/--response: send one "
                       "request again to a running server. Compare "
                       "token ids, logprobs and top-k logprobs with ==. Exit 0 if equal, 1 if any differs, "
                       "3 if a request cannot be re-executed here (another deployment or tuple) or was not (the "
                       "engine stopped, the --url server went away midway), 2 on a usage error (docs/verify.md).")
    v.add_argument("log", nargs="?", default=None, help="a request log written by detent-serve --request-log")
    v.add_argument("--model", default=None, help="LOG: the model to re-execute on (default: the embedded SmolLM2)")
    v.add_argument("--tokenizer", default=None, help="LOG: the tokenizer, when the deployment served one other than "
                   "the model's (detent-serve --tokenizer): stop strings and output text are decoded with it")
    v.add_argument("--tuple", default=None, help="LOG: commitment tuple (t.json; default: the default tuple)")
    v.add_argument("--selection", default=None, choices=SELECTION_MODES,
                   help="LOG: selection mode (default: the one the log's requests ran under)")
    v.add_argument("--load-format", default="auto")
    v.add_argument("--batch", type=int, default=None, help="LOG: requests re-executed together (default 32; "
                   "with --url, records per POST /v1/verify call, default 16)")
    v.add_argument("--json", default=None, help="LOG: write the report to this file")
    v.add_argument("--url", default=None, help="a running detent-serve: with LOG, its POST /v1/verify "
                   "re-executes the log; with --request and --response, one request")
    v.add_argument("--api-key", default=None)
    v.add_argument("--request", default=None, help="--url: the request body (JSON) sent to /v1/completions or "
                   "/v1/chat/completions")
    v.add_argument("--response", default=None, help="--url: the response body (JSON) received, with its detent "
                   "field")
    v.set_defaults(func=_verify)


def _battery(args: argparse.Namespace) -> int:
    from detent.battery import HTTPBackend, OfflineBackend, run_battery, table, write_json
    from detent.battery_cells import select

    import httpx

    cells = select(args.cells)  # a bad name fails before any model is loaded
    llm = None
    if args.url:
        try:
            backend = HTTPBackend(args.url, args.api_key, vocab=args.vocab)
        except httpx.HTTPError as e:
            print(f"detent battery: error: no detent-serve answers at {args.url}: {e}", file=sys.stderr)
            return 2
        meta = {"url": args.url}
    else:
        from detent.engine import LLM
        llm = LLM(model=args.model, tensor_parallel_size=args.tp, tuple=args.tuple, selection=args.selection,
                  dtype=args.dtype, device=args.device, max_model_len=1024, max_num_seqs=64,
                  max_num_batched_tokens=args.max_num_batched_tokens)
        backend = OfflineBackend(llm)
        meta = {"model": args.model, "selection": args.selection, "tp": args.tp,
                "max_num_batched_tokens": args.max_num_batched_tokens}
    meta.update(backend.fingerprint, cells_selected=args.cells)
    try:
        results = run_battery(backend, cells, progress=lambda r: print(
            f"  {r.cell}: {'pass' if r.passed else 'FAIL'}", file=sys.stderr, flush=True))
    finally:
        if llm is not None:
            llm.llm_engine.shutdown()
    print(table(results))
    if args.json:
        write_json(args.json, results, meta)
    return 0 if all(r.passed for r in results) else 1


def _verify(args: argparse.Namespace) -> int:
    if args.log is not None:
        if args.request or args.response:
            print("detent verify: error: give LOG, or --request and --response, not both", file=sys.stderr)
            return 2
        return _verify_log(args)
    if not (args.url and args.request and args.response):
        print("detent verify: error: give a request LOG, or --url with --request and --response", file=sys.stderr)
        return 2
    from detent.verify import VerifyRefused, verify

    with open(args.request) as f:
        request = json.load(f)
    with open(args.response) as f:
        response = json.load(f)
    import httpx

    try:
        verdict = verify(args.url, request, response, api_key=args.api_key)
    except VerifyRefused as e:
        print(f"detent verify: refused: {e}", file=sys.stderr)
        return 3
    except httpx.HTTPError as e:
        print(f"detent verify: error: no detent-serve answers at {args.url}: {e}", file=sys.stderr)
        return 2
    if verdict.equal:
        print(f"equal: {len(response.get('choices', []))} choice(s) re-executed bit for bit")
        return 0
    print("DIFFERENT:")
    for line in verdict.differences:
        print(f"  {line}")
    return 1


def _verify_log(args: argparse.Namespace) -> int:
    from detent.engine import Finding
    from detent.verify_log import (NOT_RUN, Interrupted, engine_args, exit_code, read_log, table, verify_log,
                                   verify_report)

    interrupted = False

    try:
        records, tuples, notes = read_log(args.log)
    except OSError as e:
        print(f"detent verify: error: cannot read {args.log}: {e.strerror}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"detent verify: {note}", file=sys.stderr)
    if all(isinstance(r, Finding) for r in records):  # nothing to re-execute: no engine is built
        if records:
            print(table(records))
        print(f"detent verify: error: {args.log} holds no request record", file=sys.stderr)
        return 2
    if args.url:
        given = [f for f, v in (("--model", args.model), ("--tokenizer", args.tokenizer), ("--tuple", args.tuple),
                                ("--selection", args.selection)) if v is not None]
        if given:
            print(f"detent verify: error: {', '.join(given)} choose the in-process engine; with --url the "
                  "server re-executes the log under its own", file=sys.stderr)
            return 2
        from detent.verify_log import verify_remote
        import httpx
        try:
            findings, rep = verify_remote(args.url, records, tuples, args.api_key, max(1, args.batch or 16))
        except Interrupted as e:
            findings, rep, interrupted = e.findings, e.report, True
        except httpx.HTTPError as e:
            print(f"detent verify: error: no detent-serve answers at {args.url}: {e}", file=sys.stderr)
            return 2
        except ValueError as e:
            print(f"detent verify: error: {e}", file=sys.stderr)
            return 2
    else:
        from detent.engine import LLM
        selection = args.selection or next((r.selection for r in records if hasattr(r, "selection")), "pinned")
        try:
            llm = LLM(model=args.model, tokenizer=args.tokenizer, tuple=args.tuple, selection=selection,
                      load_format=args.load_format, **engine_args(records))
        except (ValueError, OSError) as e:  # a tuple for other facts, a model that does not load
            print(f"detent verify: error: cannot build the engine to re-execute on: {type(e).__name__}: {e}",
                  file=sys.stderr)
            return 2
        try:
            try:
                findings = verify_log(llm, records, tuples, max(1, args.batch or 32))
            except Interrupted as e:  # Ctrl-C: what was verified is still said, and exits 130
                findings, interrupted = e.findings, True
            rep = verify_report(findings, llm.llm_engine.fingerprint())
        finally:
            llm.shutdown()
    print(table(findings))
    c = rep["counts"]
    print(f"{c['equal']} equal, {c['different']} different, {c['refused']} refused, {c['skipped']} skipped, "
          f"{c['error']} failed, of {len(findings)} records")
    unrun = [f.reason for f in findings if f.status == "error" and (f.reason or "").startswith(NOT_RUN)]
    if unrun:
        print(f"detent verify: {'' if interrupted else 'error: '}{len(unrun)} of {len(findings)} records "
              f"{unrun[0]}", file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=1)
    return 130 if interrupted else exit_code(rep)
