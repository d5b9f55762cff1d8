"""Prefill benchmark: tokens per second for one 2k and one 8k prompt (one
engine step each at max_num_batched_tokens=8192; eager, no CUDA graphs, or
with `--graphs serving` the graphs detent-serve runs: gpu_engine.set_mode),
for the stock, pinned and conservative selections in one run.

    python benchmarks/prefill.py --model llama-3.1-8b --out prefill.json
    python benchmarks/prefill.py --model llama-3.1-8b --modes pinned --attention fa4 --out fa4.json
      (FlashAttention-4 for every step: mode "pinned+attention.impl=fa4", the
      tuple's knob; needs the fa4 extra)
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


def profile_prefill(llm, lens: list[int], vocab: int, tag: str, out_dir: str) -> dict:
    """torch.profiler's kernel times over one more prefill of each length: the
    full table to out_dir/<tag>_<n>.txt, the top kernels returned."""
    from torch.profiler import ProfilerActivity, profile
    g = torch.Generator().manual_seed(11)
    out = {}
    for n in lens:
        prompt = torch.randint(1000, vocab - 1000, (n,), generator=g).tolist()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            prefill_once(llm.llm_engine, prompt, f"prof-{n}")
        ev = sorted((e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA),
                    key=lambda e: -e.self_device_time_total)
        name = "".join(c if c.isalnum() or c in "-_=" else "_" for c in f"{tag}_{n}")
        with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
            f.write(prof.key_averages().table(sort_by="self_device_time_total", row_limit=40))
        out[str(n)] = {"kernel_ms": sum(e.self_device_time_total for e in ev) / 1e3,
                       "top": [(e.key[:90], e.self_device_time_total / 1e3, e.count) for e in ev[:12]]}
        print(f"  {tag} {n}: kernels {out[str(n)]['kernel_ms']:.1f} ms", flush=True)
        for k, ms, c in out[str(n)]["top"]:
            print(f"    {ms:8.2f} ms x{c:5d}  {k}", flush=True)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--lens", default="2048,8192")
    ap.add_argument("--modes", default="stock,pinned,conservative")
    ap.add_argument("--out", default="prefill.json")
    ap.add_argument("--profile", default=None, metavar="DIR", help="also profile one prefill per length into DIR")
    ap.add_argument("--attention", choices=("triton_paged", "fa4"), default="triton_paged",
                    help="the attention implementation (tuple knob attention.impl); fa4 runs in mode pinned only")
    ap.add_argument("--graphs", choices=("none", "serving"), default="none",
                    help="none: every step eager (as up to lease 21); serving: detent-serve's graphs (whole-step "
                         "graphs for steps up to --mixed-graph-max-tokens, piecewise graphs above)")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache page (FA4 reads pages "
                    "through TMA when a page is its 128-key tile)")
    a = ap.parse_args()
    lens = [int(n) for n in a.lens.split(",")]
    llm, mc, info = build(a.model, max_model_len=max(lens) + 16, max_num_seqs=8, block_size=a.block_size)
    res = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "info": info, "prefill": {}}
    modes = a.modes.split(",")
    if a.attention != "triton_paged":
        modes = [f"{m}+attention.impl={a.attention}" for m in modes]
    for mode in modes:
        res.setdefault("modes", {})[mode] = set_mode(llm, mode, graphs=a.graphs if a.graphs == "serving" else False)
        res["prefill"][mode] = prefill_sweep(llm, lens, mc.vocab_size)
        if a.profile:
            os.makedirs(a.profile, exist_ok=True)
            res.setdefault("profile", {})[mode] = profile_prefill(llm, lens, mc.vocab_size, mode, a.profile)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
