"""`detent battery` and `detent verify` (docs/battery.md)."""
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

    v = sub.add_parser("verify", help="re-execute a logged request on a running server and compare bits",
                       description="Send REQUEST again (with the seed RESPONSE reports) to the server at URL, "
                       "after checking its tuple and deployment hashes are RESPONSE's; compare the choices "
                       "with ==. Exit 0 if equal, 1 if they differ, 3 if the request cannot be re-executed here.")
    v.add_argument("--url", required=True, help="the running detent-serve")
    v.add_argument("--api-key", default=None)
    v.add_argument("--request", required=True, help="the request body (JSON) sent to /v1/completions or "
                   "/v1/chat/completions")
    v.add_argument("--response", required=True, help="the response body (JSON) received, with its detent field")
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
