"""Steps that carry prefill tokens, on the GPU: where their device time goes (issue 16).

Under load most of the device's time is spent in steps that mix a prompt's
chunk with the running requests' decodes (docs/performance.md, "Serving
under load"). For synthetic steps of that kind (prompts of 1,024 tokens, N
decodes at 1,100-token contexts, Llama-3.1-8B shapes, pinned) this measures:

- one layer's attention, with the decodes inside the long chunk's 128-row
  tiles (`short_launch=0`) and in their own 16-row launch (the default);
- the whole step through the piecewise CUDA graphs (CUDA events around the
  replay, median of 10): at the bucket it replays now, at the bucket the
  powers-of-two ladder gave it before (the padding's cost), and with
  `short_launch=0`; and, for steps above 2,048 tokens, eagerly;
- the same steps with every GEMM in one launch (`split_m=0`: no cut where
  the wide tiles fill whole rounds of the SMs, `benchmarks/gemm_waves.py`);
- that the step's hidden states are equal (`torch.equal`) with and without
  the short launch and at either bucket (rows never see padding or tiles);
- small steps with prompt tokens (16 … 480 prompt tokens beside decodes)
  through the pieces and through one whole-step graph (engine/mixed_graph.py),
  with their hidden states compared (`torch.equal`);
- `--mixed-token-align 1024` offline: a prompt with N decodes as one
  1,024 + N-token step followed by a decode-only step (CUDA graph), against
  the aligned pair the scheduler makes instead, a (1,024 - N) + N step and
  then N prompt tokens beside the N decodes.

    python3 benchmarks/mixed_step.py --out $OUT/mixed_step.json
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

from detent.engine.piecewise_graph import PiecewiseGraphRunner, enable_piecewise_graphs  # noqa: E402
from detent.engine.warmup import StepShape, _metadata  # noqa: E402
from detent.selection.context import ForwardContext, forward_context  # noqa: E402
from detent.selection.dispatch import Dispatcher  # noqa: E402
from detent.selection.provider import FamilyOverride  # noqa: E402

CTX = 1100  # the decodes' context


def old_bucket(t: int) -> int:
    """The powers-of-two-and-1.5x ladder the pieces were captured at before."""
    b = 16
    while True:
        for x in (b, b * 3 // 2):
            if x >= t:
                return x
        b *= 2


def shapes(max_tokens: int) -> list[tuple[str, StepShape]]:
    out = []
    for n in (0, 1, 16, 32, 64, 128):
        out.append((f"1024+{n}d", StepShape((1024,) + (1,) * n, (1024,) + (CTX,) * n)))
    out.append(("1024+960+64d", StepShape((1024, 960) + (1,) * 64, (1024, 960) + (CTX,) * 64)))
    if max_tokens >= 4096:
        out.append(("4x1024", StepShape((1024,) * 4, (1024,) * 4)))
    return out


def timed(fn, reps: int = 10) -> tuple[float, float]:
    """(median device ms between CUDA events, median host ms to launch)."""
    dev, host = [], []
    for _ in range(reps + 2):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        a.record()
        fn()
        b.record()
        host.append((time.perf_counter() - t0) * 1e3)
        torch.cuda.synchronize()
        dev.append(a.elapsed_time(b))
    return statistics.median(dev[2:]), statistics.median(host[2:])


@torch.inference_mode()
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--max-tokens", type=int, default=4096, help="largest piecewise bucket")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    import triton

    llm, mc, info = build(a.model, max_model_len=4096, max_num_seqs=256, max_num_batched_tokens=a.max_tokens)
    set_mode(llm, "pinned", graphs=True)  # decode graphs, then the pieces behind them
    eng = llm.llm_engine
    runner = eng.runner
    eager = runner._eager_forward
    t0 = time.time()
    g = enable_piecewise_graphs(runner, max_tokens=a.max_tokens)
    capture_s = time.time() - t0
    assert g.disabled is None, g.disabled
    pinned = runner.dispatcher
    no_short = Dispatcher(FamilyOverride(pinned.provider, "attention", extra={"short_launch": False}))
    # the same pieces with every GEMM in one launch (no cut at a whole round of the SMs)
    no_split = PiecewiseGraphRunner(runner.model, runner.kv_caches, runner.block_size,
                                    Dispatcher(FamilyOverride(pinned.provider, "gemm", extra={"split_m": 0})),
                                    runner.device, buckets=[b for b in g.buckets if b > 1024]).capture()
    f = eng.facts
    site = (("num_heads", f["num_heads"]), ("num_kv_heads", f["num_kv_heads"]), ("head_dim", f["head_dim"]),
            ("block_size", f["page_size"]), ("dtype", f["dtype"]))
    nb = runner.kv_caches[0].shape[1]
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, shape in shapes(a.max_tokens):
        meta, pos = _metadata(shape, runner.block_size, nb, runner.device)
        t = shape.num_tokens
        ids = torch.randint(10, mc.vocab_size, (t,), device="cuda", generator=gen)
        row = {"step": name, "tokens": t, "decodes": sum(1 for q in shape.query_lens if q == 1)}

        # one layer's attention, both launches
        ctx = ForwardContext(attn=meta, kv_caches=runner.kv_caches, dispatcher=pinned)
        with forward_context(ctx):
            fn, kw = pinned.resolve("attention", site, ctx.runtime(t))
        h, kvh, d = f["num_heads"], f["num_kv_heads"], f["head_dim"]
        q = torch.randn(t, h, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        k = torch.randn(t, kvh, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        v = torch.randn(t, kvh, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        cache = runner.kv_caches[0]
        for flag in (True, False):
            us = triton.testing.do_bench(lambda: fn(q, k, v, cache, meta, d ** -0.5, **kw, short_launch=flag),
                                         warmup=5, rep=40, return_mode="median") * 1e3
            row[f"attention_us_short_launch_{int(flag)}"] = round(us, 1)
        row["attention_selection"] = {k_: v_ for k_, v_ in kw.items()}
        # do_bench above times the host's launches too when they outlast the kernels; a CUDA
        # graph of 20 calls gives the device time alone
        try:
            for flag in (True, False):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(20):
                        fn(q, k, v, cache, meta, d ** -0.5, **kw, short_launch=flag)
                ms, _ = timed(graph.replay, reps=5)
                row[f"attention_device_us_short_launch_{int(flag)}"] = round(ms * 1e3 / 20, 1)
        except Exception as e:  # noqa: BLE001  (a host read inside the call: no graph)
            row["attention_device_us_error"] = f"{type(e).__name__}: {e}"[:200]
        a1 = fn(q, k, v, cache, meta, d ** -0.5, **kw, short_launch=True)
        a0 = fn(q, k, v, cache, meta, d ** -0.5, **kw, short_launch=False)
        row["attention_equal"] = bool(torch.equal(a1, a0))

        # the whole step
        def step(disp, bucket=None, eager_run=False, pieces=g):
            c = ForwardContext(attn=meta, kv_caches=runner.kv_caches, dispatcher=disp)
            with forward_context(c):
                if eager_run:
                    return eager(ids, pos, c)
                if pieces is not g:
                    return pieces.run(ids, pos, c)
                if bucket is None:
                    return g.run(ids, pos, c)
                keep = g.bucket_for
                g.bucket_for = lambda _t: bucket
                try:
                    return g.run(ids, pos, c)
                finally:
                    g.bucket_for = keep
        new_b, old_b = g.bucket_for(t), old_bucket(t)
        row["bucket_now"], row["bucket_before"] = new_b, old_b
        ref = step(pinned).clone()
        row["step_ms"], row["step_host_ms"] = timed(lambda: step(pinned))
        row["step_ms_short_launch_0"], _ = timed(lambda: step(no_short))
        same = [torch.equal(ref, step(no_short))]
        if new_b in no_split.buckets:
            row["step_ms_gemm_one_launch"], _ = timed(lambda: step(pinned, pieces=no_split))
            same.append(torch.equal(ref, step(pinned, pieces=no_split)))
        if old_b in g.buckets and old_b != new_b:
            row["step_ms_bucket_before"], _ = timed(lambda: step(pinned, old_b))
            same.append(torch.equal(ref, step(pinned, old_b)))
        if t > 2048:
            row["step_ms_eager"], row["step_host_ms_eager"] = timed(lambda: step(pinned, eager_run=True), reps=4)
            same.append(torch.equal(ref, step(pinned, eager_run=True)))
        row["hidden_equal"] = all(same)
        print(json.dumps(row), flush=True)
        rows.append(row)
    # whole-step graphs (engine/mixed_graph.py) for the small steps below: the aligned pairs'
    # second steps and the small mixed steps
    from detent.engine.mixed_graph import MixedGraphRunner, graph_pairs
    t0 = time.time()
    whole = MixedGraphRunner(runner.model, runner.kv_caches, runner.block_size, pinned, runner.device,
                             max_model_len=4096, pairs=graph_pairs(512, 256, a.max_tokens),
                             attention_site=site).capture()
    whole_capture_s = time.time() - t0
    aligned = []
    for n in (16, 32, 64, 128):
        pair = {}
        for name, shape in (("untrimmed", StepShape((1024,) + (1,) * n, (1024,) + (CTX,) * n)),
                            ("untrimmed_next", StepShape((1,) * n, (CTX + 1,) * n)),
                            ("aligned", StepShape((1024 - n,) + (1,) * n, (1024 - n,) + (CTX,) * n)),
                            ("aligned_next", StepShape((n,) + (1,) * n, (1024,) + (CTX + 1,) * n))):
            meta, pos = _metadata(shape, runner.block_size, nb, runner.device)
            ids = torch.randint(10, mc.vocab_size, (shape.num_tokens,), device="cuda", generator=gen)

            def fwd(through=None):
                c = ForwardContext(attn=meta, kv_caches=runner.kv_caches, dispatcher=pinned)
                with forward_context(c):
                    return runner._forward(ids, pos, c) if through is None else through.run(ids, pos, c)
            pair[name + "_ms"], pair[name + "_host_ms"] = timed(fwd)
            if name == "aligned_next" and whole.disabled is None and whole.graph_for(meta) is not None:
                # the aligned pair's small second step through one whole-step graph
                pair["aligned_next_whole_ms"], pair["aligned_next_whole_host_ms"] = timed(lambda: fwd(whole))
                pair["aligned_next_whole_equal"] = bool(torch.equal(fwd().clone(), fwd(whole)))
        pair["decodes"] = n
        pair["untrimmed_total_ms"] = pair["untrimmed_ms"] + pair["untrimmed_next_ms"]
        pair["aligned_total_ms"] = pair["aligned_ms"] + pair["aligned_next_ms"]
        if "aligned_next_whole_ms" in pair:
            pair["aligned_total_whole_ms"] = pair["aligned_ms"] + pair["aligned_next_whole_ms"]
        print(json.dumps(pair), flush=True)
        aligned.append(pair)
    small = []
    for p_tok, n_dec in ((16, 16), (32, 32), (64, 64), (100, 100), (200, 56), (480, 32)):
        shape = StepShape((p_tok,) + (1,) * n_dec, (1024,) + (CTX,) * n_dec)
        meta, pos = _metadata(shape, runner.block_size, nb, runner.device)
        ids = torch.randint(10, mc.vocab_size, (shape.num_tokens,), device="cuda", generator=gen)
        row = {"prompt_tokens": p_tok, "decodes": n_dec, "tokens": shape.num_tokens}

        def via(pieces):
            c = ForwardContext(attn=meta, kv_caches=runner.kv_caches, dispatcher=pinned)
            with forward_context(c):
                return pieces.run(ids, pos, c)
        ref = via(g).clone()
        row["piecewise_ms"], row["piecewise_host_ms"] = timed(lambda: via(g))
        if whole.disabled is None and whole.graph_for(meta) is not None:
            row["whole_graph_ms"], row["whole_graph_host_ms"] = timed(lambda: via(whole))
            row["hidden_equal"] = bool(torch.equal(ref, via(whole)))
        else:
            row["whole_graph"] = whole.disabled or "no graph for this step"
        print(json.dumps(row), flush=True)
        small.append(row)
    out = {"model": a.model, "info": info, "piecewise_capture_s": capture_s, "buckets": g.buckets,
           "whole_graphs": len(whole.graphs), "whole_graph_capture_s": whole_capture_s, "small_steps": small,
           "device": torch.cuda.get_device_name(), "rows": rows, "mixed_token_align_1024": aligned}
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
