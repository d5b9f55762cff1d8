"""Top-p's mask on the GPU: the `top_p` family's two candidates, and the Triton
kernel's launches, timed per batch size: a launch per digit (`levels`: bits per
digit, blocks per chunk) and one program per row (`row`: bits per digit, block,
warps), on two spreads of logits (`--scales`: randn times 3, and times 8, a
peaked row whose nucleus is a few tokens).

Every configuration must give the torch reference's mask (`torch.equal`; a
configuration that does not is reported and not timed): the kernel's answer
depends on neither setting (kernels/nucleus_triton.py), so the fastest one can
become the default with no other check.

    python benchmarks/top_p_sweep.py --out $OUT/top_p.json
"""
from __future__ import annotations

import argparse
import itertools
import json

import torch

from detent.kernels import nucleus_triton as nt
from detent.kernels.nucleus import top_p_keep


def _time_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    ap = argparse.ArgumentParser("top_p_sweep")
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--batches", default="1,8,32,64,128,256")
    ap.add_argument("--digit-bits", default="2,3")
    ap.add_argument("--chunk-blocks", default="4")
    ap.add_argument("--row-blocks", default="1024,2048")
    ap.add_argument("--row-warps", default="8,16")
    ap.add_argument("--scales", default="3,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    ints = lambda s: [int(v) for v in s.split(",")]  # noqa: E731
    configs = [dict(LAUNCH="levels", DIGIT_BITS=d, CHUNK_BLOCKS=cb)
               for d, cb in itertools.product(ints(a.digit_bits), ints(a.chunk_blocks))]
    configs += [dict(LAUNCH="row", DIGIT_BITS=d, ROW_BLOCK=rb, ROW_WARPS=rw)
                for d, rb, rw in itertools.product(ints(a.digit_bits), ints(a.row_blocks), ints(a.row_warps))]
    configs.append(dict(LAUNCH="auto"))  # the default: a launch and digit width by the batch (nt.launch_for)
    default = {k: getattr(nt, k) for k in ("LAUNCH", "DIGIT_BITS", "CHUNK_BLOCKS", "ROW_BLOCK", "ROW_WARPS")}
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = ints(a.batches)
    x0 = torch.randn(max(batches), a.vocab, device="cuda", generator=g)
    top_p = torch.full((max(batches),), 0.9, device="cuda", dtype=torch.float64)
    rows = []
    for scale, b in itertools.product(ints(a.scales), batches):
        xb, pb = x0[:b] * scale, top_p[:b]  # scale 3: a Llama-like spread; 8: a few tokens hold 0.9
        want = top_p_keep(xb, pb)
        rows.append({"batch": b, "scale": scale, "impl": "torch_rowwise",
                     "ms": _time_ms(lambda: top_p_keep(xb, pb), a.reps)})
        for cfg in configs:
            for k, v in {**default, **cfg}.items():
                setattr(nt, k, v)
            row = {"batch": b, "scale": scale, "impl": "triton_rowwise", **cfg}
            row["equal"] = bool(torch.equal(nt.top_p_keep_triton(xb, pb), want))
            if row["equal"]:
                row["ms"] = _time_ms(lambda: nt.top_p_keep_triton(xb, pb), a.reps)
            rows.append(row)
            print(json.dumps(row), flush=True)
    for k, v in default.items():
        setattr(nt, k, v)
    for scale, b in itertools.product(ints(a.scales), batches):
        mine = [r for r in rows if r["batch"] == b and r["scale"] == scale]
        best = min((r for r in mine if "ms" in r), key=lambda r: r["ms"])
        ref = next(r for r in mine if r["impl"] == "torch_rowwise")
        cur = next((r for r in mine if all(r.get(k) == v for k, v in default.items() if k in r)
                    and r.get("LAUNCH") == default["LAUNCH"] and "ms" in r), None)
        print(f"scale {scale} batch {b}: torch {ref['ms']:.3f} ms; default "
              f"{cur['ms'] if cur else float('nan'):.3f} ms; fastest {best}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"vocab": a.vocab, "default": default, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
