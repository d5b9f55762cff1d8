"""Tensor-parallel decode benchmark: time per output token at batch 1, 8, 64
with 1k-token contexts, for the stock, pinned and conservative selections in
ONE run (one load of the weights: each rank swaps its dispatcher and
recaptures its decode graphs), dummy weights at a preset's real shapes.

    # on nvidia-h200-x2 (Llama-3.1-70B bf16 is ~71 GB of weights per GPU at tp=2)
    python benchmarks/tp_decode.py --model llama-3.1-70b --tp 2 --out tp_decode.json --md docs/performance.md
    # if 70B does not fit: --model llama-3.1-8b

Time per output token = median wall time of an engine step over `--steps`
decode-only steps (driver schedule + plan to the ranks + graph replay on
every rank + sampling on every rank + rank 0's output back + output
processing). Also per mode: the selection source, CUDA-graph status, and one
invariance cell (request 0 alone vs. in the largest batch: tokens and
logprobs equal?). `--allreduce pinned=one_shot` overrides one mode's
all-reduce candidate (e.g. to time the symmetric-memory kernels).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decode import decode_batch  # noqa: E402

COPY_BW = 4.23e12  # H200 copy bandwidth, measured (docs/performance.md)


def rank_set_mode(st, mode: str, graphs: bool, capture_sizes: list[int], max_num_seqs: int,
                  allreduce: str | None) -> dict:
    """Runs on every rank (TPExecutor.collective_rpc): install `mode`'s GPU
    selection (SelIR's, selection/programs), then recapture the decode graphs."""
    import torch

    from detent.selection import make_dispatcher
    from detent.selection.dispatch import Dispatcher
    from detent.selection.provider import FamilyOverride
    f = st.info.facts
    d, source = make_dispatcher(f, mode, None), "selection (SelIR)"
    if f["device"] != "cuda":  # CPU smoke run of this script: the project's selection as is
        st.runner.dispatcher = d
        return {"mode": mode, "selection_source": source, "cuda_graphs": "eager (CPU)"}
    site = {"num_heads": f["num_heads"], "num_kv_heads": f["num_kv_heads"],  # per rank
            "head_dim": f["head_dim"], "block_size": f["page_size"], "dtype": f["dtype"]}
    try:
        sel = d.provider.selector("attention", site)(num_tokens=1, num_seqs=1, max_seqlen_q=1, max_seqlen_k=1,
                                                      total_kv=1)
    except Exception:  # noqa: BLE001
        sel = {}
    if sel.get("impl") != "triton_paged":
        raise RuntimeError(f"SelIR selected {sel} for attention on CUDA: is triton importable? facts={f}")
    if allreduce:
        d = Dispatcher(FamilyOverride(d.provider, "allreduce", {"impl": allreduce}))
        source += f" + allreduce={allreduce}"
    st.runner.dispatcher = d
    out = {"mode": mode, "selection_source": source}
    runner = st.runner
    if graphs:
        from detent.engine.cuda_graph import enable_cuda_graphs
        t0 = time.time()
        g = enable_cuda_graphs(runner, max_num_seqs=max_num_seqs, max_model_len=st.info.max_model_len,
                               capture_sizes=capture_sizes)
        out["graph_capture_s"] = round(time.time() - t0, 1)
        out["cuda_graphs"] = g.disabled or f"captured {sorted(g.graphs)}"
    elif getattr(runner, "_eager_forward", None) is not None:
        runner._forward = runner._eager_forward
    torch.cuda.synchronize()
    return out


def rank_memory(st) -> dict:
    import torch
    w = sum(p.numel() * p.element_size() for p in st.runner.model.parameters())
    kv = sum(t.numel() * t.element_size() for t in st.runner.kv_caches)
    cuda = st.info.device.startswith("cuda")
    return {"dtype": st.info.dtype, "weight_bytes": w, "kv_pool_bytes": kv,
            "kv_bytes_per_token": kv // (st.info.num_blocks * st.runner.block_size),
            "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else 0,
            "device": torch.cuda.get_device_name() if cuda else "cpu"}


def markdown(res: dict) -> str:
    modes, batches = list(res["decode"]), res["batches"]
    lines = [f"### Tensor-parallel decode: {res['model']}, tp={res['tp']}, {res['rank_memory'][0]['dtype']}, "
             "dummy weights, "
             f"{res['ctx']}-token contexts",
             "", f"`{res['command']}` on {res['rank_memory'][0]['device']} x{res['tp']}, "
             f"{time.strftime('%Y-%m-%d')}. Time per output token (ms, median engine step).", "",
             "| batch | " + " | ".join(modes) + " | roofline | pinned/stock |",
             "|---|" + "---|" * (len(modes) + 2)]
    for b in batches:
        row = [f"{res['decode'][m][str(b)]['tpot_ms']:.2f}" for m in modes]
        ratio = res.get("pinned_over_stock", {}).get(str(b))
        lines.append(f"| {b} | " + " | ".join(row) + f" | {res['roofline_ms'][str(b)]:.2f} | "
                     + (f"{ratio:.3f}" if ratio else "-") + " |")
    lines.append("")
    for m in modes:
        mm = res["modes"][m]
        lines.append(f"- {m}: {mm['selection_source']}; {mm.get('cuda_graphs', 'eager')}; invariance cell "
                     f"(req 0, batch {batches[0]} vs {batches[-1]}): {mm['invariance']}")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-70b")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--batches", default="1,8,64")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--modes", default="stock,pinned,conservative")
    ap.add_argument("--allreduce", default="", help="MODE=CANDIDATE[,MODE=CANDIDATE]: override a mode's all-reduce")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    ap.add_argument("--out", default="tp_decode.json")
    ap.add_argument("--md", default="", help="append a markdown section to this file (e.g. docs/performance.md)")
    a = ap.parse_args()
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    batches = [int(b) for b in a.batches.split(",")]
    modes = a.modes.split(",")
    overrides = dict(kv.split("=") for kv in a.allreduce.split(",") if kv)

    from detent.engine import LLM
    t0 = time.time()
    llm = LLM(model=a.model, tensor_parallel_size=a.tp, load_format="dummy", max_model_len=a.ctx + a.steps + 16,
              max_num_seqs=max(batches), max_num_batched_tokens=8192, enable_prefix_caching=False,
              enforce_eager=True, gpu_memory_utilization=a.gpu_memory_utilization, seed=0)
    ex, eng = llm.llm_engine.runner, llm.llm_engine
    mem = ex.collective_rpc(rank_memory)
    res = {"command": " ".join(sys.argv), "model": a.model, "tp": a.tp, "load_s": round(time.time() - t0, 1),
           "batches": batches, "ctx": a.ctx, "steps": a.steps, "rank_memory": mem, "decode": {}, "modes": {},
           "roofline_ms": {str(b): (mem[0]["weight_bytes"] + b * (a.ctx + a.steps // 2) * mem[0]["kv_bytes_per_token"])
                           / COPY_BW * 1e3 for b in batches}}
    print(json.dumps({k: res[k] for k in ("model", "tp", "load_s", "rank_memory")}), flush=True)
    try:
        for mode in modes:
            info = ex.collective_rpc(rank_set_mode, mode, not a.eager, batches, max(batches), overrides.get(mode))
            res["modes"][mode] = info[0]
            print(mode, info[0], flush=True)
            rows = {}
            for b in batches:
                rows[str(b)] = decode_batch(llm, b, a.ctx, a.steps, eng.model_config.vocab_size, mode)
                print(f"{mode:12s} batch {b:4d}  {rows[str(b)]['tpot_ms']:7.2f} ms/token  (roofline "
                      f"{res['roofline_ms'][str(b)]:.2f})  prefill {rows[str(b)]['prefill_s']:.1f}s", flush=True)
            lo, hi = rows[str(batches[0])], rows[str(batches[-1])]
            res["modes"][mode]["invariance"] = {"tokens_equal": lo["req0_tokens"] == hi["req0_tokens"],
                                                "logprobs_equal": lo["req0_logprobs"] == hi["req0_logprobs"]}
            res["decode"][mode] = rows
        res["rank_memory_end"] = ex.collective_rpc(rank_memory)
    finally:
        llm.llm_engine.runner.shutdown()
    for b in batches:
        s, p = res["decode"].get("stock", {}).get(str(b)), res["decode"].get("pinned", {}).get(str(b))
        if s and p:
            res.setdefault("pinned_over_stock", {})[str(b)] = p["tpot_ms"] / s["tpot_ms"]
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    md = markdown(res)
    print("\n" + md)
    if a.md:
        with open(a.md, "a") as f:
            f.write("\n" + md)


if __name__ == "__main__":
    main()
