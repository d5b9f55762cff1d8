"""Detent and vLLM side by side on one GPU: the same decode and prefill
measurement, the same invariance cells, the same prompts and the same
random-weights scale (issue 10).

    # vLLM 0.20.2 (installed on the device under /tmp/vsite from the peer bundle):
    PYTHONPATH=/tmp/vsite python3 benchmarks/compare_vllm.py --engine vllm --mode stock --out R.json
    PYTHONPATH=/tmp/vsite python3 benchmarks/compare_vllm.py --engine vllm --mode bi --out R.json
    # Detent, three selection modes over one weights load per part group:
    python3 benchmarks/compare_vllm.py --engine detent --modes stock,pinned,conservative --out R.json
    # table (markdown, printed) and bar chart (PNG) with ratios to vLLM stock:
    python3 benchmarks/compare_vllm.py --report --out R.json --png R.png

Parts (--parts, default all): `decode` — time per output token at batch
1, 8, 64 = (t(generate max_tokens=129) - t(generate max_tokens=1)) / 128 over
fresh 1,024-token random prompts, greedy, ignore_eos, logprobs=1 (vLLM's
peer bench.py, which used logprobs=None: `--decode-logprobs none`);
`prefill` — tokens/s of one 2k and one 8k prompt (max_tokens=1, after a
warm-up, median of 3); `cells` — cells.py's 15 invariance cells (prompt
lengths 300, 3000, 6000; the target alone cold vs a warm rerun, 63 short
neighbours, 7 long neighbours, a neighbour sharing half its prompt with the
target at row 1, one neighbour with the target at row 0), chosen tokens and
top-5 logprobs of 16 greedy tokens compared with ==. The measuring code is
benchmarks/common_side.py, run unchanged by both engines.

Each engine runs in its own process (vLLM cannot share the GPU with Detent):
this script starts benchmarks/vllm_side.py or benchmarks/detent_side.py once
per part group — `perf` (decode, prefill: max_num_batched_tokens 8192) and
`cells` (max_num_batched_tokens 2048, as cells.py) — and, for vLLM, once per
mode. Both engines run with prefix caching on (vLLM's default, and the warm
cell needs it); the perf prompts are all distinct, so they never hit it.

Weights: norms 1, matrices N(0, 0.02) on both sides. vLLM loads
load_format="dummy" (uniform +-1e-3: every layer vanishes under bf16
rounding) and is re-initialised with llm.apply_model as cells.py does, for
the timing runs too. Detent's load_format="dummy" (models/weights.init_dummy)
already draws norms 1, biases 0, matrices N(0, 0.02) (DUMMY_STD).

--out merges: results live under "runs", keyed "engine/mode/model/part";
a run replaces only its own keys. Each finished part is merged as soon as it
ends, so a command cut off at the device's time limit keeps what it finished.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import tempfile
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PARTS = ("decode", "prefill", "cells")
GROUPS = {"perf": ("decode", "prefill"), "cells": ("cells",)}
MODES = {"vllm": ("stock", "bi"), "detent": ("stock", "pinned", "conservative")}
# a tiny Llama for CPU runs of the Detent side (tests)
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "bos_token_id": 1,
        "eos_token_id": 2, "tie_word_embeddings": False, "torch_dtype": "float32"}


def preset_config(name: str) -> dict:
    """The HF config of a Detent preset, read from models/presets.py by path
    (the vLLM process must not import Detent)."""
    spec = importlib.util.spec_from_file_location("_detent_presets", os.path.join(ROOT, "models", "presets.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    p = mod.preset(name)
    if p is None:
        raise SystemExit(f"--model: unknown preset {name!r} (models/presets.py has {sorted(mod.PRESETS)})")
    return dict(p["config"])


# ------------------------------------------------------------------ results file
def load_results(path: str) -> dict:
    if not os.path.exists(path):
        return {"runs": {}}
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict) or not isinstance(data.get("runs"), dict):
        raise SystemExit(f"{path}: not a compare_vllm results file (no 'runs' object)")
    return data


def merge_entries(path: str, entries: dict) -> None:
    """Merge {key: entry} into the results file at `path` (atomic replace)."""
    data = load_results(path)
    data["runs"].update(entries)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def run_key(engine: str, mode: str, model: str, part: str) -> str:
    return f"{engine}/{mode}/{model}/{part}"


def record(spec: dict, mode: str, part: str, result: dict, meta: dict) -> None:
    """What a worker calls when a part is done: merge it into spec["out"]."""
    e = {"engine": spec["engine"], "mode": mode, "model": spec["model"], "part": part,
         "group": spec["group"], "engine_args": spec["engine_args"], "commit": spec.get("commit"),
         **({"detent_graphs": spec.get("graphs", "decode")} if spec["engine"] == "detent" else {}),
         "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **meta, **result}
    merge_entries(spec["out"], {run_key(spec["engine"], mode, spec["model"], part): e})


# ------------------------------------------------------------------ report
_ORDER = {("vllm", "stock"): 0, ("vllm", "bi"): 1, ("detent", "stock"): 2, ("detent", "pinned"): 3,
          ("detent", "conservative"): 4}
_NAMES = {"vllm": "vLLM", "detent": "Detent", "bi": "batch-inv."}


def _columns(runs: list[dict]) -> list[tuple[str, str]]:
    cols = {(r["engine"], r["mode"]) for r in runs}
    return sorted(cols, key=lambda c: (_ORDER.get(c, 9), c))


def _label(col: tuple[str, str]) -> str:
    return f"{_NAMES[col[0]]} {_NAMES.get(col[1], col[1])}"


def _table(head: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(head))) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def _timing_table(runs: dict, cols, part: str, sub: str, keys: list[str], value, unit: str, row_name: str) -> str:
    """Rows `keys`; per column the value and, where vLLM stock has one, the
    time ratio to it (> 1: slower than vLLM stock)."""
    base = runs.get(("vllm", "stock"))
    rows = []
    for k in keys:
        row = [k]
        for c in cols:
            r = runs.get(c, {}).get(sub, {}).get(k)
            if r is None:
                row.append("—")
                continue
            cell = f"{value(r):,.2f} {unit}" if unit == "ms" else f"{value(r):,.0f} {unit}"
            b = base and base.get(sub, {}).get(k)
            if b and c != ("vllm", "stock"):
                t, tb = (r["tpot_ms"], b["tpot_ms"]) if part == "decode" else (r["seconds"], b["seconds"])
                cell += f" ({t / tb:.2f}×)"
            row.append(cell)
        rows.append(row)
    return _table([row_name] + [_label(c) for c in cols], rows)


def report(data: dict, png: str) -> str:
    """Markdown tables per model (decode, prefill, cells) with time ratios to
    vLLM stock; writes the bar chart to `png`. Returns the markdown."""
    runs = list(data["runs"].values())
    models = sorted({r["model"] for r in runs})
    out, figs = [], []
    for model in models:
        mine = [r for r in runs if r["model"] == model]
        by = {p: {(r["engine"], r["mode"]): r for r in mine if r["part"] == p} for p in PARTS}
        out.append(f"## {model}\n")
        for part, field, value, unit, label, title in (
                ("decode", "batches", lambda r: r["tpot_ms"], "ms", "batch", "Decode, time per output token"),
                ("prefill", "lens", lambda r: r["tok_s"], "tok/s", "prompt tokens", "Prefill, one prompt")):
            if not by[part]:
                continue
            cols = _columns(list(by[part].values()))
            keys = sorted({k for r in by[part].values() for k in r[field]}, key=int)
            out += [f"{title} (ratio: time / vLLM stock's time)\n",
                    _timing_table(by[part], cols, part, field, keys, value, unit, label), ""]
            figs.append((model, part, cols, keys, by[part]))
        if by["cells"]:
            cols = _columns(list(by["cells"].values()))
            names = list(dict.fromkeys(k for r in by["cells"].values() for k in r["cells"]))
            rows = [[n] + [("pass" if by["cells"][c]["cells"][n]["pass"] else "FAIL")
                           if n in by["cells"][c]["cells"] else "—" for c in cols] for n in names]
            rows.append(["**passed**"] + [f"{by['cells'][c]['passed']}/{by['cells'][c]['total']}" for c in cols])
            out += ["Invariance cells (16 greedy tokens, chosen tokens and top-5 logprobs, ==)\n",
                    _table(["cell"] + [_label(c) for c in cols], rows), ""]
            figs.append((model, "cells", cols, None, by["cells"]))
    if figs:
        _plot(figs, png)
        out.append(f"chart: {png}")
    return "\n".join(out)


def _color(col: tuple[str, str]) -> str:
    return f"C{_ORDER.get(col, 5 + sum(map(ord, col[1])) % 5)}"


def _plot(figs: list, png: str) -> None:
    """One row per model, one panel per part; decode and prefill bars carry
    their time ratio to vLLM stock."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    models = list(dict.fromkeys(f[0] for f in figs))
    ncol = max(sum(f[0] == m for f in figs) for m in models)
    fig, axes = plt.subplots(len(models), ncol, figsize=(5.8 * ncol, 4.3 * len(models)), squeeze=False)
    used = {m: 0 for m in models}
    for model, part, cols, keys, by in figs:
        ax = axes[models.index(model)][used[model]]
        used[model] += 1
        if part == "cells":
            ax.bar(range(len(cols)), [by[c]["passed"] for c in cols], color=[_color(c) for c in cols])
            ax.set_xticks(range(len(cols)), [_label(c) for c in cols], rotation=20, fontsize=8)
            ax.set_ylim(0, max(by[c]["total"] for c in cols) + 0.5)
            ax.set_ylabel("cells passed (bitwise)")
        else:
            sub_key, val, t_key = (("batches", "tpot_ms", "tpot_ms") if part == "decode"
                                   else ("lens", "tok_s", "seconds"))
            base = by.get(("vllm", "stock"), {}).get(sub_key, {})
            w = 0.8 / len(cols)
            for i, c in enumerate(cols):
                sub = by[c][sub_key]
                xs = [j + i * w for j in range(len(keys))]
                ys = [sub[k][val] if k in sub else 0 for k in keys]
                ax.bar(xs, ys, w, label=_label(c), color=_color(c))
                for x, y, k in zip(xs, ys, keys):
                    if k in sub and k in base and c != ("vllm", "stock"):
                        ax.text(x, y, f"{sub[k][t_key] / base[k][t_key]:.2f}×", ha="center", va="bottom",
                                fontsize=7)
            ax.set_xticks([j + w * (len(cols) - 1) / 2 for j in range(len(keys))],
                          [f"batch {k}" if part == "decode" else f"{k} tokens" for k in keys])
            ax.set_ylabel("ms per output token" if part == "decode" else "prefill tokens / s")
            ax.legend(fontsize=7)
        ax.set_title(f"{model}: {part}" + (" (× = time / vLLM stock)" if part != "cells" else ""), fontsize=10)
    for m in models:
        for j in range(used[m], ncol):
            axes[models.index(m)][j].axis("off")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ orchestration
def _ints(s: str) -> list[int]:
    try:
        return [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"expected a comma-separated list of integers, got {s!r}")


def _commit() -> str | None:
    """HEAD, with "+dirty" when the tree differs from it (a copied working tree, e.g. the device's)."""
    try:
        git = dict(cwd=ROOT, capture_output=True, text=True, check=False, timeout=10)
        head = subprocess.run(["git", "rev-parse", "HEAD"], **git).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], **git).stdout.strip()
        return (head + ("+dirty" if dirty else "")) or None
    except (OSError, subprocess.SubprocessError):
        return None


def build_specs(a) -> list[dict]:
    """One worker spec per (mode for vLLM) x part group."""
    from common_side import cells_max_len, prompt_hi
    engine = a.engine
    modes = [m for m in (a.modes or ",".join(MODES[engine][:1] if engine == "vllm" else MODES[engine])).split(",")
             if m]
    for m in modes:
        if (m.split("+")[0] if engine == "detent" else m) not in MODES[engine]:
            raise SystemExit(f"--modes: {m!r} is not a {engine} mode (one of {', '.join(MODES[engine])})")
    parts = [p for p in a.parts.split(",") if p]
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise SystemExit(f"--parts: unknown {bad} (choose from {', '.join(PARTS)})")
    if a.tiny and engine == "vllm":
        raise SystemExit("--tiny runs Detent on CPU; vLLM runs only on the GPU at preset shapes")
    model = "tiny" if a.tiny else a.model
    hf = dict(TINY) if a.tiny else preset_config(a.model)
    hi = prompt_hi(hf["vocab_size"])
    batches, plens, clens, long_lens = (_ints(a.batches), _ints(a.prefill_lens), _ints(a.cell_lens),
                                        _ints(a.cell_long_lens))
    if len(long_lens) != 2:
        raise SystemExit(f"--cell-long-lens takes two lengths (the 3 and the 4 long neighbours), got {long_lens}")
    need = max(a.decode_ctx + a.decode_tokens + 1, max(plens) + 1, cells_max_len(clens, long_lens, 16))
    max_len = a.max_model_len or -(-need // 64) * 64
    if max_len < need or max_len > hf["max_position_embeddings"]:
        raise SystemExit(f"--max-model-len {max_len}: the workload needs >= {need} and the model allows "
                         f"<= {hf['max_position_embeddings']}")
    if a.decode_logprobs.lower() != "none" and not a.decode_logprobs.isdigit():
        raise SystemExit(f"--decode-logprobs: a number or 'none', got {a.decode_logprobs!r}")
    lp = None if a.decode_logprobs.lower() == "none" else int(a.decode_logprobs)
    common = {"engine": engine, "model": model, "hf_config": hf, "out": os.path.abspath(a.out), "commit": _commit(),
              "device": "cpu" if a.tiny else "cuda", "hi": hi, "graphs": a.detent_graphs,
              "perf": {"batches": batches, "ctx": a.decode_ctx, "new_tokens": a.decode_tokens, "logprobs": lp,
                       "prefill_lens": plens, "prefill_reps": a.prefill_reps},
              "cells": {"lens": clens, "long_lens": long_lens, "short_len": a.cell_short_len}}
    specs = []
    for group, gparts in GROUPS.items():
        want = [p for p in parts if p in gparts]
        if not want:
            continue
        args = {"max_model_len": max_len, "gpu_memory_utilization": a.gpu_memory_utilization,
                "enable_prefix_caching": group == "cells" or not a.no_prefix_caching,
                "max_num_batched_tokens": (a.max_num_batched_tokens if group == "perf"
                                           else a.cells_max_num_batched_tokens)}
        if a.block_size is not None:
            args["block_size"] = a.block_size
        if engine == "detent":
            args["max_num_seqs"] = max(batches) if group == "perf" else 64
            args["max_mixed_batched_tokens"] = a.max_mixed_batched_tokens or None
        for ms in ([[m] for m in modes] if engine == "vllm" else [modes]):
            specs.append({**common, "group": group, "parts": want, "modes": ms, "engine_args": dict(args)})
    return specs


def run_workers(specs: list[dict]) -> int:
    failed = []
    for s in specs:
        script = os.path.join(HERE, f"{s['engine']}_side.py")
        tag = f"{s['engine']} {','.join(s['modes'])} {s['model']} {s['group']} ({','.join(s['parts'])})"
        print(f"== {tag}", flush=True)
        t = time.time()
        # vLLM's workers start from a neutral directory: from the repository root, its model
        # inspection subprocess would import this repo's kernels/ folder as the 'kernels' package
        cwd = tempfile.gettempdir() if s["engine"] == "vllm" else None
        rc = subprocess.run([sys.executable, script, json.dumps(s)], check=False, cwd=cwd).returncode
        print(f"== {tag}: exit {rc} after {time.time() - t:.0f} s", flush=True)
        if rc:
            failed.append(tag)
    if failed:
        print("FAILED: " + "; ".join(failed), file=sys.stderr)
    return 1 if failed else 0


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=("vllm", "detent"))
    ap.add_argument("--modes", "--mode", dest="modes", default=None,
                    help="vllm: stock|bi (comma list: one process each); detent: stock,pinned,conservative "
                         "(optionally MODE+ENV=VAL); default vllm stock, detent all three")
    ap.add_argument("--model", default="llama-3.1-8b", help="llama-3.1-8b | qwen3-30b-a3b (any Detent preset)")
    ap.add_argument("--parts", default="decode,prefill,cells")
    ap.add_argument("--out", default="compare_vllm.json", help="results JSON (merged into if it exists)")
    ap.add_argument("--merge", nargs="*", default=[], metavar="JSON", help="merge these results files into --out")
    ap.add_argument("--report", action="store_true", help="print the markdown tables and write the PNG")
    ap.add_argument("--png", default=None, help="bar chart path (default: --out with .png)")
    ap.add_argument("--tiny", action="store_true", help="Detent on CPU with a tiny random Llama (tests)")
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--decode-ctx", type=int, default=1024)
    ap.add_argument("--decode-tokens", type=int, default=128, help="timed new tokens (the long call makes +1)")
    ap.add_argument("--decode-logprobs", default="1", help="logprobs of the decode calls: N or none")
    ap.add_argument("--prefill-lens", default="2048,8192")
    ap.add_argument("--prefill-reps", type=int, default=3)
    ap.add_argument("--cell-lens", default="300,3000,6000")
    ap.add_argument("--cell-long-lens", default="2000,1500")
    ap.add_argument("--cell-short-len", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192, help="decode and prefill runs")
    ap.add_argument("--cells-max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-mixed-batched-tokens", type=int, default=2048,
                    help="Detent: a step that carries decodes takes at most this many tokens (the engine's "
                         "default; 0: off, vLLM's one budget)")
    ap.add_argument("--detent-graphs", choices=("decode", "serving"), default="decode",
                    help="Detent's CUDA graphs: decode (decode graphs; steps with prompt rows eager: every run "
                         "up to lease 21) or serving (the decode, piecewise and whole-step graphs detent-serve "
                         "runs, beside vLLM's own defaults)")
    ap.add_argument("--block-size", type=int, default=None, help="tokens per KV-cache page, both engines "
                    "(default: each engine's own, 16)")
    ap.add_argument("--max-model-len", type=int, default=None, help="default: what the workload needs, to 64")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.88)
    ap.add_argument("--no-prefix-caching", action="store_true", help="decode/prefill runs without prefix caching")
    a = ap.parse_args(argv)
    if not (a.engine or a.report or a.merge):
        ap.error("give --engine to measure, --merge to merge, and/or --report")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.merge:
        for path in a.merge:
            merge_entries(a.out, load_results(path)["runs"])
    rc = 0
    if a.engine:
        sys.path.insert(0, HERE)
        rc = run_workers(build_specs(a))
    if a.report:
        print(report(load_results(a.out), a.png or os.path.splitext(a.out)[0] + ".png"))
    return rc


if __name__ == "__main__":
    sys.exit(main())
