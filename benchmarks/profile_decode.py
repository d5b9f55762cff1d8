"""Where a decode step's time goes on the GPU (issue 10, item 3).

For each mode and batch size: prefill `batch` prompts of `ctx` tokens, then
profile decode steps two ways — torch.profiler (GPU kernel time per step
against the step's wall time: the gap is host work the GPU waits for) and
cProfile (which Python functions the host time is spent in).

    python3 benchmarks/profile_decode.py --modes pinned,stock --batches 1,64 --out $OUT/profile
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import prompts  # noqa: E402
from gpu_engine import build, set_mode  # noqa: E402

from detent.sampling.params import SamplingParams  # noqa: E402


def start_batch(eng, batch: int, ctx: int, vocab: int, tag: str, steps: int) -> list[str]:
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 64 + batch * ctx // 8192, ignore_eos=True, logprobs=1)
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for rid, p in zip(ids, prompts(batch, ctx, vocab, 7 + batch)):
        eng.add_request(rid, p, sp)
    seen: set[str] = set()
    while len(seen) < batch:  # prefill until every request has its first token
        for o in eng.step():
            if o.outputs[0].token_ids:
                seen.add(o.request_id)
    for _ in range(4):  # warm decode steps
        eng.step()
    torch.cuda.synchronize()
    return ids


def profile_batch(eng, batch: int, ctx: int, vocab: int, tag: str, steps: int, out_dir: str) -> dict:
    ids = start_batch(eng, batch, ctx, vocab, tag, 3 * steps)
    wall = []
    for _ in range(steps):  # plain timing, as benchmarks/decode.py
        t = time.perf_counter()
        eng.step()
        wall.append(time.perf_counter() - t)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            eng.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    dev_us = sum(e.self_device_time_total for e in kernels)
    table = events.table(sort_by="self_device_time_total", row_limit=25)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        eng.step()
    torch.cuda.synchronize()
    pr.disable()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(30)
    name = f"{tag}_b{batch}"
    with open(os.path.join(out_dir, f"{name}.txt"), "w") as f:
        f.write(f"# {name}: torch.profiler, {steps} steps, sorted by device time\n{table}\n")
        f.write(f"# {name}: cProfile, {steps} steps, cumulative\n{s.getvalue()}\n")
    eng.abort_request(ids)
    while eng.has_unfinished_requests():
        eng.step()
    return {"wall_ms_median": statistics.median(wall) * 1e3,
            "gpu_kernel_ms_per_step": dev_us / steps / 1e3,
            "top_kernels_ms_per_step": [(e.key[:80], e.self_device_time_total / steps / 1e3)
                                        for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:8]]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--modes", default="pinned,stock")
    ap.add_argument("--batches", default="1,64")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--out", default="profile")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    batches = [int(b) for b in a.batches.split(",")]
    llm, mc, info = build(a.model, max_model_len=a.ctx + 4 * a.steps + 128, max_num_seqs=max(batches))
    res = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "modes": {}}
    for mode in a.modes.split(","):
        res["modes"][mode] = {"setup": set_mode(llm, mode, graphs=True, capture_sizes=batches)}
        for b in batches:
            r = profile_batch(llm.llm_engine, b, a.ctx, mc.vocab_size, mode, a.steps, a.out)
            res["modes"][mode][str(b)] = r
            print(f"{mode:8s} batch {b:3d}: step {r['wall_ms_median']:.2f} ms, GPU kernels "
                  f"{r['gpu_kernel_ms_per_step']:.2f} ms/step; top: "
                  + "; ".join(f"{k[:40]} {v:.3f}" for k, v in r["top_kernels_ms_per_step"][:4]), flush=True)
    with open(os.path.join(a.out, "profile.json"), "w") as f:
        json.dump(res, f, indent=1, default=str)


if __name__ == "__main__":
    main()
