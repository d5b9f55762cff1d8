"""DeepGEMM's bf16 GEMM on the GPU: does it run, how fast, and do rows follow M?

At prefill sizes (M = 512..8192) and Llama-3.1-8B's (N, K), this times cuBLAS
(torch, the stock choice), the Triton persistent matmul (the pinned choice)
and DeepGEMM on the real M (its own configuration) and on fixed-M chunks
(the `deepgemm` candidate). It also reports whether DeepGEMM's rows keep
their bits when M changes (`torch.equal` of the first rows). Set
DG_PRINT_CONFIGS=1 to see the configuration DeepGEMM picks for each shape.
Never run yet (docs/performance.md, "DeepGEMM (issue 19 item 3)").

    python benchmarks/deepgemm_probe.py --out deepgemm.json
"""
from __future__ import annotations

import argparse
import json

import torch
import triton

from detent.kernels import registry
from detent.kernels.gemm_triton import gemm_triton_persistent

BF16 = torch.bfloat16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
MS = (512, 2048, 2049, 8192)
TRITON = dict(block_m=128, block_n=256, block_k=64, num_warps=8, num_stages=3, tma=1)  # selection/programs/gemm.py WIDE


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="deepgemm.json")
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--num-sms", type=int, default=torch.cuda.get_device_properties(0).multi_processor_count)
    a = ap.parse_args()
    why = registry.why_unavailable("gemm", "deepgemm")
    if why:
        raise SystemExit(f"deepgemm is not registered: {why}")
    dg = registry.get("gemm", "deepgemm").fn
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
        x = torch.randn(max(MS), k, device="cuda", dtype=BF16)
        ref = dg(x, w, None, chunk=0, num_sms=a.num_sms)
        for m in MS:
            xm = x[:m]
            arms = {"cublas": lambda: torch.mm(xm, w.t()),
                    "triton_pinned": lambda: gemm_triton_persistent(xm, w, None, **TRITON),
                    "deepgemm_real_m": lambda: dg(xm, w, None, chunk=0, num_sms=a.num_sms),
                    "deepgemm_chunked": lambda: dg(xm, w, None, chunk=a.chunk, num_sms=a.num_sms)}
            row = {"gemm": name, "m": m, "n": n, "k": k}
            for arm, fn in arms.items():
                us = triton.testing.do_bench(fn, warmup=25, rep=100) * 1e3
                row[arm + "_us"] = round(us, 1)
                row[arm + "_tflops"] = round(2 * m * n * k / us / 1e6, 1)
            row["real_m_rows_equal_to_m8192"] = torch.equal(dg(xm, w, None, chunk=0, num_sms=a.num_sms), ref[:m])
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(a.out, "w") as f:
        json.dump({"chunk": a.chunk, "num_sms": a.num_sms, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
