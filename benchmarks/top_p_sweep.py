"""Top-p's mask on the GPU: the `top_p` family's two candidates, and the Triton
kernel's spread (bits per digit launch, blocks per chunk), timed per batch size.

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
    ap.add_argument("--digit-bits", default="2,3,5")
    ap.add_argument("--chunk-blocks", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    batches = [int(b) for b in a.batches.split(",")]
    x = torch.randn(max(batches), a.vocab, device="cuda", generator=g) * 3  # Llama-like spread of logits
    top_p = torch.full((max(batches),), 0.9, device="cuda", dtype=torch.float64)
    rows = []
    for b in batches:
        xb, pb = x[:b], top_p[:b]
        want = top_p_keep(xb, pb)
        rows.append({"batch": b, "impl": "torch_rowwise", "ms": _time_ms(lambda: top_p_keep(xb, pb), a.reps)})
        for d, cb in itertools.product(map(int, a.digit_bits.split(",")), map(int, a.chunk_blocks.split(","))):
            nt.DIGIT_BITS, nt.CHUNK_BLOCKS = d, cb
            row = {"batch": b, "impl": "triton_rowwise", "digit_bits": d, "chunk_blocks": cb}
            row["equal"] = bool(torch.equal(nt.top_p_keep_triton(xb, pb), want))
            if row["equal"]:
                row["ms"] = _time_ms(lambda: nt.top_p_keep_triton(xb, pb), a.reps)
            rows.append(row)
            print(json.dumps(row), flush=True)
    for b in batches:
        best = min((r for r in rows if r["batch"] == b and "ms" in r), key=lambda r: r["ms"])
        ref = next(r for r in rows if r["batch"] == b and r["impl"] == "torch_rowwise")
        print(f"batch {b}: torch {ref['ms']:.3f} ms; fastest {best}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"vocab": a.vocab, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
