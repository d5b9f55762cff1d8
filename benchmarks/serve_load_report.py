"""The side by side's report: `python3 benchmarks/serve_load.py report DIR` reads the
summaries `serve_load.py run` wrote into DIR and writes serve_load.md (the tables) and
serve_load.png."""
from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_load import LOADS  # noqa: E402


def _pair(d: dict, a: str, b: str, fmt: str) -> str:
    return f"{d[a]:{fmt}} / {d[b]:{fmt}}" if a in d and b in d else ""


# the report's step table: (header, cell) per column; a cell is empty where a run did not record it
STEP_COLUMNS = [
    ("steps", lambda d: f"{d['steps']:.0f}"), ("ms/step", lambda d: f"{d['ms_per_step']:.2f}"),
    ("tokens/step", lambda d: f"{d['tokens_per_step']:.1f}"),
    ("wait ms/step", lambda d: f"{d.get('wait_ms_per_step', 0):.2f}"),
    ("launch ms/step", lambda d: f"{d.get('launch_ms_per_step', 0):.2f}"),
    ("of which prepare / forward", lambda d: _pair(d, "prepare_ms_per_step", "forward_ms_per_step", ".2f")),
    ("of the steps, one graph / pieces", lambda d: _pair(d, "whole_graph_steps", "piecewise_steps", ".0f")),
    ("device ms/step: span / idle before",
     lambda d: _pair(d, "device_ms_per_step", "device_idle_ms_per_step", ".2f") if d.get("device_seconds") else ""),
    ("decode rows/step", lambda d: f"{d['decode_rows_per_step']:.1f}" if "decode_rows_per_step" in d else ""),
    ("row-weighted ms", lambda d: f"{d['row_weighted_ms']:.2f}" if "row_weighted_ms" in d else ""),
    ("rows left out/step", lambda d: f"{d['rows_left_out_per_step']:.2f}" if "rows_left_out_per_step" in d else ""),
]


def row_weighted_ms(steps: dict) -> float | None:
    """The step time a generated token waited for, over all kinds of step: a request's TPOT is
    the mean of its steps' times, so this is the engine's side of the mean TPOT."""
    rows = sum(d.get("decode_rows", 0) for d in steps.values())
    return 1e3 * sum(d.get("decode_row_seconds", 0.0) for d in steps.values()) / rows if rows else None


METRICS = [("output_throughput", "output tok/s"), ("median_tpot_ms", "TPOT p50"), ("p99_tpot_ms", "TPOT p99"),
           ("median_ttft_ms", "TTFT p50"), ("p99_ttft_ms", "TTFT p99")]


# (client's mean, server's mean) per row of the delivery table: the client's from `vllm bench
# serve`, the server's from its /metrics (serve_load.latency_means; time per output token by the
# engine's token timestamps, TTFT and end-to-end by the API process's clock)
DELIVERY = [("TTFT", "mean_ttft_ms", "time_to_first_token"),
            ("TPOT", "mean_tpot_ms", "request_time_per_output_token"),
            ("end to end", "mean_e2el_ms", "e2e_request_latency")]


def delivery_table(s: dict, names: list[str]) -> list[str]:
    """Mean latencies as the client saw them and as the server did, per server and load: where
    the client's exceed the server's, tokens reached the client later than the server had them."""
    rows = []
    for k, v in s.items():
        for n in names:
            r = v.get("loads", {}).get(n, {})
            srv = r.get("server_mean_ms")
            if not srv:
                continue
            cells = [f"{r[c]:.2f} / {srv[m]:.2f}" if c in r and m in srv else "" for _, c, m in DELIVERY]
            w = row_weighted_ms(r.get("steps", {}))
            cells.append("" if w is None else f"{w:.2f}")
            cells.append(f"{r['preemptions']:.0f}" if "preemptions" in r else "")
            rows.append(f"| {n} | {k} | " + " | ".join(cells) + " |")
    if not rows:
        return []
    heads = [f"{h} mean ms: client / server" for h, _, _ in DELIVERY] + ["steps' row-weighted ms", "preemptions"]
    return ["", "| load | server | " + " | ".join(heads) + " |", "|---|---|" + "---:|" * len(heads), *rows]


def report(a) -> None:
    """Tables (markdown, also serve_load.md) and serve_load.png from a folder's summaries:
    vLLM's, Detent's, and each other Detent configuration's (`summary-detent<tag>.json`,
    from `run --tag`), whose rows are labelled `load (tag)`. A tagged Detent run is set
    against vLLM's run of the same tag where there is one (a repeat of both servers),
    else against vLLM's untagged run."""
    s = {}
    tags = {srv: sorted(f[len(f"summary-{srv}"):-len(".json")] for f in os.listdir(a.dir)
                        if f.startswith(f"summary-{srv}") and f.endswith(".json")) for srv in ("vllm", "detent")}
    for k in [f"{srv}{t}" for srv in ("vllm", "detent") for t in tags[srv]]:
        with open(os.path.join(a.dir, f"summary-{k}.json")) as f:
            s[k] = json.load(f)
    detents = [k for k in s if k.startswith("detent")]

    def peer(k: str) -> dict:  # the vLLM run a Detent run is set against
        return s.get("vllm" + k[len("detent"):], s.get("vllm", {}))

    def label(n: str, k: str) -> str:
        return n if k == "detent" else f"{n} ({k[len('detent'):].lstrip('-')})"

    names = [n for n in LOADS if any(n in v["loads"] for v in s.values())]
    lines = ["| load | metric | vLLM | Detent | ratio |", "|---|---|---:|---:|---:|"]
    for n in names:
        for k in detents or ["detent"]:
            if k != "detent" and n not in s[k]["loads"]:
                continue
            for key, metric in METRICS:
                v = peer(k).get("loads", {}).get(n, {}).get(key)
                d = s.get(k, {}).get("loads", {}).get(n, {}).get(key)
                ratio = f"{d / v:.2f}" if v and d else ""
                fmt = (lambda x: f"{x:,.0f}") if key == "output_throughput" else (lambda x: f"{x:.2f}")
                lines.append(f"| {label(n, k)} | {metric} | {fmt(v) if v else ''} | {fmt(d) if d else ''} | {ratio} |")
    steps = [(label(n, k), kind, d) for n in names for k in detents
             for kind, d in s[k].get("loads", {}).get(n, {}).get("steps", {}).items()]
    if steps:  # Detent's steps by kind in each load (detent:engine_step_*_total differences)
        lines += ["", "| load | step kind | " + " | ".join(h for h, _ in STEP_COLUMNS) + " |",
                  "|---|---|" + "---:|" * len(STEP_COLUMNS)]
        lines += [f"| {n} | {kind} | " + " | ".join(cell(d) for _, cell in STEP_COLUMNS) + " |" for n, kind, d in steps]
    host = [(label(n, k), h) for n in names for k in detents
            if (h := s[k].get("loads", {}).get(n, {}).get("host_ms_per_step"))]
    if host:  # the step loop's host time per step (all kinds), by part
        from detent.engine import HOST_PARTS as parts
        lines += ["", "| load | host ms/step: " + " | ".join(parts) + " |", "|---|" + "---:|" * len(parts)]
        lines += [f"| {n} | " + " | ".join(f"{h.get(p, 0.0):.2f}" for p in parts) + " |" for n, h in host]
    lines += delivery_table(s, names)
    for k, v in s.items():
        if "probe" in v:
            lines.append(f"\n{k} probe under r20 load: {v['probe']}")
    text = "\n".join(lines)
    print(text)
    with open(os.path.join(a.dir, "serve_load.md"), "w") as f:
        f.write(text + "\n")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for k, v in s.items():
        xs = [n for n in names if n in v["loads"]]
        for ax, (key, label) in zip(axes, [("median_tpot_ms", "TPOT p50 (ms)"), ("p99_tpot_ms", "TPOT p99 (ms)"),
                                            ("median_ttft_ms", "TTFT p50 (ms)")]):
            ax.plot(xs, [v["loads"][n][key] for n in xs], "o-", label=k)
            ax.set_title(label)
            ax.set_yscale("log")
    for ax in axes:
        ax.legend()
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(os.path.join(a.dir, "serve_load.png"), dpi=120)
