"""The report of benchmarks/serve_arms.py: from OUT/arms.json, a markdown
table (arms.md: p50/p90/p99 TPOT and TTFT per load and arm, geometric-mean
ratios to stock, the tuple-drift matrix, the tuned tuple against the
default per workload, each Detent arm against vLLM's), the same numbers as JSON
(report.json), and two figures like the paper's:

- fig7.png: (a) each arm's p50 TPOT over stock's, per load; (b) the tuned
  arm's p50, p90 and p99 TPOT over stock's.
- fig8.png: the tuple-drift matrix. Rows: the tuple tuned on each workload;
  columns: the loads; cells: the row's p50 TPOT over the p50 TPOT of the
  column's own workload tuple. Outlined: a tuple on its own workload. Drawn
  once a tuple was served off its own workload (the diagonal alone is 1.000),
  with or without stock in the folder.

"pinned-tuned" at a load is the tuple tuned on that load's workload.
"""
from __future__ import annotations

import json
import math
import os

METRICS = [f"{m}_p{p}_ms" for m in ("tpot", "ttft") for p in (50, 90, 99)]
# vllm-bi: `vllm serve` with VLLM_BATCH_INVARIANT=1 (benchmarks/arms_gpu.sh), the paper's vLLM-Det
ORDER = ("stock", "conservative", "pinned-default", "pinned-tuned", "vllm", "vllm-bi")


def workload_of(res: dict) -> dict[str, str]:
    """load -> its workload, from every arm that served it (a folder need not hold stock)."""
    return {ld: r["workload"] for arm in res["arms"].values() for ld, r in arm.items()}


def arms_by_load(res: dict) -> tuple[list[str], dict[str, dict[str, dict]]]:
    """(the loads in order, arm -> load -> result), with pinned-tuned resolved per load. An arm
    stored under a tag that starts with '-' (`serve_arms.py run --tag=-mix8k --server-args ...`:
    an experiment with the server's other arguments) is a row of its own, after ORDER's; the
    tuned arms and a second run (`@2`) are not."""
    wl = workload_of(res)
    loads = sorted(wl)  # A1..A4, B1..B3, C1, C2: workload, then load
    table: dict[str, dict[str, dict]] = {}
    tagged = sorted(a for a in res["arms"] if a not in ORDER and "@" not in a and not a.startswith("tuned-"))
    for arm in (*ORDER, *tagged):
        if arm == "pinned-tuned":
            row = {ld: res["arms"].get(f"tuned-{wl[ld]}", {}).get(ld) for ld in loads}
        else:
            row = {ld: res["arms"].get(arm, {}).get(ld) for ld in loads}
        row = {ld: r for ld, r in row.items() if r}
        if row:
            table[arm] = row
    return loads, table


def geomean_ratio(table: dict, arm: str, metric: str) -> float | None:
    logs = [math.log(r[metric] / table["stock"][ld][metric]) for ld, r in table[arm].items()
            if ld in table.get("stock", {}) and r.get(metric) and table["stock"][ld].get(metric)
            and r[metric] > 0 and table["stock"][ld][metric] > 0]
    return math.exp(sum(logs) / len(logs)) if logs else None


def drift(res: dict, loads: list[str]) -> dict[str, dict[str, float]]:
    wl = workload_of(res)
    out: dict[str, dict[str, float]] = {}
    for w in res.get("tuples", {}):
        row = res["arms"].get(f"tuned-{w}", {})
        if not row:
            continue
        out[w] = {}
        for ld in loads:
            own = res["arms"].get(f"tuned-{wl[ld]}", {}).get(ld)
            if ld in row and own and own["tpot_p50_ms"] > 0:
                out[w][ld] = row[ld]["tpot_p50_ms"] / own["tpot_p50_ms"]
    return out


def drift_paired(res: dict, loads: list[str]) -> dict[str, dict[str, dict]]:
    """Off the diagonal of the drift matrix: per tuple and load of another workload, the paired
    per-request TPOT difference, that tuple - the load's own workload tuple, in ms (`paired`)."""
    wl = workload_of(res)
    out: dict[str, dict[str, dict]] = {}
    for w in res.get("tuples", {}):
        row = res["arms"].get(f"tuned-{w}", {})
        for ld in loads:
            own = res["arms"].get(f"tuned-{wl[ld]}", {}).get(ld)
            if wl[ld] != w and ld in row and own and "per_request" in row[ld] and "per_request" in own:
                p = paired(row[ld]["per_request"]["tpot_ms"], own["per_request"]["tpot_ms"])
                if p:
                    out.setdefault(w, {})[ld] = p
    return out


def paired(a: list, b: list, reps: int = 2000, seed: int = 0) -> dict | None:
    """The median of the per-request differences a - b (requests paired by index: the same
    prompt at the same arrival time), with a 95% bootstrap interval over the requests. The
    resampling sees the spread between requests of one run, not the drift between runs."""
    import random
    import statistics
    d = [x - y for x, y in zip(a, b) if x is not None and y is not None]
    if len(d) < 2:
        return None
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(d, k=len(d))) for _ in range(reps))
    return {"median": statistics.median(d), "lo": meds[int(0.025 * reps)], "hi": meds[int(0.975 * reps) - 1],
            "n": len(d)}


def _ratio_by_workload(num: dict, den: dict, metric: str = "tpot_p50_ms") -> dict[str, float]:
    """Per workload, the geometric mean over the loads both have of num's `metric` over den's."""
    logs: dict[str, list[float]] = {}
    for ld in (ld for ld in num if ld in den):
        if num[ld].get(metric) and den[ld].get(metric) and num[ld][metric] > 0 and den[ld][metric] > 0:
            logs.setdefault(num[ld]["workload"], []).append(math.log(num[ld][metric] / den[ld][metric]))
    return {w: math.exp(sum(v) / len(v)) for w, v in logs.items()}


def against_vllm(table: dict) -> dict[str, dict[str, dict[str, float]]]:
    """The side by side: per Detent arm, per workload, the geometric mean over the loads of its
    p50 TPOT and p50 TTFT over `vllm serve`'s (the arm `vllm`, driven by the same client at the
    same rates); empty without a vLLM arm."""
    if "vllm" not in table:
        return {}
    return {arm: {m: _ratio_by_workload(row, table["vllm"], m) for m in ("tpot_p50_ms", "ttft_p50_ms")}
            for arm, row in table.items() if not arm.startswith("vllm")}


def tuned_vs_default(res: dict, table: dict) -> dict:
    """Issue 20's "tuned <= default TPOT on every workload": per workload, the geometric mean
    over its loads of pinned-tuned's p50 TPOT over pinned-default's, and per load the paired
    per-request TPOT difference, tuned - default in ms (`paired`; arms.json files from before
    `per_request` have only the ratio). With a second run of the default (`serve_arms.py run
    --arms pinned-default --tag @2`), `default_repeat` is the same ratio between its two runs:
    how far a tuple moves from itself, run to run."""
    tuned, default = table.get("pinned-tuned", {}), table.get("pinned-default", {})
    out: dict = {"workloads": _ratio_by_workload(tuned, default), "loads": {}}
    for ld in (ld for ld in tuned if ld in default):
        t, d = tuned[ld], default[ld]
        if "per_request" in t and "per_request" in d:
            out["loads"][ld] = paired(t["per_request"]["tpot_ms"], d["per_request"]["tpot_ms"])
    again = next((v for k, v in sorted(res["arms"].items()) if k.startswith("pinned-default@")), None)
    if again:
        out["default_repeat"] = _ratio_by_workload(again, default)
    return out


def markdown(res: dict, loads: list[str], table: dict, ratios: dict, mat: dict, tvd: dict | None = None,
             vs_vllm: dict | None = None) -> str:
    lines = ["| load | arm | " + " | ".join(m.replace("_ms", "") for m in METRICS) + " | errors |",
             "|---|---|" + "---:|" * (len(METRICS) + 1)]
    for ld in loads:
        for arm, row in table.items():
            if ld in row:
                r = row[ld]
                lines.append(f"| {ld} | {arm} | " + " | ".join(f"{r[m]:.2f}" for m in METRICS) + f" | {r['errors']} |")
    if "stock" in table:
        lines += ["", "Geometric mean over the loads, ratio to stock:", "",
                  "| arm | " + " | ".join(m.replace("_ms", "") for m in METRICS) + " |",
                  "|---|" + "---:|" * len(METRICS)]
        for arm, row in ratios.items():
            lines.append(f"| {arm} | " + " | ".join("" if row[m] is None else f"{row[m]:.3f}" for m in METRICS) + " |")
    else:
        lines += ["", "No stock arm in this folder: no ratios to stock."]
    if mat:
        lines += ["", "Tuple drift (p50 TPOT over the column's own workload tuple):", "",
                  "| tuple of | " + " | ".join(loads) + " |", "|---|" + "---:|" * len(loads)]
        for w, row in mat.items():
            lines.append(f"| {w} | " + " | ".join(f"{row[ld]:.3f}" if ld in row else "" for ld in loads) + " |")
        off = drift_paired(res, loads)
        if off:
            lines += ["", "Off its own workload, per load the median paired per-request TPOT difference, the row's "
                      "tuple - the load's own workload tuple (ms), and its 95% bootstrap interval over the "
                      "requests:", ""]
            lines += [f"- tuple of {w}: " + "; ".join(f"{ld} {p['median']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}]"
                                                       for ld, p in row.items()) for w, row in off.items()]
    if tvd and tvd["workloads"]:
        lines += ["", "Tuned against default, p50 TPOT: geometric mean over each workload's loads of tuned / default; "
                  "per load, the median paired per-request difference tuned - default (ms) and its 95% "
                  "bootstrap interval over the requests:", "",
                  "| workload | tuned / default | load: median [interval] |",
                  "|---|---:|---|"]
        for w, ratio in tvd["workloads"].items():
            cells = [f"{ld}: {p['median']:+.3f} [{p['lo']:+.3f}, {p['hi']:+.3f}]" for ld, p in tvd["loads"].items()
                     if p and workload_of(res).get(ld) == w]
            lines.append(f"| {w} | {ratio:.4f} | {'; '.join(cells)} |")
        if tvd.get("default_repeat"):
            lines += ["", "The default run twice, second / first p50 TPOT (the run-to-run drift): "
                      + ", ".join(f"{w} {v:.4f}" for w, v in tvd["default_repeat"].items())]
    if vs_vllm:
        workloads = sorted({w for r in vs_vllm.values() for w in r["tpot_p50_ms"]})
        lines += ["", "Against vLLM (the same client and rates): geometric mean over each workload's loads of the "
                  "arm's p50 over vLLM's, TPOT / TTFT:", "",
                  "| arm | " + " | ".join(workloads) + " |", "|---|" + "---:|" * len(workloads)]
        for arm, r in vs_vllm.items():
            lines.append(f"| {arm} | " + " | ".join(
                f"{r['tpot_p50_ms'][w]:.3f} / {r['ttft_p50_ms'][w]:.3f}" if w in r["tpot_p50_ms"] else ""
                for w in workloads) + " |")
    lines += ["", f"stock lambda_max (req/s): {json.dumps({k: round(v, 3) for k, v in res['lambda_max'].items()})}"]
    lines += [f"{w}'s lambda_max is an earlier folder's stock run: {src}"
              for w, src in res.get("lambda_max_from", {}).items()]
    return "\n".join(lines) + "\n"


def figures(out_dir: str, res: dict, loads: list[str], table: dict, mat: dict) -> list[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot  # noqa: F401  (fig7, fig8)
    except ImportError:
        print("arms_report: matplotlib is not installed: no figures (pip install 'detent[bench]')")
        return []
    paths = fig7(out_dir, loads, table)
    wl = workload_of(res)
    if any(wl[ld] != w for w, row in mat.items() for ld in row):  # the diagonal alone is all 1.000
        paths.append(fig8(out_dir, loads, mat, wl))
    return paths


def fig7(out_dir: str, loads: list[str], table: dict) -> list[str]:
    """fig7.png (module docstring), when the folder holds stock and another arm."""
    import matplotlib.pyplot as plt
    if "stock" not in table:  # fig7 is ratios to stock's run
        print("arms_report: no stock arm in this folder: no fig7")
        return []
    arms = [a for a in table if a != "stock"]
    if not arms:  # stock alone: nothing to set over it yet
        print("arms_report: stock is the only arm in this folder: no fig7")
        return []
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4))
    width = 0.8 / max(len(arms), 1)
    for i, arm in enumerate(arms):
        ys = [table[arm][ld]["tpot_p50_ms"] / table["stock"][ld]["tpot_p50_ms"] if ld in table[arm] else 0
              for ld in loads]
        ax.bar([x + i * width for x in range(len(loads))], ys, width, label=arm)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([x + 0.4 - width / 2 for x in range(len(loads))], loads)
    ax.set_ylabel("p50 TPOT / stock")
    ax.set_title("(a) p50 latency per output token over stock")
    ax.legend(fontsize=8)
    if "pinned-tuned" in table:
        for j, p in enumerate((50, 90, 99)):
            m = f"tpot_p{p}_ms"
            ys = [table["pinned-tuned"][ld][m] / table["stock"][ld][m] if ld in table["pinned-tuned"] else 0
                  for ld in loads]
            bx.bar([x + j * 0.27 for x in range(len(loads))], ys, 0.27, label=f"p{p}")
        bx.axhline(1.0, color="k", lw=0.8)
        bx.set_xticks([x + 0.27 for x in range(len(loads))], loads)
        bx.legend(fontsize=8)
    bx.set_title("(b) tuned: TPOT over stock at p50, p90, p99")
    fig.tight_layout()
    path = os.path.join(out_dir, "fig7.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]


def fig8(out_dir: str, loads: list[str], mat: dict, wl: dict[str, str]) -> str:
    """fig8.png (module docstring): the drift matrix, with a cell off its diagonal."""
    import matplotlib.pyplot as plt
    rows = list(mat)
    grid = [[mat[w].get(ld, float("nan")) for ld in loads] for w in rows]
    fig, ax = plt.subplots(figsize=(1.1 * len(loads) + 2, 0.8 * len(rows) + 1.5))
    im = ax.imshow(grid, cmap="Reds", vmin=1.0)
    for i, w in enumerate(rows):
        for j, ld in enumerate(loads):
            ax.text(j, i, f"{grid[i][j]:.2f}", ha="center", va="center", fontsize=8)
            if wl[ld] == w:
                ax.add_patch(plt.Rectangle((j - 0.5, i - 0.5), 1, 1, fill=False, lw=2))
    ax.set_xticks(range(len(loads)), loads)
    ax.set_yticks(range(len(rows)), [f"tuple of {w}" for w in rows])
    ax.set_title("p50 TPOT over the column's own workload tuple")
    fig.colorbar(im, ax=ax)
    fig.tight_layout()
    path = os.path.join(out_dir, "fig8.png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def report(out_dir: str) -> dict:
    with open(os.path.join(out_dir, "arms.json")) as f:
        res = json.load(f)
    loads, table = arms_by_load(res)
    ratios = {arm: {m: geomean_ratio(table, arm, m) for m in METRICS} for arm in table if arm != "stock"}
    mat = drift(res, loads)
    tvd = tuned_vs_default(res, table)
    vs_vllm = against_vllm(table)
    text = markdown(res, loads, table, ratios, mat, tvd, vs_vllm)
    with open(os.path.join(out_dir, "arms.md"), "w") as f:
        f.write(text)
    summary = {"loads": loads, "geomean_ratio_to_stock": ratios, "drift": mat,
               "drift_paired": drift_paired(res, loads), "tuned_vs_default": tvd,
               "against_vllm": vs_vllm, "lambda_max": res["lambda_max"],
               "lambda_max_from": res.get("lambda_max_from", {})}
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(text)
    summary["figures"] = figures(out_dir, res, loads, table, mat)
    return summary
