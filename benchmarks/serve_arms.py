"""The arms over the workloads (docs/performance.md, "Arms and workloads"):
`detent-serve` under stock, conservative, pinned with the default tuple and
pinned with the tuple `detent tune` picked for each workload (and `vllm
serve` at --vllm-url, same client), over the loads of W-A, W-B and W-C
(benchmarks/workloads/README.md). Every tuned tuple is served on every
workload's loads too: the tuple-drift matrix.

    python3 benchmarks/serve_arms.py run --model DIR --out OUT [--vllm-url URL]
    python3 benchmarks/serve_arms.py run --model DIR --out OUT --tune-only       # the tuples alone
    python3 benchmarks/serve_arms.py run --model DIR --out OUT --arms stock      # one arm per call: results merge
    python3 benchmarks/serve_arms.py run --model DIR --out OUT --arms tuned-W-B --loads W-A  # one tuple, one workload
    python3 benchmarks/serve_arms.py run --model DIR --out OUT --arms '' --vllm-url URL   # only vLLM
    python3 benchmarks/serve_arms.py run --model DIR --out OUT --arms pinned-default --tag @2  # a second run
    python3 benchmarks/serve_arms.py report OUT     # arms.md, fig7.png, fig8.png (benchmarks/arms_report.py)

Order: tune each workload (`detent tune`, skipped when OUT/tuple-W.json
exists), start stock and measure its maximum request throughput per
workload (lambda_max: every request at once), then every arm serves every
load — Poisson at the load's fraction of stock's lambda_max (the same rates
for every arm, vLLM's too), or the closed loop. Each load sends its own
prompts, the same for every arm (`workload_client.for_load`): none hits what
the lambda_max run or an earlier load left in the prefix cache. Results:
OUT/arms.json (with each request's TTFT and TPOT, `per_request`).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from serve_load import _get, stop_server  # noqa: E402
from workload_client import for_load, max_throughput, run_load, served_model, warm_up  # noqa: E402

ARMS = ("stock", "conservative", "pinned-default", "pinned-tuned")


def engine_args(a) -> list[str]:
    """The deployment: `detent tune` and every `detent-serve` get the same (the tuple's facts)."""
    out = ["--device", a.device, "--dtype", a.dtype]
    for flag, v in (("--max-model-len", a.max_model_len), ("--max-num-batched-tokens", a.max_num_batched_tokens),
                    ("--max-num-seqs", a.max_num_seqs), ("--tp", a.tp), ("--load-format", a.load_format)):
        if v is not None:
            out += [flag, str(v)]
    return out


def workload_args(a) -> list[str]:
    out = []
    if a.num_requests:
        out += ["--num-requests", str(a.num_requests)]
    if a.max_len:
        out += ["--max-len", str(a.max_len)]
    return out


def tune_all(a, names: list[str], lambda_max: dict[str, float]) -> dict[str, str]:
    """Each workload's tuple; its Poisson loads at fractions of stock's lambda_max where known."""
    paths = {}
    for w in names:
        path = os.path.join(a.out, f"tuple-{w}.json")
        if not os.path.exists(path):
            rate = ["--max-throughput", str(lambda_max[w])] if w in lambda_max else []
            cmd = [sys.executable, "-m", "detent.cli", "tune", "--model", a.model, "--workload", w, *workload_args(a),
                   *engine_args(a), "--cost", "kernels", *rate, *shlex.split(a.tune_args), "-o", path]
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
        paths[w] = path
    return paths


def start(a, arm: str, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "detent.server.cli", "--model", a.model, "--port", str(a.port),
           "--served-model-name", "m", "--log-level", "warning", *engine_args(a), *extra, *shlex.split(a.server_args)]
    log = open(os.path.join(a.out, f"server-{arm}.log"), "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    t0 = time.time()
    while _get(f"http://127.0.0.1:{a.port}/health") != 200:
        if proc.poll() is not None or time.time() - t0 > a.startup_timeout:
            stop_server(proc)
            raise SystemExit(f"detent-serve ({arm}) did not start; see server-{arm}.log")
        time.sleep(0.5)
    return proc


def serve_loads(url: str, model: str, workloads: dict, lambda_max: dict, a, label: str, out: dict, saved,
                api_key: str | None = None) -> None:
    """Every selected load of `workloads` into `out` (load name -> result), `saved()` after each,
    so a call cut short keeps the loads it finished. A load sends its own prompts (`for_load`)."""
    wargs = {"num_requests": a.num_requests, "max_len": a.max_len, "vocab": a.vocab}
    for name, w in workloads.items():
        for load in w.loads:
            if a.loads and load.name not in a.loads and name not in a.loads:
                continue
            r = run_load(url, model, for_load(name, load, a.seed, **wargs), load, lambda_max.get(name), a.seed,
                         prompt_format=a.prompt_format, api_key=api_key)
            r["workload"] = name
            out[load.name] = r
            saved()
            print(f"{label} {load.name}: TPOT p50 {r['tpot_p50_ms']:.2f} ms, TTFT p50 {r['ttft_p50_ms']:.1f} ms, "
                  f"{r['errors']} errors", flush=True)


def servers(arms: list[str], tuples: dict[str, str]) -> list[tuple[str, list[str]]]:
    """(arm, detent-serve arguments) per server to start; pinned-tuned is one server per tuned tuple."""
    fixed = {"stock": ["--selection", "stock"], "conservative": ["--selection", "conservative"],
             "pinned-default": []}
    out = []
    for arm in arms:
        if arm in fixed:
            out.append((arm, fixed[arm]))
        else:
            out += [(f"tuned-{w}", ["--tuple", p]) for w, p in tuples.items() if arm in ("pinned-tuned", f"tuned-{w}")]
    return out


def load_results(a, names: list[str], wargs: dict) -> tuple[str, dict]:
    path = os.path.join(a.out, "arms.json")
    res = {"arms": {}, "lambda_max": {}, "tuples": {}}
    if os.path.exists(path):
        with open(path) as f:
            res = json.load(f)
    if res.get("workload_args", wargs) != wargs or res.get("workloads", names) != names:
        raise SystemExit(f"{path} holds other workloads ({res.get('workloads')}, {res.get('workload_args')}): "
                         "use another --out")
    if res["arms"] and res.get("load_prompts") != "per-load":
        raise SystemExit(f"{path} holds loads that re-sent the workload's own prompts (before each load had its "
                         "own): use another --out")
    res.update(workloads=names, workload_args=wargs, load_prompts="per-load")
    return path, res


def read_arms(src: str) -> tuple[str, dict]:
    """A folder's arms.json (or the file itself): its path and contents."""
    path = os.path.join(src, "arms.json") if os.path.isdir(src) else src
    with open(path) as f:
        return path, json.load(f)


def first_lambda_max(workload: str, srcs: list[str]) -> float | None:
    """Stock's lambda_max for `workload` from the first of `srcs` that has one (a missing folder
    has none): benchmarks/arms_gpu.sh gives it to `detent tune --max-throughput`."""
    for src in srcs:
        try:
            return read_arms(src)[1]["lambda_max"][workload]
        except (OSError, KeyError):
            continue
    return None


def borrow_lambda_max(res: dict, src: str, missing: list[str]) -> list[str]:
    """Take stock's lambda_max for `missing` from an earlier folder of the same workloads (its
    arms.json), so the default and tuned arms serve the same rates without a stock run (330 s of
    a lease on W-B); res records where each came from, and the report says so. Returns the
    workloads still missing."""
    path, other = read_arms(src)
    if other.get("workload_args") != res["workload_args"]:
        raise SystemExit(f"--lambda-max-from {path}: other workloads ({other.get('workload_args')}, not "
                         f"{res['workload_args']})")
    got = [w for w in missing if w in other.get("lambda_max", {})]
    for w in got:
        res["lambda_max"][w] = other["lambda_max"][w]
        res.setdefault("lambda_max_from", {})[w] = path
        print(f"stock lambda_max {w}: {res['lambda_max'][w]:.3f} req/s, from {path}", flush=True)
    return [w for w in missing if w not in got]


def run(a) -> None:
    """Tune (unless the tuples exist), then serve `--arms` on `--loads`; results merge into
    OUT/arms.json, so an arm (or a workload of it) can run in one device call each (stock
    first: the other arms' rates come from its lambda_max)."""
    from detent.workloads import make
    os.makedirs(a.out, exist_ok=True)
    names = a.workloads.split(",")
    wargs = {"num_requests": a.num_requests, "max_len": a.max_len, "seed": a.seed, "vocab": a.vocab}
    res_path, res = load_results(a, names, wargs)
    workloads = {w: make(w, **wargs) for w in names}
    a.loads = [x for x in a.loads.split(",") if x]
    arms = sorted((x for x in a.arms.split(",") if x), key=lambda x: x != "stock")  # stock first: lambda_max
    unknown = [x for x in arms if x not in ARMS and x not in {f"tuned-{w}" for w in names}]
    if unknown:
        raise SystemExit(f"--arms: unknown {unknown}; arms: {', '.join(ARMS)}, or tuned-W for one workload's tuple")
    wanted = [w for w in names if not a.loads or w in a.loads or any(ld.name in a.loads for ld in workloads[w].loads)]
    # a closed loop's rate is its own: only workloads with Poisson loads need stock's lambda_max
    missing = [w for w in wanted if w not in res["lambda_max"] and any(ld.fraction for ld in workloads[w].loads)]
    if "stock" not in arms:  # borrowed before the tunes, which place the loads by it
        for src in a.lambda_max_from:
            if not missing:
                break
            missing = borrow_lambda_max(res, src, missing)
    if a.tune_only or any(x == "pinned-tuned" or x.startswith("tuned-") for x in arms):
        # kept and skipped once written: repeat a call cut short; tuned-W needs only W's tuple
        need = names if a.tune_only or "pinned-tuned" in arms else [w for w in names if f"tuned-{w}" in arms]
        res["tuples"] = {**res.get("tuples", {}), **tune_all(a, need, res["lambda_max"])}
    if a.tune_only:
        return save(res_path, res)
    res.update(deployment=engine_args(a), model=a.model, prompt_format=a.prompt_format,
               prefix_reuse={w: workloads[w].prefix_reuse for w in names})
    if missing and "stock" not in arms and (arms or a.vllm_url):
        raise SystemExit(f"no stock lambda_max for {missing} yet: run --arms stock on them first")
    url = f"http://127.0.0.1:{a.port}"
    for arm, extra in servers(arms, res["tuples"]):
        key = arm + a.tag
        proc = start(a, key, extra)
        try:
            model = served_model(url)
            warm_up(url, model, a.prompt_format)  # uncounted, as vllm bench serve's test run
            if arm == "stock":
                for w in missing:
                    res["lambda_max"][w] = max_throughput(url, model, workloads[w], prompt_format=a.prompt_format)
                    save(res_path, res)
                    print(f"stock lambda_max {w}: {res['lambda_max'][w]:.3f} req/s", flush=True)
            serve_loads(url, model, workloads, res["lambda_max"], a, key, res["arms"].setdefault(key, {}),
                        lambda: save(res_path, res))
        finally:
            stop_server(proc)
        save(res_path, res)
    if a.vllm_url:
        vurl = a.vllm_url.rstrip("/")
        vmodel = served_model(vurl, a.api_key)
        warm_up(vurl, vmodel, a.prompt_format, a.api_key)
        vllm = "vllm" + a.tag
        serve_loads(vurl, vmodel, workloads, res["lambda_max"], a, vllm, res["arms"].setdefault(vllm, {}),
                    lambda: save(res_path, res), a.api_key)
    save(res_path, res)
    if "stock" in res["arms"]:
        from arms_report import report
        report(a.out)


def save(path: str, res: dict) -> None:
    with open(path, "w") as f:
        json.dump(res, f, indent=1)


def main(argv=None) -> None:
    p = argparse.ArgumentParser("serve_arms")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--workloads", default="W-A,W-B,W-C")
    r.add_argument("--arms", default=",".join(ARMS), help="stock, conservative, pinned-default, pinned-tuned "
                   "(every workload's tuple), tuned-W (one); default all")
    r.add_argument("--loads", default="", help="only these loads or workloads' loads (A1,B2 or W-B); default all")
    r.add_argument("--vllm-url", default=None, help="a running `vllm serve` of the same model: the vLLM arm")
    r.add_argument("--api-key", default=None, help="the vLLM server's API key")
    r.add_argument("--lambda-max-from", action="append", default=[], help="an earlier folder (or its arms.json) "
                   "of the same workload arguments whose stock lambda_max sets the rates, for arms served without a "
                   "stock run; repeat it for workloads whose lambda_max came from several folders (each workload's "
                   "from the first folder that has it)")
    r.add_argument("--num-requests", type=int, default=None, help="smaller workloads (default: the full ones)")
    r.add_argument("--max-len", type=int, default=None, help="each request's prompt + output at most this")
    r.add_argument("--vocab", type=int, default=32000)
    r.add_argument("--prompt-format", choices=("ids", "words"), default="ids")
    r.add_argument("--device", default="auto")
    r.add_argument("--dtype", default="auto")
    r.add_argument("--load-format", default=None)
    r.add_argument("--tp", type=int, default=None)
    r.add_argument("--max-model-len", type=int, default=None)
    r.add_argument("--max-num-batched-tokens", type=int, default=None)
    r.add_argument("--max-num-seqs", type=int, default=None)
    r.add_argument("--server-args", default="", help="more detent-serve arguments (not deployment facts)")
    r.add_argument("--tune-args", default="", help="more `detent tune` arguments (the tune runs with `--cost "
                   "kernels`, confirmed on the engine: the whole W-C in 408 s on one H200, where the engine cost "
                   "did not finish in 540 s; `--tune-args='--cost engine'` overrides it)")
    r.add_argument("--tune-only", action="store_true", help="only tune the workloads' tuples (OUT/tuple-W.json)")
    r.add_argument("--tag", default="", help="store the arms as ARM+TAG (e.g. @2: pinned-default@2, a second run "
                   "of the same arm; the report sets its p50 TPOT against the first run's, the run-to-run drift; "
                   "a tag that starts with '-' is given as --tag=-bi)")
    r.add_argument("--port", type=int, default=8100)
    r.add_argument("--startup-timeout", type=float, default=900)
    r.add_argument("--seed", type=int, default=0)
    rep = sub.add_parser("report")
    rep.add_argument("dir")
    lm = sub.add_parser("lambda-max", help="print stock's lambda_max for a workload from the first of these "
                        "folders (or arms.json files) that has it; nothing if none")
    lm.add_argument("workload")
    lm.add_argument("src", nargs="*")
    a = p.parse_args(argv)
    if a.cmd == "run":
        run(a)
    elif a.cmd == "lambda-max":
        print(first_lambda_max(a.workload, a.src) or "")
    else:
        from arms_report import report
        report(a.dir)


if __name__ == "__main__":
    main()
