"""The GEMM at a mixed step's row counts, on the GPU: whole rounds of the SMs (issue 16).

For Llama-3.1-8B's four projections and M from 1,024 to 2,304 rows, times
the Triton GEMM as the pinned selection runs it (rows past the last whole
round of wide tiles in a second launch, `selection/programs/gemm.py`
`wave_split`), the same GEMM in one launch (`split_m=0`), and cuBLAS
(`torch.nn.functional.linear`, stock), each replayed from a CUDA graph, and checks that the cut and the
single launch give equal bits (`torch.equal`).

    python3 benchmarks/gemm_waves.py --out $OUT/gemm_waves.json

`--sweep` times, at the whole-step graphs' token buckets (every 128 rows
from 384 to 2,048 by default), every prefill tile config in `SWEEP` (TMA
loads) in one launch beside the selection and cuBLAS, and checks each
config's bits against the selection's (`torch.equal`): the data for
`selection/programs/gemm.py`'s bucket table.

    python3 benchmarks/gemm_waves.py --sweep --out $OUT/gemm_sweep.json

`--data` times the selection and cuBLAS at a few M on operands drawn from
different distributions (`DATA`): the same shapes and kernels, other
values. On a power-limited GPU a GEMM's time can depend on its operands'
bits, and the side by side's servers run on different dummy weights (vLLM's
uniform in +-1e-3, Detent's N(0, 0.02)). Lease 14 (H200): within 0.7 % at
M = 64, 1,024 and 2,048, so they cost the same (docs/performance.md).

    python3 benchmarks/gemm_waves.py --data --out $OUT/gemm_data.json
"""
from __future__ import annotations

import argparse
import json
import os

import torch
import torch.nn.functional as F

from detent.kernels.gemm_triton import gemm_triton_persistent
from detent.selection.programs import gemm_triton_params

# (block_m, block_n, block_k, num_warps, num_stages, tma): tiles for M >= 384, compute-bound
SWEEP = ((128, 256, 64, 8, 3, 1), (128, 256, 64, 8, 4, 1), (128, 128, 64, 8, 4, 1), (128, 128, 64, 4, 4, 1),
         (128, 128, 128, 8, 3, 1), (256, 128, 64, 8, 3, 1), (128, 256, 128, 8, 2, 1), (64, 256, 64, 8, 4, 1),
         (128, 64, 128, 4, 4, 1), (64, 128, 128, 4, 4, 1), (256, 64, 64, 8, 3, 1), (64, 256, 128, 8, 3, 1))

# operand distributions: (weights, activations), each a function of (shape, generator) -> bf16 CUDA tensor
_U = lambda shape, g, a: (torch.rand(shape, device="cuda", generator=g) * 2 - 1).mul_(a).bfloat16()  # noqa: E731
_N = lambda shape, g, s: (torch.randn(shape, device="cuda", generator=g) * s).bfloat16()  # noqa: E731
DATA = {
    "detent-dummy": (lambda s, g: _N(s, g, 0.02), lambda s, g: _N(s, g, 1.0)),  # N(0, .02) weights, normed rows
    "vllm-dummy": (lambda s, g: _U(s, g, 1e-3), lambda s, g: _N(s, g, 1e-3)),  # U(+-1e-3) weights and norm gains
    "vllm-weights-only": (lambda s, g: _U(s, g, 1e-3), lambda s, g: _N(s, g, 1.0)),
}

SHAPES = {"qkv_proj": (6144, 4096), "o_proj": (4096, 4096), "gate_up_proj": (28672, 4096), "down_proj": (4096, 14336)}


@torch.inference_mode()
def main() -> None:
    import triton
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default=None, help="row counts (default: 1,024 .. 2,304 by 64; --sweep: 384 .. 2,048 by 128)")
    ap.add_argument("--sweep", action="store_true", help="time every SWEEP tile config at each M")
    ap.add_argument("--data", action="store_true", help="time the selection and cuBLAS on each DATA distribution")
    a = ap.parse_args()
    if a.sweep:
        return sweep(a)
    if a.data:
        return data(a)
    a.ms = a.ms or ",".join(str(m) for m in range(1024, 2305, 64))
    # CUDA-graph replays, as the piecewise graphs run them: device time without the host's launches
    # (lease 6 timed with do_bench, where two TMA launches at small M were host-bound)
    bench = lambda f: triton.testing.do_bench_cudagraph(f, rep=60, return_mode="median") * 1e3  # noqa: E731
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        for m in (int(x) for x in a.ms.split(",")):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            kw = gemm_triton_params(m, n)  # what the pinned program selects
            whole = {k_: v for k_, v in kw.items() if k_ != "split_m" and not k_.startswith("tail_")}
            row = {"gemm": name, "n": n, "k": k, "m": m, "split_m": kw.get("split_m", 0),
                   "us_selected": bench(lambda: gemm_triton_persistent(x, w, None, **kw)),
                   "us_one_launch": bench(lambda: gemm_triton_persistent(x, w, None, **whole)),
                   "us_cublas": bench(lambda: F.linear(x, w)),
                   "equal": bool(torch.equal(gemm_triton_persistent(x, w, None, **kw),
                                             gemm_triton_persistent(x, w, None, **whole)))}
            row["tflops_selected"] = 2 * m * n * k / row["us_selected"] / 1e6
            print(json.dumps({k_: round(v, 1) if isinstance(v, float) else v for k_, v in row.items()}), flush=True)
            rows.append(row)
    by_m = {}
    for r in rows:  # one layer's four GEMMs per M
        s = by_m.setdefault(r["m"], {"m": r["m"], "us_selected": 0.0, "us_one_launch": 0.0, "us_cublas": 0.0})
        for key in ("us_selected", "us_one_launch", "us_cublas"):
            s[key] += r[key]
    for s in by_m.values():
        print("layer", json.dumps({k_: round(v, 1) for k_, v in s.items()}), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "per_layer": list(by_m.values()),
                   "all_equal": all(r["equal"] for r in rows)}, f, indent=1)


def _bench(f) -> float:
    import triton
    return triton.testing.do_bench_cudagraph(f, rep=25, return_mode="median") * 1e3


@torch.inference_mode()
def sweep(a) -> None:
    ms = [int(x) for x in (a.ms or ",".join(str(m) for m in range(384, 2049, 128))).split(",")]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows, differ = [], []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * 0.02
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            kw = gemm_triton_params(m, n)
            ref = gemm_triton_persistent(x, w, None, **kw)
            row = {"gemm": name, "n": n, "k": k, "m": m, "selected": kw,
                   "us_selected": _bench(lambda: gemm_triton_persistent(x, w, None, **kw)),
                   "us_cublas": _bench(lambda: F.linear(x, w)), "us": {}}
            for cfg in SWEEP:
                one = dict(zip(("block_m", "block_n", "block_k", "num_warps", "num_stages", "tma"), cfg))
                try:
                    y = gemm_triton_persistent(x, w, None, **one)
                    row["us"][str(cfg)] = _bench(lambda: gemm_triton_persistent(x, w, None, **one))
                except Exception as e:  # noqa: BLE001  (a config that does not fit or compile)
                    row["us"][str(cfg)] = f"error: {type(e).__name__}: {str(e)[:120]}"
                    continue
                if not torch.equal(y, ref):
                    differ.append((name, m, str(cfg)))
            ok = {c: t for c, t in row["us"].items() if isinstance(t, float)}
            row["best"] = min(ok, key=ok.get)
            row["us_best"] = ok[row["best"]]
            print(f"{name:12s} M={m:5d} selected {row['us_selected']:7.1f} best {row['us_best']:7.1f} {row['best']} "
                  f"cublas {row['us_cublas']:7.1f}", flush=True)
            rows.append(row)
    per_m = {}
    for r in rows:
        s = per_m.setdefault(r["m"], {"m": r["m"], "us_selected": 0.0, "us_best": 0.0, "us_cublas": 0.0})
        for key in ("us_selected", "us_best", "us_cublas"):
            s[key] += r[key]
    for s in per_m.values():
        print("layer", json.dumps({k_: round(v, 1) for k_, v in s.items()}), flush=True)
    print("bits differ:", differ, flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "per_layer": list(per_m.values()),
                   "bits_differ": differ}, f, indent=1)


@torch.inference_mode()
def data(a) -> None:
    """Per M, one layer's four GEMMs (selection and cuBLAS) on each operand distribution, each timed
    for half a second of back-to-back replays (sustained, as under load: the clock settles)."""
    import triton
    ms = [int(x) for x in (a.ms or "64,1024,2048").split(",")]
    bench = lambda f: triton.testing.do_bench_cudagraph(f, rep=500, return_mode="median") * 1e3  # noqa: E731
    rows = []
    for dist, (wf, xf) in DATA.items():
        gen = torch.Generator(device="cuda").manual_seed(0)
        ws = {name: wf((n, k), gen) for name, (n, k) in SHAPES.items()}
        for m in ms:
            row = {"data": dist, "m": m, "us_selected": 0.0, "us_cublas": 0.0}
            for name, (n, k) in SHAPES.items():
                x, w = xf((m, k), gen), ws[name]
                kw = gemm_triton_params(m, n)
                row["us_selected"] += bench(lambda: gemm_triton_persistent(x, w, None, **kw))
                row["us_cublas"] += bench(lambda: F.linear(x, w))
            print(json.dumps({k_: round(v, 1) if isinstance(v, float) else v for k_, v in row.items()}), flush=True)
            rows.append(row)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "per_layer": rows}, f, indent=1)


if __name__ == "__main__":
    main()
