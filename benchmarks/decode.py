"""Decode benchmark: time per output token at batch 1, 8, 64, 256 with 1k-token
contexts, for the stock, pinned and conservative selections in ONE run (same
weights, same KV pool), decode from CUDA graphs. Also the bandwidth roofline
((weight + KV bytes per step) / copy bandwidth), memory, and one end-to-end
invariance cell per mode (request 0 alone vs. in the largest batch).

    python benchmarks/decode.py --model llama-3.1-8b --out decode.json --png decode.png [--prefill]

Time per output token = median wall time of an engine step (schedule, graph
replay, logits, sampling, output processing) over `--steps` decode-only steps.
With async scheduling (the default on CUDA) a step launches the next forward
before it waits for the previous one's tokens, so in steady state this is
the device time per step whenever the host work fits inside it. Roofline:
weight bytes the step reads (for an MoE, the dense part plus the experts the
batch reaches, uniform routing) plus KV bytes, over the measured copy bandwidth.
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
from gpu_engine import build, measure_copy_bw, set_mode  # noqa: E402

from detent.sampling.params import SamplingParams  # noqa: E402


def _sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1000, vocab - 1000, (length,), generator=g).tolist() for _ in range(n)]


def decode_batch(llm, batch: int, ctx: int, steps: int, vocab: int, tag: str):
    """Prefill `batch` prompts of `ctx` tokens, then time `steps` decode steps.
    Request 0's prompt is the same in every batch (for the invariance cell)."""
    eng = llm.llm_engine
    ps = prompts(1, ctx, vocab, 0) + prompts(batch - 1, ctx, vocab, 1000 + batch)
    # long enough that every request is still decoding in the timed steps
    # (the first ones decode while the rest prefill): aborted afterwards
    budget = eng.config.max_num_batched_tokens
    sp = SamplingParams(temperature=0.0, max_tokens=steps + 8 + batch * ctx // budget, ignore_eos=True,
                        logprobs=1)
    ids = [f"{tag}-{batch}-{i}" for i in range(batch)]
    for rid, p in zip(ids, ps):
        eng.add_request(rid, p, sp)
    t0 = time.time()
    last = {}
    while len(last) < batch or not all(o.outputs[0].token_ids for o in last.values()):
        for out in eng.step():  # prefill (chunked to the token budget) until every request has a token
            last[out.request_id] = out
    _sync()
    prefill_s = time.time() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        outs = eng.step()
        times.append(time.perf_counter() - t)
        for o in outs:
            last[o.request_id] = o
    n = steps + 1  # tokens every batch size produced for request 0
    while len(last[ids[0]].outputs[0].token_ids) < n:  # async scheduling: a step's tokens arrive one call late
        for o in eng.step():
            last[o.request_id] = o
    eng.abort_request(ids)
    while eng.has_unfinished_requests():
        eng.step()
    r0 = last[ids[0]].outputs[0]
    return {"tpot_ms": statistics.median(times) * 1e3, "tpot_mean_ms": statistics.mean(times) * 1e3,
            "prefill_s": prefill_s, "req0_tokens": list(r0.token_ids)[:n],
            "req0_logprobs": [repr(x) for x in (r0.logprobs or [])[:n]]}


def weight_bytes_read(info: dict, mc, batch: int) -> float:
    """Weight bytes a decode step must read: all of them for a dense model; for an
    MoE the dense part plus the experts the batch's tokens reach, in expectation
    under uniform routing (E * (1 - (1 - k/E)^batch) experts per layer)."""
    e = getattr(mc, "num_experts", 0)
    if not e:
        return info["weight_bytes"]
    per_expert = 3 * mc.hidden_size * mc.moe_intermediate_size * 2  # gate, up, down in bf16
    layers = mc.num_layers - len(getattr(mc, "mlp_only_layers", ()) or ())
    dense = info["weight_bytes"] - layers * e * per_expert
    touched = e * (1 - (1 - mc.num_experts_per_tok / e) ** batch)
    return dense + layers * touched * per_expert


def roofline_ms(info: dict, mc, batch: int, ctx: int, bw: float) -> float:
    kv_per_tok = info["kv_bytes_per_token"]
    return (weight_bytes_read(info, mc, batch) + batch * ctx * kv_per_tok) / bw * 1e3


def _label(mode: str) -> str:
    base, *envs = mode.split("+")
    return base + (" [" + ", ".join(envs) + "]" if envs else "")


def plot(res: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 2 if "prefill" in res else 1, figsize=(11 if "prefill" in res else 6, 4))
    axes = ax if hasattr(ax, "__len__") else [ax]
    bs = res["batches"]
    for mode, rows in res["decode"].items():
        axes[0].plot(bs, [rows[str(b)]["tpot_ms"] for b in bs], marker="o", label=_label(mode))
    axes[0].plot(bs, [res["roofline_ms"][str(b)] for b in bs], "k--", label="bandwidth roofline")
    axes[0].set_xscale("log", base=2)
    axes[0].set_xlabel("batch (1k-token contexts)")
    axes[0].set_ylabel("ms per output token")
    axes[0].set_title(f"decode, {res['info']['model']}, bf16, H200")
    axes[0].legend(fontsize=8)
    if "prefill" in res:
        lens = res["prefill_lens"]
        w = 0.25
        for i, (mode, rows) in enumerate(res["prefill"].items()):
            axes[1].bar([j + i * w for j in range(len(lens))], [rows[str(n)]["tok_s"] for n in lens], w,
                        label=_label(mode))
        axes[1].set_xticks([j + w for j in range(len(lens))], [f"{n} tokens" for n in lens])
        axes[1].set_ylabel("prefill tokens / s")
        axes[1].set_title("prefill (eager)")
        axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="llama-3.1-8b")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--modes", default="stock,pinned,conservative")
    ap.add_argument("--prefill", action="store_true", help="also run benchmarks/prefill.py's sweep")
    ap.add_argument("--prefill-lens", default="2048,8192")
    ap.add_argument("--out", default="decode.json")
    ap.add_argument("--png", default="decode.png")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    modes = a.modes.split(",")
    plens = [int(n) for n in a.prefill_lens.split(",")] if a.prefill else []
    max_len = max([a.ctx + a.steps + 24 + max(batches) * a.ctx // 8192] + [n + 16 for n in plens])
    bw = measure_copy_bw()
    llm, mc, info = build(a.model, max_model_len=max_len, max_num_seqs=max(batches))
    res = {"command": " ".join(sys.argv), "device": torch.cuda.get_device_name(), "copy_bw_tbs": bw / 1e12,
           "pinned_attn_block_m": os.environ.get("DETENT_PINNED_ATTN_BLOCK_M", "by_query"),
           "info": info, "batches": batches, "ctx": a.ctx, "steps": a.steps, "decode": {}, "modes": {},
           "roofline_ms": {str(b): roofline_ms(info, mc, b, a.ctx + a.steps // 2, bw) for b in batches}}
    print(json.dumps(info), flush=True)
    for mode in modes:
        # "MODE+sync": the same selection without async scheduling (the overlap's ablation)
        res["modes"][mode] = set_mode(llm, mode.replace("+sync", ""), graphs=True, capture_sizes=batches)
        llm.llm_engine.async_scheduling = "+sync" not in mode
        res["modes"][mode]["async_scheduling"] = llm.llm_engine.async_scheduling
        print(mode, res["modes"][mode], flush=True)
        rows = {}
        for b in batches:
            rows[str(b)] = decode_batch(llm, b, a.ctx, a.steps, mc.vocab_size, mode)
            print(f"{mode:12s} batch {b:4d}  {rows[str(b)]['tpot_ms']:7.2f} ms/token  (roofline "
                  f"{res['roofline_ms'][str(b)]:.2f})  prefill {rows[str(b)]['prefill_s']:.1f}s", flush=True)
        lo, hi = rows[str(batches[0])], rows[str(batches[-1])]
        res["modes"][mode]["invariance_req0_batch%d_vs_%d" % (batches[0], batches[-1])] = {
            "tokens_equal": lo["req0_tokens"] == hi["req0_tokens"],
            "logprobs_equal": lo["req0_logprobs"] == hi["req0_logprobs"]}
        res["decode"][mode] = rows
        if plens:
            from prefill import prefill_sweep
            set_mode(llm, mode.replace("+sync", ""), graphs=False)
            res.setdefault("prefill", {})[mode] = prefill_sweep(llm, plens, mc.vocab_size)
            res["prefill_lens"] = plens
        _sync()
    res["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    free_budget = info["gpu_memory_utilization"] * info["gpu_total_bytes"] - info["weight_bytes"]
    workspace = res["peak_allocated_bytes"] - info["weight_bytes"] - info["kv_pool_bytes"]
    res["kv_share_of_budget_after_weights_and_workspace"] = info["kv_pool_bytes"] / (free_budget - workspace)
    for b in batches:
        s = res["decode"].get("stock", {}).get(str(b))
        for m in modes:
            p = res["decode"][m][str(b)]
            if s and m.startswith("pinned"):
                res.setdefault("pinned_over_stock", {}).setdefault(m, {})[str(b)] = p["tpot_ms"] / s["tpot_ms"]
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)
    plot(res, a.png)
    print("\nbatch  " + "  ".join(f"{m:>12s}" for m in modes) + "   roofline  pinned/stock")
    for b in batches:
        print(f"{b:5d}  " + "  ".join(f"{res['decode'][m][str(b)]['tpot_ms']:12.2f}" for m in modes)
              + f"   {res['roofline_ms'][str(b)]:8.2f}  "
              + " ".join(f"{r[str(b)]:.3f}" for r in res.get("pinned_over_stock", {}).values()))
    for m in modes:
        print(m, res["modes"][m])
    if plens:
        for m in modes:
            print(m, {n: round(res["prefill"][m][str(n)]["tok_s"]) for n in plens})
    print("memory:", {k: info[k] for k in ("weight_bytes", "kv_pool_tokens", "kv_pool_bytes")},
          "peak", res["peak_allocated_bytes"], "kv share", round(res["kv_share_of_budget_after_weights_and_workspace"], 3))


if __name__ == "__main__":
    main()
