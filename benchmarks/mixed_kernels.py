"""Where a mixed step's device time goes, kernel by kernel (issue 16).

Lease 10 measured a mixed step under load on the device: 1,909 tokens in
52 ms, 855 in 27 ms, 640 in 21 ms (docs/performance.md). This replays steps
of those sizes (Llama-3.1-8B shapes, pinned, through the piecewise CUDA
graphs the server replays) under torch.profiler and sums each kernel's device
time into families: GEMM, attention (prefill rows and decode rows launch
separately), norms, rotary, SiLU, the KV store, and the rest.

    python3 benchmarks/mixed_kernels.py --out $OUT/mixed_kernels.json [--only "r20 fresh,1024,26 dec"]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections import defaultdict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from detent.engine.piecewise_graph import enable_piecewise_graphs
from detent.engine.warmup import StepShape, _metadata
from detent.selection.context import ForwardContext, forward_context
from gpu_engine import build, set_mode
from kernel_families import family

CTX = 1100  # the decodes' context


def steps() -> list[tuple[str, StepShape]]:
    """Sizes seen under load (lease 10's device counters; lease 17's on fresh prompts, where a
    mixed step of 1,064 tokens took 30.9 ms and the 1,024-token prefill step 22.0) and their
    parts alone."""
    d = lambda n: ((1,) * n, (CTX,) * n)
    out = []
    for name, chunks, n in (("r20 fresh: 1038 prompt + 26 decodes", (1038,), 26),
                            ("1024 prompt alone", (1024,), 0),
                            ("26 decodes alone", (), 26),
                            ("r80 fresh: 1024+105 prompt + 40 decodes", (1024, 105), 40),
                            ("c128: 1024+780 prompt + 105 decodes", (1024, 780), 105),
                            ("r80: 750 prompt + 105 decodes", (750,), 105),
                            ("r20: 620 prompt + 20 decodes", (620,), 20),
                            ("1804 prompt alone", (1024, 780), 0),
                            ("750 prompt alone", (750,), 0),
                            ("620 prompt alone", (620,), 0),
                            ("105 decodes alone", (), 105),
                            ("20 decodes alone", (), 20)):
        q, k = d(n)
        out.append((name, StepShape(tuple(chunks) + q, tuple(chunks) + k)))
    return out


def attention_launches(prof, reps: int) -> list[list]:
    """Attention device time per launch shape (kernel, grid, block): a mixed step's prompt
    tiles, its decode rows' short launch and the combine kernel are one kernel name but
    different grids (kernels/attention_triton.py)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as fh:
        prof.export_chrome_trace(fh.name)
        with open(fh.name) as f:
            trace = json.load(f)
    by: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for ev in trace.get("traceEvents", []):
        if ev.get("cat") != "kernel" or family(ev.get("name", "")) != "attention":
            continue
        args = ev.get("args", {})
        key = f"{ev['name'][:40]} grid={tuple(args.get('grid', ()))} block={tuple(args.get('block', ()))}"
        by[key][0] += ev.get("dur", 0.0)
        by[key][1] += 1
    return sorted(([k, round(us / reps / 1e3, 3), n // reps] for k, (us, n) in by.items()), key=lambda t: -t[1])


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    ap.add_argument("--only", default="", help="comma-separated step-name prefixes")
    a = ap.parse_args()
    only = [x for x in a.only.split(",") if x]
    from torch.profiler import ProfilerActivity, profile

    llm, mc, info = build(a.model, max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=2048)
    set_mode(llm, "pinned", graphs=True)
    runner = llm.llm_engine.runner
    g = enable_piecewise_graphs(runner, max_tokens=2048)
    assert g.disabled is None, g.disabled
    nb = runner.kv_caches[0].shape[1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, shape in steps():
        if only and not any(name.startswith(o) for o in only):
            continue
        meta, pos = _metadata(shape, runner.block_size, nb, runner.device)
        ids = torch.randint(10, mc.vocab_size, (shape.num_tokens,), device="cuda", generator=gen)

        def step(meta=meta, ids=ids, pos=pos):
            c = ForwardContext(attn=meta, kv_caches=runner.kv_caches, dispatcher=runner.dispatcher)
            with forward_context(c):
                return runner._forward(ids, pos, c)
        for _ in range(3):
            step()
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        ev[0].record()
        for _ in range(a.reps):
            step()
        ev[1].record()
        torch.cuda.synchronize()
        span = ev[0].elapsed_time(ev[1]) / a.reps
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(a.reps):
                step()
            torch.cuda.synchronize()
        fam: dict[str, float] = defaultdict(float)
        top = []
        for e in prof.key_averages():
            if e.device_type != torch.autograd.DeviceType.CUDA or e.self_device_time_total <= 0:
                continue
            ms = e.self_device_time_total / a.reps / 1e3
            fam[family(e.key)] += ms
            top.append((e.key[:90], round(ms, 3), e.count // a.reps))
        top.sort(key=lambda t: -t[1])
        launches = attention_launches(prof, a.reps)
        row = {"step": name, "tokens": shape.num_tokens, "span_ms": round(span, 3),
               "kernel_ms": round(sum(fam.values()), 3),
               "families_ms": {k: round(v, 3) for k, v in sorted(fam.items(), key=lambda kv: -kv[1])},
               "attention_launches": launches, "top_kernels": top[:15]}
        print(json.dumps({k: v for k, v in row.items() if k != "top_kernels"}), flush=True)
        rows.append(row)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump({"model": a.model, "info": info, "device": torch.cuda.get_device_name(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
