"""SelIR costs (issue 2 targets): cold solve of the attention program <= 5 s,
JIT-cache hit <= 20 ms, repin <= 5 ms, one compiled selector call <= 3 us median.

    python benchmarks/selection.py [--json out.json]

A cold solve is one committed tuple's worth of work (docs/selir.md sections 2-3):
partial evaluation, lowering, cut, VRA of the pins' candidates, the default
assignment and its legality, and the compiled selector. Runs on CPU only
(solving needs no GPU); the GPU deployment is solved from its facts alone.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
import timeit

os.environ.setdefault("DETENT_SELIR_CACHE", tempfile.mkdtemp(prefix="selir-bench-"))

from detent.selection import programs, solve  # noqa: E402
from detent.selection.facts import default_facts_for, sites_for  # noqa: E402

SMOLLM2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536,
           "vocab_size": 49152}
LLAMA8B = {"hidden_size": 4096, "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 14336,
           "vocab_size": 128256}
DEPLOYMENTS = {
    "cpu/SmolLM2-135M": default_facts_for(SMOLLM2, max_context=8192),
    "H200/Llama-3.1-8B": default_facts_for(LLAMA8B, device="cuda", dtype="bfloat16", max_context=131072,
                                           num_sms=132, arch="sm90", triton=True),
}
RT = dict(num_tokens=37, num_seqs=5, max_seqlen_q=33, max_seqlen_k=1500, total_kv=4000, message_bytes=1 << 20)


def med(f, n: int, reps: int = 7) -> float:
    return statistics.median(timeit.repeat(f, number=n, repeat=reps)) / n


def bench(name: str, facts: dict) -> dict:
    prog = programs.load("attention")
    f = {**facts, **sites_for(facts, "attention")[0]}
    t = time.perf_counter()
    sol = solve(prog, f, cache=False)
    a = sol.default_assignment()
    sel = sol.compile(a)
    cold = time.perf_counter() - t
    solve(prog, f, memory=False).default_assignment()  # populate the disk cache (with VRA results)
    hits = []
    for _ in range(5):
        t = time.perf_counter()
        hot = solve(prog, f, memory=False)
        hot.compile(hot.default_assignment())
        hits.append(time.perf_counter() - t)
    assert hot.from_cache
    legal = sol.legal
    other = legal[len(legal) // 2]
    repins = []
    for _ in range(20):
        t = time.perf_counter()
        sol.repin(other)
        repins.append(time.perf_counter() - t)
    sel(**RT)
    call = med(lambda: sel(**RT), 20000)
    stock = sol.compile(mode="stock")
    stock(**RT)
    call_stock = med(lambda: stock(**RT), 20000)
    miss_rt = dict(RT)

    def miss():
        miss_rt["max_seqlen_k"] = miss_rt["max_seqlen_k"] % 8000 + 1
        stock(**miss_rt)
    call_miss = med(miss, 2000, 3)
    out = {"deployment": name, "graph_values": sol.graph.nodes, "pins": list(sol.pins),
           "candidates": {k: len(v) for k, v in sol.candidates.items()}, "legal": len(legal),
           "default": {k: v for k, v in a.items()}, "cold_solve_s": cold, "jit_hit_ms": statistics.median(hits) * 1e3,
           "repin_ms": statistics.median(repins) * 1e3, "selector_call_us": call * 1e6,
           "stock_selector_hit_us": call_stock * 1e6, "stock_selector_miss_us": call_miss * 1e6}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = [bench(n, f) for n, f in DEPLOYMENTS.items()]
    for r in rows:
        print(f"{r['deployment']}: attention graph {r['graph_values']} values, pins {r['pins']}, "
              f"candidates {r['candidates']}, {r['legal']} legal, default {r['default']}")
        print(f"  cold solve {r['cold_solve_s']:.3f} s (target 5 s) | JIT hit {r['jit_hit_ms']:.1f} ms (20 ms) | "
              f"repin {r['repin_ms']:.2f} ms (5 ms) | selector call {r['selector_call_us']:.2f} us median (3 us)")
        print(f"  stock selector: {r['stock_selector_hit_us']:.2f} us on a seen batch, "
              f"{r['stock_selector_miss_us']:.1f} us on a new one (checks + the whole heuristic)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
