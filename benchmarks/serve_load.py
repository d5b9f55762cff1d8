"""Serving under load, side by side: `detent-serve` and `vllm serve` driven by
vLLM's own load generator (`vllm bench serve`), one server after the other in
one lease, on the same prompts.

    # on the GPU machine, after installing the vLLM peer (docs/performance.md):
    python3 benchmarks/serve_load.py run --server vllm   --out $OUT/load
    python3 benchmarks/serve_load.py run --server detent --out $OUT/load
    # several configurations, one server after the other (files suffixed by each TAG):
    python3 benchmarks/serve_load.py run --server detent --out $OUT/load --loads r20,c128 \
        --arm= --arm='-pieces=--mixed-graph-max-tokens 0' --arm='-cap0=--max-mixed-batched-tokens 0'
    python3 benchmarks/serve_load.py report $OUT/load    # table (markdown) + serve_load.png

Loads (each with its own seeded prompts, identical for both servers):
closed loop at C = 1, 16, 64, 128 (`c1` ...), Poisson at 10 and 20 req/s
(`r10`, `r20`) and at 80% of vLLM's maximum throughput (`r80`: 0.8 x vLLM's
request throughput at C = 128, read from vLLM's results in the same folder),
on random 1,024-token prompts with 128 output tokens; and a ShareGPT-like mix
(`s10`: Poisson 10 req/s, `sc64`: C = 64) from a synthetic, seeded ShareGPT
file (log-normal prompt and output lengths, benchmarks/loadgen.sharegpt_like).
The model is a Llama-3.1-8B-shaped directory with a word-level tokenizer
(benchmarks/wordlevel_model.py), so prompt lengths are exact. vLLM 0.20's
`bench serve` sends no sampling parameters unless told, so each server's
defaults apply: this directory has no generation_config.json, so both sample
at temperature 1 without truncation. `--sampling` sends its flags with every
request (e.g. `--temperature=0.6 --top-p=0.9`, what Llama-3.1-8B-Instruct's
generation_config.json gives both servers by default).

The load generator is imported once per run: `BenchWorker`
(benchmarks/bench_worker.py) keeps one process that calls
`vllm.benchmarks.serve`'s `main` for every load, started beside the server
so its import overlaps the server's startup; a load it fails runs through
the CLI instead.

While the server is loaded at `r20`, a seeded probe request (logprobs 5) is
sent again and again; its token ids and logprobs are compared with `==`
against the same request sent to the idle server (the invariance battery
over HTTP under load). vLLM stock is expected to differ.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from bench_worker import BenchWorker  # noqa: E402

RANDOM = ["--dataset-name", "random", "--random-input-len", "1024", "--random-output-len", "128"]
LOADS = {  # name: (arguments, number of prompts, dataset)
    "c1": (["--max-concurrency", "1"], 32, "random"),
    "c16": (["--max-concurrency", "16"], 128, "random"),
    "c64": (["--max-concurrency", "64"], 256, "random"),
    "c128": (["--max-concurrency", "128"], 384, "random"),
    "r10": (["--request-rate", "10"], 200, "random"),
    "r20": (["--request-rate", "20"], 400, "random"),
    "r80": (None, 400, "random"),
    "s10": (["--request-rate", "10"], 200, "sharegpt"),
    "sc64": (["--max-concurrency", "64"], 256, "sharegpt"),
}
PROBE = {"model": "m", "prompt": " ".join(f"t{1000 + 37 * i}" for i in range(200)), "max_tokens": 32,
         "temperature": 1.0, "seed": 1234, "logprobs": 5, "ignore_eos": True}


def write_sharegpt(path: str, n: int = 2000, seed: int = 0) -> str:
    """A synthetic ShareGPT file (first human turn, first answer) for the word-level tokenizer;
    vLLM's loader keeps prompts of 4..1,024 tokens with prompt + answer <= 2,048."""
    from loadgen import sharegpt_like

    rng = random.Random(seed)
    rows = []
    for k, (p, o) in enumerate(sharegpt_like(n, seed)):
        p, o = min(p, 1024), max(4, min(o, 2048 - min(p, 1024)))
        words = lambda m: " ".join(f"t{rng.randrange(10, 128000)}" for _ in range(m))  # noqa: E731
        rows.append({"id": str(k), "conversations": [{"from": "human", "value": words(p)},
                                                      {"from": "gpt", "value": words(o)}]})
    with open(path, "w") as f:
        json.dump(rows, f)
    return path


def _get(url: str, timeout: float = 5.0) -> int:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status
    except Exception:  # noqa: BLE001
        return 0


def seed_for(load: str, profiled: bool = False) -> int:
    """The load's prompt seed, from its name: a run of some of the loads (`--loads`) sends
    the same prompts as a run of all of them. The profiled rerun (`--profile-load`) draws
    other prompts than every load's: with its load's own, the prefix cache would serve them."""
    return list(LOADS).index(load) + 1 + (len(LOADS) if profiled else 0)


def _post(url: str, body: dict, timeout: float = 120.0) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def vllm_env(vllm_path: str) -> dict:
    """vLLM's bundle (its own torch-compatible dependencies) on the path of vLLM's processes only."""
    return {**os.environ, "PYTHONPATH": vllm_path}


def start_server(kind: str, model_dir: str, port: int, extra: list[str], log_path: str,
                 vllm_path: str, load_format: str = "dummy") -> subprocess.Popen:
    common = ["--model", model_dir, "--load-format", load_format, "--dtype", "bfloat16", "--max-model-len", "4096",
              "--served-model-name", "m", "--port", str(port)]
    if kind == "detent":
        cmd = [sys.executable, "-m", "detent.server.cli", *common, "--log-level", "warning"]
    else:
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *common,
               "--gpu-memory-utilization", "0.88"]
    log = open(log_path, "w")
    env = vllm_env(vllm_path) if kind == "vllm" else None
    return subprocess.Popen(cmd + extra, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def bench(port: int, model_dir: str, args: list[str], n: int, dataset: str, seed: int, out_dir: str,
          name: str, sharegpt: str, vllm_path: str, worker: BenchWorker | None = None,
          sampling: list[str] = ()) -> dict:
    data = RANDOM if dataset == "random" else ["--dataset-name", "sharegpt", "--dataset-path", sharegpt]
    argv = ["--backend", "openai", "--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--tokenizer", model_dir,
            *data, "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99",
            "--seed", str(seed), "--num-prompts", str(n), *args, *sampling, "--save-result", "--result-dir", out_dir,
            "--result-filename", name + ".json"]
    t0 = time.time()
    try:
        if worker is None:
            raise RuntimeError("no bench worker")
        worker.run(argv)
    except RuntimeError as e:  # the CLI, as before
        if worker is not None:
            print(f"{name}: bench worker failed ({e}); running `vllm bench serve`", flush=True)
        subprocess.run([sys.executable, "-m", "vllm.entrypoints.cli.main", "bench", "serve", *argv], check=True,
                       stdout=subprocess.DEVNULL, env=vllm_env(vllm_path))
    with open(os.path.join(out_dir, name + ".json")) as f:
        r = json.load(f)
    keep = {k: v for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    keep["wall_s"] = time.time() - t0
    return keep


def _step_series() -> dict[str, str]:
    """Detent's per-step-kind metric families -> the engine's counter names (server/metrics.py)."""
    from detent.server.metrics import PREFIX, STEP_KIND_SERIES
    return {PREFIX + stem: field for field, (stem, _) in STEP_KIND_SERIES.items()}


STEP_SERIES = _step_series()


def _metric_families(url: str) -> list:
    """The server's /metrics, parsed; none when it cannot be read."""
    from prometheus_client.parser import text_string_to_metric_families
    try:
        with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
            return list(text_string_to_metric_families(r.read().decode()))
    except Exception:  # noqa: BLE001
        return []


def step_kinds(url: str) -> dict:
    """Detent's steps so far by kind from /metrics: {kind: {"steps", "seconds", "tokens",
    "wait_seconds", "launch_seconds", "prepare_seconds", "forward_seconds", "whole_graph_steps",
    "piecewise_steps", "device_seconds", "device_idle_seconds", "decode_rows", "decode_row_seconds",
    "rows_left_out"}}
    (prepare and forward: the launch's input preparation and model call; then how many steps
    replayed one CUDA graph and how many the piecewise graphs; then the device's span of the steps
    and its idle time before them; then the steps' decode rows, and those rows times their step's
    seconds; then the generating requests the steps left out), under "host" the step loop's host
    seconds by part (detent:engine_host_seconds_total), and under "engine" the preemptions so far
    (either server's num_preemptions_total); empty for a server without those series."""
    out: dict = {}
    for fam in _metric_families(url):
        if fam.name in STEP_SERIES:
            for smp in fam.samples:
                if smp.name.endswith("_total"):
                    out.setdefault(smp.labels["kind"], {})[STEP_SERIES[fam.name]] = smp.value
        elif fam.name == "detent:engine_host_seconds":
            for smp in fam.samples:
                if smp.name.endswith("_total"):
                    out.setdefault("host", {})[smp.labels["part"]] = smp.value
        elif fam.name.split(":", 1)[-1] == "num_preemptions":
            out["engine"] = {"preemptions": sum(smp.value for smp in fam.samples if smp.name.endswith("_total"))}
    return out


# per-request latencies both servers export (vLLM's names, under "vllm:" or "detent:"): TTFT and
# end-to-end run on the API process's clock, when it handles the output; queue, prefill, decode and
# time per output token are differences of the engine's own timestamps (server/request_stats.py)
LATENCY_SERIES = ("time_to_first_token_seconds", "e2e_request_latency_seconds",
                  "request_time_per_output_token_seconds", "request_decode_time_seconds",
                  "request_prefill_time_seconds", "request_queue_time_seconds")


def request_latency(url: str) -> dict:
    """{series: (sum, count)} of the per-request latency histograms in /metrics so far."""
    out: dict = {}
    for fam in _metric_families(url):
        stem = fam.name.split(":", 1)[-1]
        if stem in LATENCY_SERIES:
            sums = {smp.name.rsplit("_", 1)[-1]: smp.value for smp in fam.samples
                    if smp.name.endswith(("_sum", "_count"))}
            if "sum" in sums and "count" in sums:
                s, c = out.get(stem, (0.0, 0.0))
                out[stem] = (s + sums["sum"], c + sums["count"])  # one model: one labelled series
    return out


def latency_means(before: dict, after: dict) -> dict:
    """The mean of each per-request latency (ms) over the requests one load finished: what the
    server saw, to set beside what the client saw (a gap between the two is delivery)."""
    out = {}
    for stem, (s, c) in after.items():
        s0, c0 = before.get(stem, (0.0, 0.0))
        if c > c0:
            out[stem.removesuffix("_seconds")] = 1e3 * (s - s0) / (c - c0)
    return out


def host_delta(before: dict, after: dict, steps: dict) -> dict:
    """The step loop's host milliseconds per step (all kinds) that one load added, by part."""
    n = sum(d["steps"] for d in steps.values())
    a, b = after.get("host", {}), before.get("host", {})
    return {p: 1e3 * (v - b.get(p, 0.0)) / n for p, v in a.items()} if n else {}


def kinds_delta(before: dict, after: dict) -> dict:
    """What one load added, per step kind, with the mean step time and tokens per step."""
    out = {}
    for kind, a in after.items():
        b = before.get(kind, {})
        d = {k: a.get(k, 0.0) - b.get(k, 0.0) for k in STEP_SERIES.values()}
        if d["steps"] > 0:
            d["ms_per_step"] = 1e3 * d["seconds"] / d["steps"]
            d["tokens_per_step"] = d["tokens"] / d["steps"]
            for k in ("wait", "launch", "prepare", "forward", "device", "device_idle"):
                d[f"{k}_ms_per_step"] = 1e3 * d[f"{k}_seconds"] / d["steps"]
            d["decode_rows_per_step"] = d["decode_rows"] / d["steps"]
            d["rows_left_out_per_step"] = d["rows_left_out"] / d["steps"]
            if d["decode_rows"] > 0:  # the step time a generated token of this kind of step waited for
                d["row_weighted_ms"] = 1e3 * d["decode_row_seconds"] / d["decode_rows"]
            out[kind] = d
    return out


def probe_under_load(url: str, stop: threading.Event, results: list) -> None:
    while not stop.is_set():
        try:
            results.append(_post(url + "/v1/completions", PROBE)["choices"][0])
        except Exception as e:  # noqa: BLE001
            results.append({"error": repr(e)})
        time.sleep(0.2)


def _bits(choice: dict):
    lp = choice.get("logprobs") or {}
    return choice.get("text"), lp.get("token_logprobs"), lp.get("top_logprobs")


def run(a) -> None:
    # a `timeout` around the run sends SIGTERM: leave through `finally` (stop the server, write
    # the summary, pack), as the device's call limit would otherwise lose the loads already run
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.makedirs(a.out, exist_ok=True)
    sharegpt = write_sharegpt(os.path.join(a.out, "sharegpt_synthetic.json"))
    arms = [tuple(x.split("=", 1)) if "=" in x else (x, "") for x in a.arm] or [(a.tag, a.server_args)]
    worker = BenchWorker(vllm_env(a.vllm_path), os.path.join(a.out, "bench.log"))  # imports while a server starts
    try:
        for i, (tag, server_args) in enumerate(arms):  # one server after the other, a port each
            run_arm(a, tag, server_args, a.port + i, sharegpt, worker)
    finally:
        worker.close()
        if a.pack:
            pack(a.out, a.pack)


def run_arm(a, tag: str, server_args: str, port: int, sharegpt: str, worker: BenchWorker) -> None:
    """One server configuration (`tag`: its files' suffix) over the loads."""
    extra = server_args.split()
    if a.profile_load:  # the server's torch profiler (vLLM's flag; detent-serve takes it too), started by `--profile`
        from vllm_profile import server_flags
        extra += server_flags(os.path.join(a.out, f"vprof-{a.server}{tag}"))
    proc = start_server(a.server, a.model_dir, port, extra, os.path.join(a.out, f"{a.server}{tag}.log"),
                        a.vllm_path, a.load_format)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while _get(url + "/health") != 200:
        if proc.poll() is not None or time.time() - t0 > a.startup_timeout:
            stop_server(proc)
            raise SystemExit(f"{a.server} did not start; see {a.server}{tag}.log")
        if worker.dead():  # its imports failed: every load would fail, through the CLI too
            stop_server(proc)
            raise SystemExit(f"the load generator exited before the first load; see bench.log "
                             f"(--vllm-path {a.vllm_path})")
        time.sleep(1)
    summary = {"server": a.server, "startup_s": time.time() - t0, "server_args": server_args, "sampling": a.sampling,
               "load_format": a.load_format, "loads": {}}
    try:
        alone = _post(url + "/v1/completions", PROBE)["choices"][0]
        for name, (args, n, ds) in (("warmup", (["--max-concurrency", "64"], 192, "random")),):
            bench(port, a.model_dir, args, n, ds, 99, a.out, f"{a.server}-{name}", sharegpt, a.vllm_path, worker,
                  a.sampling.split())
        # the profiled load runs once more after the others: the profiler slows it, so its
        # latencies stay out of the side by side
        runs = [(name, False) for name in a.loads.split(",")] + ([(a.profile_load, True)] if a.profile_load else [])
        for name, profiled in runs:
            args, n, ds = LOADS[name]
            if args is None:  # r80: 80% of vLLM's maximum request throughput (C = 128)
                ref = os.path.join(a.out, "vllm-c128.json")
                if not os.path.exists(ref):
                    print("r80 skipped: no vllm-c128.json in", a.out, flush=True)
                    continue
                with open(ref) as f:
                    rate = 0.8 * json.load(f)["request_throughput"]
                args = ["--request-rate", f"{rate:.2f}"]
                summary["r80_rate"] = rate
            if profiled:
                args = [*args, "--profile"]
            probes: list = []
            stop = threading.Event()
            th = None
            if name == "r20":
                th = threading.Thread(target=probe_under_load, args=(url, stop, probes), daemon=True)
                th.start()
            before, lat_before = step_kinds(url), request_latency(url)
            label = name + ("-profiled" if profiled else "")
            r = bench(port, a.model_dir, args, n, ds, seed_for(name, profiled), a.out, f"{a.server}-{label}{tag}",
                      sharegpt, a.vllm_path, worker, a.sampling.split())
            stop.set()
            time.sleep(1.0)  # the idle core's stats snapshot
            after = step_kinds(url)
            lat = latency_means(lat_before, request_latency(url))
            if lat:
                r["server_mean_ms"] = lat
                print(name, "server means (ms):", json.dumps({k: round(v, 2) for k, v in lat.items()}), flush=True)
            steps = kinds_delta(before, after)
            if "engine" in after:  # a preempted request recomputes its prompt and outputs: more mixed tokens
                r["preemptions"] = after["engine"]["preemptions"] - before.get("engine", {}).get("preemptions", 0.0)
            if steps:
                r["steps"] = steps
                r["host_ms_per_step"] = host_delta(before, after, steps)
                print(name, "steps:", json.dumps({k: {m: round(v, 1) for m, v in d.items()}
                                                  for k, d in steps.items()}), flush=True)
            if th is not None:
                th.join(120)
                ok = [p for p in probes if "error" not in p]
                summary["probe"] = {"sent": len(probes), "answered": len(ok),
                                    "equal_to_alone": sum(_bits(p) == _bits(alone) for p in ok)}
            summary["loads"][label] = r
            write_summary(os.path.join(a.out, f"summary-{a.server}{tag}.json"), summary)  # kept if cut short
            print(label, json.dumps({k: round(v, 2) for k, v in r.items()
                                    if k in ("output_throughput", "median_tpot_ms", "p99_tpot_ms",
                                             "median_ttft_ms", "p99_ttft_ms", "median_itl_ms")}), flush=True)
        if "probe" in summary:
            print("probe under load:", summary["probe"], flush=True)
    finally:
        stop_server(proc)
        write_summary(os.path.join(a.out, f"summary-{a.server}{tag}.json"), summary)
    if a.profile_load:  # one small JSON that `--pack` carries, not the traces
        from vllm_profile import summarize
        try:
            kernels = summarize(os.path.join(a.out, f"vprof-{a.server}{tag}"))
        except SystemExit as e:  # the loads' results stand without it
            print(f"{a.server} kernels:", e, flush=True)
            return
        with open(os.path.join(a.out, f"{a.server}-kernels-{a.profile_load}{tag}.json"), "w") as f:
            json.dump(kernels, f, indent=1)
        print(f"{a.server} kernels:", json.dumps({k: round(v, 1) for k, v in kernels["families_ms"].items()}),
              f"window {kernels['window_ms']:.0f} ms", flush=True)
        for step, d in kernels.get("by_step", {}).items():  # Detent's step ranges
            print(f"  {step}: {d['ranges']} steps,", json.dumps({k: round(v, 1) for k, v in d["families_ms"].items()}),
                  flush=True)


def write_summary(path: str, summary: dict) -> None:
    """Write a run's summary; an earlier run's loads in the same file (`--loads` in parts) are kept."""
    if os.path.exists(path):
        with open(path) as f:
            earlier = json.load(f)
        summary = {**earlier, **summary, "loads": {**earlier.get("loads", {}), **summary["loads"]}}
    with open(path, "w") as f:
        json.dump(summary, f, indent=1)


def pack(out_dir: str, path: str) -> None:
    """Every result and log of `out_dir` in one .tgz (the device returns few files), without
    the synthetic ShareGPT file."""
    import tarfile
    with tarfile.open(path, "w:gz") as t:
        for name in sorted(os.listdir(out_dir)):
            if name.endswith((".json", ".log")) and not name.startswith("sharegpt"):
                t.add(os.path.join(out_dir, name), arcname=name)


def main() -> None:
    p = argparse.ArgumentParser("serve_load")
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--server", choices=("detent", "vllm"), required=True)
    r.add_argument("--model-dir", default="/tmp/wl8b")
    r.add_argument("--load-format", choices=("dummy", "auto"), default="dummy",
                   help="dummy: each server's own random weights; auto: the safetensors files in --model-dir "
                        "(benchmarks/wordlevel_model.py --weights), the same values for both servers")
    r.add_argument("--out", required=True)
    r.add_argument("--loads", default="c1,c16,c64,c128,r10,r20,r80,s10,sc64")
    r.add_argument("--server-args", default="")
    r.add_argument("--port", type=int, default=8100)
    r.add_argument("--startup-timeout", type=float, default=600)
    r.add_argument("--vllm-path", default="/tmp/vsite", help="where the vLLM bundle is installed")
    r.add_argument("--tag", default="", help="suffix of this run's files (another configuration)")
    r.add_argument("--arm", action="append", default=[], metavar="TAG=SERVER_ARGS",
                   help="a server configuration to run after the others, on the next port (repeatable; "
                        "instead of --tag / --server-args; write --arm=TAG=..., as a tag starts with '-'), e.g. "
                        "--arm= --arm='-pieces=--mixed-graph-max-tokens 0'")
    r.add_argument("--profile-load", default=None, metavar="LOAD",
                   help="run this load once more after the others under the server's torch profiler (vLLM's "
                        "--profiler-config, which detent-serve takes too): 200 engine steps after the first 300 "
                        "(results LOAD-profiled; traces in OUT/vprof; kernels by family in "
                        "SERVER-kernels-LOAD.json, benchmarks/vllm_profile.py)")
    r.add_argument("--sampling", default="", metavar="BENCH_FLAGS",
                   help="vllm bench serve's sampling flags, sent with every request (its default sends none: "
                        "the server's defaults apply), e.g. --sampling='--temperature=0.6 --top-p=0.9' with "
                        "--tag=-p09 for both servers")
    r.add_argument("--pack", default="", help="also write every result and log to this .tgz (e.g. $OUT/load.tgz)")
    rep = sub.add_parser("report")
    rep.add_argument("dir")
    a = p.parse_args()
    if a.cmd == "run":
        if a.profile_load and a.profile_load not in a.loads.split(","):
            p.error("--profile-load names one of --loads")
        if not os.path.exists(os.path.join(a.model_dir, "config.json")):
            from wordlevel_model import write, write_weights
            write(a.model_dir)
            if a.load_format == "auto":
                write_weights(a.model_dir)
        run(a)
    else:
        from serve_load_report import report
        report(a)


if __name__ == "__main__":
    main()
