"""vLLM's own GPU kernels under load: where its steps spend device time (issue 16).

Detent's side of a mixed step is measured by `benchmarks/mixed_kernels.py` and the
engine's step counters; vLLM's side was never measured, and lease 14 could not say
how vLLM fits a 1,024-token prompt's step in ~23 ms when the GEMMs alone take 21.5.
This runs vLLM's torch profiler for a window of engine iterations in the middle of
one load and sums the trace's GPU kernels.

    # serve_load.py does both halves: the server flag, and `--profile` for that load
    python3 benchmarks/serve_load.py run --server vllm --out /tmp/load --loads c128,r80 --profile-load r80
    python3 benchmarks/vllm_profile.py /tmp/load/vprof --out $OUT/vllm_kernels.json

The summary: the window (first kernel start to last kernel end), the kernels' total,
the same split into families by name (`kernel_families.py`, the table
`mixed_kernels.py` uses for Detent's kernels), and the top kernels. Where the trace
holds Detent's step ranges (`detent.step.decode`, `.mixed`, `.prefill`: each step's
launch, engine/profiler.py), `by_step` splits the kernel time by the step kind that
launched it: a kernel links to its launch call by its correlation id.
"""
from __future__ import annotations

import argparse
import bisect
import glob
import gzip
import json
import os
from collections import Counter

from kernel_families import family


def _events(path: str) -> list[dict]:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f).get("traceEvents", [])


def summarize(trace_dir: str, top: int = 30) -> dict:
    """Sum the GPU kernels of every trace under `trace_dir` (one per profiled process)."""
    paths = sorted(glob.glob(os.path.join(trace_dir, "**", "*.json*"), recursive=True))
    if not paths:
        raise SystemExit(f"no trace under {trace_dir}: was the server started with --profiler-config?")
    events = [e for p in paths for e in _events(p)]
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        raise SystemExit(f"the traces under {trace_dir} hold no GPU kernel")
    start = min(e["ts"] for e in kernels)
    end = max(e["ts"] + e["dur"] for e in kernels)
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        s = by_name.setdefault(e["name"], [0.0, 0])
        s[0] += e["dur"] / 1e3
        s[1] += 1
    fams: dict[str, float] = {}
    for name, (ms, _) in by_name.items():
        fams[family(name)] = fams.get(family(name), 0.0) + ms
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return {"traces": [os.path.relpath(p, trace_dir) for p in paths], "window_ms": (end - start) / 1e3,
            "kernel_ms": sum(ms for ms, _ in by_name.values()),
            "families_ms": dict(sorted(fams.items(), key=lambda kv: -kv[1])),
            "top_kernels": [[name[:120], ms, n] for name, (ms, n) in ranked[:top]],
            **({"by_step": steps} if (steps := by_annotation(events, kernels, STEP_PREFIX)) else {})}


STEP_PREFIX = "detent.step."


def by_annotation(events: list[dict], kernels: list[dict], prefix: str) -> dict:
    """Kernel time by the host range named `prefix...` that launched it: {name: {"ranges",
    "kernel_ms", "families_ms"}}, "unattributed" for kernels launched outside every range;
    empty when the trace has no such range. A kernel's launch is the runtime or driver call
    with its correlation id (cudaLaunchKernel, cudaGraphLaunch, ...)."""
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
                    if e.get("ph") == "X" and e.get("cat") == "user_annotation" and "dur" in e
                    and e.get("name", "").startswith(prefix))
    if not ranges:
        return {}
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    starts = [r[0] for r in ranges]
    counts = Counter(r[2] for r in ranges)
    out: dict[str, dict] = {}
    for k in kernels:
        t = launched.get(k.get("args", {}).get("correlation"))
        name = "unattributed"
        if t is not None:
            i = bisect.bisect_right(starts, t) - 1
            if i >= 0 and t <= ranges[i][1]:
                name = ranges[i][2]
        d = out.setdefault(name, {"ranges": counts.get(name, 0), "kernel_ms": 0.0, "families_ms": {}})
        ms, fam = k["dur"] / 1e3, family(k["name"])
        d["kernel_ms"] += ms
        d["families_ms"][fam] = d["families_ms"].get(fam, 0.0) + ms
    return out


def server_flags(trace_dir: str, delay_iterations: int = 300, max_iterations: int = 200) -> list[str]:
    """vLLM's server flags for a profile of `max_iterations` engine steps after `delay_iterations`
    (the load's start: its queue fills first), GPU and host traces in `trace_dir`, no stacks."""
    cfg = {"profiler": "torch", "torch_profiler_dir": os.path.abspath(trace_dir), "torch_profiler_with_stack": False,
           "ignore_frontend": True, "delay_iterations": delay_iterations, "max_iterations": max_iterations}
    return ["--profiler-config", json.dumps(cfg)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser("vllm_profile")
    ap.add_argument("trace_dir")
    ap.add_argument("--out", required=True)
    ap.add_argument("--top", type=int, default=30)
    a = ap.parse_args(argv)
    s = summarize(a.trace_dir, a.top)
    with open(a.out, "w") as f:
        json.dump(s, f, indent=1)
    print(f"window {s['window_ms']:.1f} ms, kernels {s['kernel_ms']:.1f} ms:",
          json.dumps({k: round(v, 2) for k, v in s["families_ms"].items()}))


if __name__ == "__main__":
    main()
