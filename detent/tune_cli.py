"""`detent tune` (docs/tune.md): pick the commitment tuple for a workload.

    detent tune --model DIR --workload W-A -o t.json            # writes t.json, t.report.json, t.png
    detent tune --model llama-3.1-8b --load-format dummy --device cuda --dtype bfloat16 --workload W-B -o b.json
    detent tune --model DIR --workload my_requests.jsonl -o t.json  # {"prompt_token_ids": [...], "max_tokens": n}

The engine arguments must be the ones `detent-serve` will run with: the
tuple is made for those deployment facts (budget, max context, ...).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable

TIME_BUDGET_S = 600.0  # `--time-budget`: a tune's target on one H200 is ten minutes a workload
WRITE_RESERVE_S = 10.0  # of the budget, kept for writing the tuple, the report and the plot


def add_subparsers(sub) -> None:
    p = sub.add_parser("tune", help="tune the commitment tuple for a workload",
                       description="Profile WORKLOAD under the default tuple, search each kernel family's legal "
                       "assignments (successive halving on the workload's own steps), check that the families' "
                       "gains add up, and write the tuple and a report.")
    p.add_argument("--model", default=None, help="model directory, preset or HF name (default: embedded SmolLM2)")
    p.add_argument("--tp", "--tensor-parallel-size", dest="tp", type=int, default=1)
    p.add_argument("--workload", required=True, help="W-A, W-B, W-C (benchmarks/workloads/README.md) or a JSONL "
                   "file of requests ({\"prompt_token_ids\": [...], \"max_tokens\": n, \"after\": i})")
    p.add_argument("-o", "--output", required=True, help="where to write the tuned tuple")
    p.add_argument("--report", default=None, help="the JSON report (default: OUTPUT with .report.json)")
    p.add_argument("--plot", default=None, help="the PNG of predicted vs measured (default: OUTPUT with .png)")
    p.add_argument("--num-requests", type=_positive, default=None, help="a smaller workload: this many requests")
    p.add_argument("--max-len", type=_at_least(8), default=None,
                   help="a smaller workload: each request's prompt + output at most this many tokens (at least 8)")
    p.add_argument("--max-throughput", type=float, default=None, metavar="REQ_PER_S", help="the maximum "
                   "throughput the workload's Poisson loads are fractions of (e.g. stock's, served; "
                   "benchmarks/serve_arms.py's lambda_max); default: measured, every request at once under the "
                   "default tuple")
    p.add_argument("--families", default=None, help="only these families, comma-separated (default: every family "
                   "with a choice that the workload calls)")
    p.add_argument("--max-candidates", type=_positive, default=32, help="per family, the grid's first rung (default 32)")
    p.add_argument("--eta", type=_at_least(2), default=3, help="successive halving keeps 1/eta per rung (default 3)")
    p.add_argument("--min-fraction", type=_share, default=0.25, help="share of the workload of the first rung")
    p.add_argument("--refine", type=_at_least(0), default=2, help="hill-climbing rounds around each family's winner")
    p.add_argument("--interactions", type=_at_least(0), default=3, help="extra mixes measured for the additivity check")
    p.add_argument("--objective", choices=("tpot", "time"), default="tpot", help="tpot: weigh each step by its "
                   "decode rows, the time a generated token waits for, so prefill-only steps count nothing (default); "
                   "time: every step alike, prefill included (docs/tune.md, \"Objective\")")
    p.add_argument("--cost", choices=("engine", "kernels"), default="engine", help="engine: time the workload's "
                   "steps on the engine (default); kernels: time the profiled kernel calls one by one (faster)")
    p.add_argument("--confirm", choices=("engine", "none"), default=None, help="engine: measure the search's "
                   "winner against the default on the engine (the workload's steps) and keep the default unless "
                   "the winner is faster there (default with --cost kernels); none: take the search's word")
    p.add_argument("--confirm-candidates", type=_positive, default=None, metavar="N",
                   help="the confirmation measures the search's winner and up to N-1 runners-up that the search "
                   "measured cheaper than the default, and takes the cheapest on the engine (default: the winner "
                   "and one runner-up)")
    p.add_argument("--no-dedupe", dest="dedupe", action="store_false", help="measure every candidate, also "
                   "those that select the same kernels and parameters on the profiled calls as one measured before")
    p.add_argument("--profile-every", type=int, default=None, help="the profile records every step with prompt "
                   "rows and one decode-only step in this many, counted as many; the others replay the CUDA graphs "
                   "(default 8; 1: every step, eagerly)")
    p.add_argument("--time-budget", type=float, default=TIME_BUDGET_S, help="seconds from start to the written "
                   f"tuple (default {TIME_BUDGET_S:g}): the confirmation runs on the share of the workload that "
                   "fits, and is skipped, the default kept, when too little does; 0: no budget")
    p.add_argument("--repeats", type=_positive, default=1, help="runs per measurement (the median counts)")
    p.add_argument("--seed", type=int, default=0)
    for name, kw in (("--device", {"default": "auto"}), ("--dtype", {"default": "auto"}),
                     ("--load-format", {"default": "auto"}), ("--max-model-len", {"type": int}),
                     ("--max-num-seqs", {"type": int}), ("--max-num-batched-tokens", {"type": int}),
                     ("--max-mixed-batched-tokens", {"type": int}), ("--block-size", {"type": int}),
                     ("--gpu-memory-utilization", {"type": float})):
        p.add_argument(name, **kw)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-enable-prefix-caching", dest="prefix_caching", action="store_false")
    p.set_defaults(func=_tune)


def load_workload(spec: str, *, vocab: int, num_requests: int | None, max_len: int | None, seed: int):
    from detent.workloads import NAMES, make
    if spec in NAMES:
        return make(spec, num_requests=num_requests, max_len=max_len, seed=seed,
                    vocab=min(vocab, 32000))
    return file_workload(spec, read_requests(spec), vocab, num_requests, seed)


def read_requests(spec: str) -> list[tuple[int, Any]]:
    """(line, Request) of a workload file, each checked but against the vocabulary: read before
    the model loads, so that a bad file fails in a second, not after the load."""
    from detent.workloads import NAMES, Request
    if not os.path.isfile(spec):
        raise ValueError(f"--workload {spec!r} is neither a workload name ({', '.join(NAMES)}) nor a file")
    rows: list[tuple[int, Any]] = []
    with open(spec, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
                r = Request(tuple(int(x) for x in d["prompt_token_ids"]), int(d["max_tokens"]), d.get("after"))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"--workload {spec} line {n}: expected {{\"prompt_token_ids\": [...], "
                                 f"\"max_tokens\": n}} ({e})") from None
            if not r.prompt_token_ids or r.max_tokens < 1:
                raise ValueError(f"--workload {spec} line {n}: a request needs at least one prompt token and "
                                 f"max_tokens of at least 1")
            if r.after is not None and not (isinstance(r.after, int) and 0 <= r.after < len(rows)):
                raise ValueError(f"--workload {spec} line {n}: 'after' must name an earlier request")
            rows.append((n, r))
    if not rows:
        raise ValueError(f"--workload {spec}: no requests")
    return rows


def file_workload(spec: str, rows: list[tuple[int, Any]], vocab: int, num_requests: int | None, seed: int):
    """The workload of `read_requests`' rows, every prompt id inside the model's vocabulary."""
    from detent.workloads import Load, Workload
    for n, r in rows:
        if not 0 <= min(r.prompt_token_ids) <= max(r.prompt_token_ids) < vocab:
            bad = next(t for t in r.prompt_token_ids if not 0 <= t < vocab)
            raise ValueError(f"--workload {spec} line {n}: token id {bad} is outside the model's vocabulary "
                             f"[0, {vocab})")
    reqs = tuple(r for _, r in rows)
    w = Workload(os.path.basename(spec), reqs, (Load("all", concurrency=len(reqs)),), seed)
    return w.head(min(1.0, num_requests / len(reqs))) if num_requests else w


def _at_least(lo: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        n = int(text)
        if n < lo:
            raise argparse.ArgumentTypeError(f"must be at least {lo}, got {n}")
        return n
    return parse


_positive = _at_least(1)


def _share(text: str) -> float:
    f = float(text)
    if not 0 < f <= 1:
        raise argparse.ArgumentTypeError(f"a share of the workload, in (0, 1], got {text}")
    return f


def _engine_kwargs(a: argparse.Namespace) -> dict:
    kw = {"tensor_parallel_size": a.tp, "dtype": a.dtype, "device": a.device, "load_format": a.load_format,
          "max_model_len": a.max_model_len, "enable_prefix_caching": a.prefix_caching, "seed": a.seed}
    for name in ("max_num_seqs", "max_num_batched_tokens", "max_mixed_batched_tokens", "block_size",
                 "gpu_memory_utilization"):
        if getattr(a, name) is not None:
            kw[name] = getattr(a, name)
    if a.enforce_eager:
        kw["enforce_eager"] = True
    return kw


def _tune(a: argparse.Namespace) -> int:
    from detent.engine import LLM
    from detent.selection import programs
    from detent.tune import CONFIRM_CANDIDATES, PROFILE_EVERY, tune
    from detent.tune_cost import profile_summary
    from detent.tune_report import report_dict, write_plot, write_report
    from detent.workloads import NAMES

    t_start = time.perf_counter()

    def say(s: str) -> None:
        print(f"[tune {time.perf_counter() - t_start:7.1f}s] {s}", file=sys.stderr, flush=True)

    families = a.families.split(",") if a.families else None
    unknown = [f for f in families or () if f not in programs.FAMILIES]
    if unknown:
        raise ValueError(f"--families: unknown {unknown} (families: {', '.join(programs.FAMILIES)})")
    if a.profile_every is not None and a.profile_every < 1:
        raise ValueError(f"--profile-every {a.profile_every}: one decode step in N is recorded, N must be at least 1")
    if a.max_throughput is not None and not a.max_throughput > 0:
        raise ValueError(f"--max-throughput {a.max_throughput:g}: requests per second, above 0")
    if a.time_budget < 0:
        raise ValueError(f"--time-budget {a.time_budget:g}: seconds, at least 0 (0: no budget)")
    rows = None if a.workload in NAMES else read_requests(a.workload)
    for path in (a.output, a.report, a.plot):  # fail before the work, not after it
        if path and os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
    say(f"loading {a.model or 'the embedded model'}")
    llm = LLM(model=a.model, selection="pinned", **_engine_kwargs(a))
    try:
        vocab = llm.llm_engine.limits().vocab_size
        w = (load_workload(a.workload, vocab=vocab, num_requests=a.num_requests, max_len=a.max_len, seed=a.seed)
             if rows is None else file_workload(a.workload, rows, vocab, a.num_requests, a.seed))
        confirm = a.confirm or ("engine" if a.cost == "kernels" else "none")
        every = PROFILE_EVERY if a.profile_every is None else a.profile_every
        loaded = time.perf_counter() - t_start
        deadline = t_start + a.time_budget - WRITE_RESERVE_S if a.time_budget else None
        out = tune(llm, w, cost=a.cost, families=families, repeats=a.repeats, dedupe=a.dedupe, progress=say,
                   confirm=None if confirm == "none" else confirm, profile_every=every, deadline=deadline,
                   confirm_candidates=a.confirm_candidates or CONFIRM_CANDIDATES, max_throughput=a.max_throughput,
                   objective=a.objective, max_candidates=a.max_candidates, eta=a.eta, min_fraction=a.min_fraction,
                   refine=a.refine, interactions=a.interactions, seed=a.seed)
        res, prof = out.result, out.profile
        res.chosen.save(a.output)
        meta = {"workload": w.name, "num_requests": len(w.requests), "model": a.model, "tp": a.tp,
                "deployment_hash": res.chosen.to_dict()["deployment"]["hash"], "cost_model": a.cost,
                "confirm": confirm, "profile_every": every, "time_budget": a.time_budget or None,
                "phases": {"load": loaded, **out.phases}, "seconds": time.perf_counter() - t_start,
                "loops": out.loops, "throughput": out.throughput}
        report = report_dict(res, meta=meta, profile=profile_summary(prof), unit=out.unit, objective=out.objective,
                             kernel_buckets=out.kernel_buckets)
        stem = a.output[:-5] if a.output.endswith(".json") else a.output
        write_report(a.report or stem + ".report.json", report)
        plotted = write_plot(a.plot or stem + ".png", report)
    finally:
        llm.shutdown()
    say(f"wrote {a.output} (tuple hash {res.chosen.hash[:16]}), {a.report or stem + '.report.json'}"
        + (f", {a.plot or stem + '.png'}" if plotted else ""))
    print(f"default {res.base_cost:.4g}, tuned {report['measured_cost']:.4g} {out.unit} "
          f"(predicted {report['predicted_cost']:.4g}; additivity delta {100 * res.delta:.2f}%)"
          + ("; kept the default tuple (no measured repin or combination was cheaper)" if res.pick == "default"
             else "" if res.pick == "combined best" else f"; the search took {res.pick}, the cheapest measured"))
    if res.cut:
        print(f"the search's share of --time-budget ran out ({res.cut}): "
              + ("the tuple is the default or one family's repin measured on the whole workload, no additivity "
                 "check" if not res.checks else "the combined tuple was measured, not every other mix"))
    if res.confirmed:
        c = res.confirmed
        if "skipped" in c:
            print(f"not confirmed on the engine ({c['skipped']}): kept the default tuple; a larger --time-budget "
                  "or a smaller --num-requests leaves time for it")
        else:
            runner = f" (the search's runner-up {c['taken']}; its winner measured {c['candidates'][0]['cost']:.4g})" \
                if c.get("taken") else ""
            print(f"confirmed on the engine, {c['fraction']:.0%} of the workload: default {c['default']:.4g}, "
                  f"tuned {c['tuned']:.4g} {c['unit']}{runner}"
                  + (f"; kept the default (none under the default's cheaper run by more than its drift, "
                     f"{c['margin']:.4g})" if c["kept_default"] else ""))
    return 0
