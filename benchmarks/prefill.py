"""Prefill benchmark: tokens per second for one 2k and one 8k prompt (one
engine step each at max_num_batched_tokens=8192; eager, no CUDA graphs),
for the stock, pinned and conservative selections in one run.

    python benchmarks/prefill.py --model llama-3.1-8b --out prefill.json
    (benchmarks/decode.py --prefill runs the same sweep next to decode)
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_engine import build, set_mode  # noqa: E402

from detent.sampling.params import SamplingParams  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prefill_once(eng, prompt: list[int], rid: str) -> float:
    eng.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    _sync()
    t = time.perf_counter()
    while eng.has_unfinished_requests():
        eng.step()
    _sync()
    return time.perf_counter() - t


def prefill_sweep(llm, lens: list[int], vocab: int, reps: int = 3) -> dict:
    eng = llm.llm_engine
    g = torch.Generator().manual_seed(7)
    out = {}
    for n in lens:
        prompts = [torch.randint(1000, vocab - 1000, (n,), generator=g).tolist() for _ in range(reps + 1)]
        prefill_once(eng, prompts[0], f"warm-{n}")  # compiles, workspaces
        ts = [prefill_once(eng, p, f"p-{n}-{i}") for i, p in enumerate(prompts[1:])]
        med = statistics.median(ts)
        out[str(n)] = {"seconds": med, "tok_s": n / med, "all_s": ts}
        print(f"prefill {n:6d} tokens: {med * 1e3:8.1f} ms  {n / med:10.0f} tok/s", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--lens", default="2048,8192")
    ap.add_argument("--modes", default="stock,pinned,conservative")
    ap.add_argument("--out", default="prefill.json")
    a = ap.parse_args()
    lens = [int(n) for n in a.lens.split(",")]
    llm, mc, info = build(a.model, max_model_len=max(lens) + 16, max_num_seqs=8)
    res = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "info": info, "prefill": {}}
    for mode in a.modes.split(","):
        res.setdefault("modes", {})[mode] = set_mode(llm, mode, graphs=False)
        res["prefill"][mode] = prefill_sweep(llm, lens, mc.vocab_size)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
