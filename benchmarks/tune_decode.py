"""Tile sweep for the decode-shaped kernels on the GPU, with a bits check.

The pinned selection may choose a GEMM tile config by M, and attention's
query tile, warps, pipeline stages and combine mode by batch, only where the
choice does not change a row's bits (`neutral` in the SelIR programs). This
script measures each candidate and checks that claim for the shapes it times:
every GEMM config against the first one at the same M, every attention
variant against the default launch, with `torch.equal`.

GEMM timing streams weights the way a decode step does: one CUDA graph runs
the GEMM over `--copies` different weight tensors (more bytes than the 50 MB
L2) and the time is divided by the copies, so no config is flattered by
weights left in L2 by the previous replay.

    python3 benchmarks/tune_decode.py --out tune.json [--model qwen3-30b-a3b --skip attention]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton

from detent.kernels.attention_triton import attention_triton_paged
from detent.kernels.gemm_triton import gemm_triton_persistent
from detent.selection.programs import gemm as gemm_program
from detent.selection.programs import gemm_tile_configs

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_bench import attn_case, bench  # noqa: E402  (one attention case, CUDA-graph timing)

REP = 40  # ms of replays per measurement (runs A and C)

BF16 = torch.bfloat16
def config_of(model: str):
    from detent.models.config import ModelConfig
    from detent.models.presets import PRESETS, preset
    p = preset(model)
    if p is None:
        raise SystemExit(f"--model {model!r} is not a preset (presets: {', '.join(sorted(PRESETS))})")
    return ModelConfig.from_hf(p["config"])


def shapes_of(model: str) -> dict[str, tuple[int, int]]:
    """(N, K) of the dense GEMMs of a preset at tp = 1 (an MoE's experts run in the fused kernel)."""
    mc = config_of(model)
    h, d = mc.hidden_size, mc.head_dim
    out = {"qkv": ((mc.num_heads + 2 * mc.num_kv_heads) * d, h), "o": (h, mc.num_heads * d)}
    if mc.num_experts:
        out["router"] = (mc.num_experts, h)
    else:
        out["gate_up"] = (2 * mc.intermediate_size, h)
        out["down"] = (h, mc.intermediate_size)
    out["lm_head"] = (mc.vocab_size, h)
    return out


SHAPES = shapes_of("llama-3.1-8b")
# (block_m, block_n, block_k, num_warps, num_stages): the table's configs, plus narrow
# tiles that give N = 4096 outputs 128 programs at M <= 64 (no split-K)
EXTRA = [(16, 32, 256, 4, 5), (32, 32, 256, 4, 4), (64, 32, 128, 4, 4), (64, 32, 256, 4, 3),
         (64, 32, 128, 4, 5), (32, 64, 256, 4, 4), (64, 64, 128, 4, 5), (64, 128, 128, 8, 4),
         (16, 64, 256, 4, 4), (128, 64, 128, 8, 4), (64, 256, 64, 8, 4), (128, 256, 64, 8, 3),
         (128, 128, 64, 8, 4), (64, 64, 256, 4, 3)]


# prefill tiles (M > 256: compute-bound), each also with TMA loads
PREFILL = [(128, 256, 64, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
           (256, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 256, 128, 8, 2)]


def _candidates(m: int, tma: bool) -> list[tuple]:
    """(block_m, block_n, block_k, num_warps, num_stages, tma) configs worth timing at M = m."""
    base = {tuple(c.values())[:5] for c in gemm_tile_configs()} | set(EXTRA)
    if m > 256:
        base = {c for c in base | set(PREFILL) if c[0] >= 128}
    else:
        base = {c for c in base if not ((m <= 16 and c[0] > 32) or (m > 64 and c[0] < 64) or (m <= 64 and c[0] > 64))}
    out = [(*c, 0) for c in sorted(base)]
    if tma:
        out += [(*c, 1) for c in sorted(base)]
    return out


def gemm(ms: list[int], copies: int, shapes: dict[str, tuple[int, int]] = SHAPES, tma: bool = True) -> list[dict]:
    res = []
    for name, (n, k) in shapes.items():
        c = max(2, min(copies, int(400e6 // (n * k * 2))))  # >= 400 MB of weights per replay
        ws = [torch.randn(n, k, device="cuda", dtype=BF16) * 0.02 for _ in range(c)]
        for m in ms:
            if name == "lm_head" and m > 256:
                continue  # prefill computes logits only for the rows that sample
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            floor_us = max(n * k * 2 / 4.23e12, 2 * m * n * k / 989e12) * 1e6  # weight bytes, dense bf16 peak
            row = {"shape": name, "n": n, "k": k, "m": m, "floor_us": floor_us,
                   "table": str(gemm_program.triton_config(m, n))}
            row["cublas_us"] = bench(lambda: [torch.nn.functional.linear(x, w) for w in ws], REP) * 1e3 / c
            ref, times = None, {}
            for cfg in _candidates(m, tma):
                bm, bn, bk, nw, ns, tm = cfg
                kw = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns, tma=tm)
                try:
                    y = gemm_triton_persistent(x, ws[0], None, **kw)
                    t = bench(lambda: [gemm_triton_persistent(x, w, None, **kw) for w in ws], REP) * 1e3 / c
                except Exception as e:  # noqa: BLE001  (a config that does not compile here)
                    times[str(cfg)] = f"error: {type(e).__name__}: {str(e)[:200]}"
                    continue
                if ref is None:
                    ref = y
                row.setdefault("bits_differ", [])
                if not torch.equal(y, ref):
                    row["bits_differ"].append(str(cfg))
                times[str(cfg)] = t
            row["triton_us"] = times
            ok = {c2: t for c2, t in times.items() if isinstance(t, float)}
            best = min(ok, key=ok.get)
            row["best"], row["best_us"] = best, ok[best]
            row["table_us"] = ok.get(row["table"])
            print(f"gemm {name:8s} M={m:4d} cublas {row['cublas_us']:7.1f}  table {row['table_us'] or -1:7.1f} "
                  f"best {ok[best]:7.1f} {best}  floor {floor_us:6.1f}  differ={row['bits_differ']}", flush=True)
            res.append(row)
        del ws
    return res


def moe(mc, ms: list[int], copies: int) -> list[dict]:
    """The fused MoE (fuse_glue=2, both grouped GEMMs with one tile) at M tokens,
    over `copies` different expert weight sets so that each call streams its
    experts from HBM; every tile's result compared with `torch.equal` against
    the table's row for that M."""
    from detent.kernels.moe_triton import moe_triton_fused
    from detent.selection.programs import moe as moe_program
    from detent.selection.programs import moe_tiles
    if not mc.num_experts:
        return []
    e, h, i, k = mc.num_experts, mc.hidden_size, mc.moe_intermediate_size, mc.num_experts_per_tok
    ws = [(torch.randn(e, 2 * i, h, device="cuda", dtype=BF16) * 0.02,
           torch.randn(e, h, i, device="cuda", dtype=BF16) * 0.02) for _ in range(copies)]
    res = []
    for m in ms:
        x = torch.randn(m, h, device="cuda", dtype=BF16)
        logits = torch.randn(m, e, device="cuda", dtype=BF16)
        table = moe_tiles()[moe_program.nearest_row(m, moe_program.GPU_KEYS)]
        tiles = [tuple(table.values())] + [(bm, bn, bk, 1 if m <= 64 else 8, 4, ns)
                                             for bm in ((16,) if m <= 16 else (16, 32))
                                             for bn in (32, 64, 128) for bk in (64, 128, 256)
                                             for ns in (3, 4) if bn * bk <= 128 * 128]
        ref, row = None, {"m": m, "table": str(tuple(table.values())), "tiles": {}, "bits_differ": []}
        for t in dict.fromkeys(tiles):
            kw = dict(zip(("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages"), t))
            call = lambda: [moe_triton_fused(x, logits, w13, w2, k, True, fuse_glue=2, **kw)  # noqa: E731
                            for w13, w2 in ws]
            try:
                y = moe_triton_fused(x, logits, *ws[0], k, True, fuse_glue=2, **kw)
                row["tiles"][str(t)] = bench(call, REP) * 1e3 / copies
            except Exception as ex:  # noqa: BLE001
                row["tiles"][str(t)] = f"error: {type(ex).__name__}: {str(ex)[:160]}"
                continue
            if ref is None:
                ref = y
            elif not torch.equal(y, ref):
                row["bits_differ"].append(str(t))
        ok = {c: v for c, v in row["tiles"].items() if isinstance(v, float)}
        row["best"] = min(ok, key=ok.get)
        top = sorted(ok.items(), key=lambda kv: kv[1])[:5]
        print(f"moe M={m:4d}: table {ok.get(row['table'], -1):7.1f} us  best {ok[row['best']]:7.1f} {row['best']}  "
              f"differ={row['bits_differ']}", flush=True)
        print("   top:", ", ".join(f"{c} {v:.1f}" for c, v in top), flush=True)
        res.append(row)
    del ws
    return res


def prefill_attention(lens: list[int], heads: int, kv_heads: int, head_dim: int,
                      block_ns: tuple[int, ...] = (64,)) -> list[dict]:
    """One prompt of n tokens attending causally to itself: the query tile,
    warps and stages (each neutral: the row sum goes through the MMA), all
    compared with `torch.equal` against the first launch of the same KV tile
    (`block_n` sets where the online softmax rescales, so it is not neutral:
    its variants are keyed `n{block_n}_...` and checked among themselves)."""
    res = []
    launches = [(64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 8, 2), (128, 8, 3), (128, 4, 2)]
    for n in lens:
        q, k, v, cache, meta = attn_case(1, n, n, h=heads, kvh=kv_heads, d=head_dim)
        tflop = 4 * n * n / 2 * head_dim * heads / 1e12
        row = {"n": n, "heads": heads, "kv_heads": kv_heads, "variants": {}, "bits_differ": []}
        refs = {}
        for bn, (bm, nw, ns) in ((bn, x) for bn in block_ns for x in launches):
            kw = dict(block_m=bm, num_warps=nw, num_stages=ns, split_tokens=256, block_n=bn, rowsum="mma",
                      combine="sequential")
            key = f"m{bm}_w{nw}_st{ns}" if bn == 64 else f"n{bn}_m{bm}_w{nw}_st{ns}"
            try:
                y = attention_triton_paged(q, k, v, cache, meta, 0.088, **kw)
                ms = bench(lambda: attention_triton_paged(q, k, v, cache, meta, 0.088, **kw), REP)
            except Exception as e:  # noqa: BLE001
                row["variants"][key] = f"error: {type(e).__name__}: {str(e)[:160]}"
                continue
            row["variants"][key] = ms * 1e3
            if not torch.equal(y, refs.setdefault(bn, y)):
                row["bits_differ"].append(key)
        ok = {c: t for c, t in row["variants"].items() if isinstance(t, float)}
        print(f"prefill attn n={n} heads {heads}/{kv_heads}: differ={row['bits_differ']}  "
              + ", ".join(f"{c} {t:.0f} us ({tflop / (t * 1e-6):.0f} TFLOP/s)" for c, t in ok.items()), flush=True)
        res.append(row)
    return res


def attention(batches: list[int], ctx: int, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
              block_ns: tuple[int, ...] = (64,)) -> list[dict]:
    """Decode launches (one query per sequence); variants of another KV tile than 64 are keyed
    `n{block_n}_...` and checked against that tile's default launch (see prefill_attention)."""
    res = []
    for b in batches:
        q, k, v, cache, meta = attn_case(b, ctx, 1, h=heads, kvh=kv_heads, d=head_dim)
        floor_us = b * ctx * kv_heads * head_dim * 2 * 2 / 4.23e12 * 1e6
        row = {"batch": b, "ctx": ctx, "floor_us": floor_us, "variants": {}, "bits_differ": []}
        for bn in block_ns:
            base = dict(split_tokens=256, block_n=bn, rowsum="mma")
            ref = attention_triton_paged(q, k, v, cache, meta, 0.088, block_m=16, num_warps=4, num_stages=2, **base)
            for nw, ns, comb in ((nw, ns, c) for nw in (2, 4, 8) for ns in (1, 2, 3, 4)
                                 for c in ("sequential", "parallel")):
                kw = dict(block_m=16, num_warps=nw, num_stages=ns, combine=comb, **base)
                key = f"m16_w{nw}_st{ns}_{comb[:3]}" if bn == 64 else f"n{bn}_m16_w{nw}_st{ns}_{comb[:3]}"
                try:
                    y = attention_triton_paged(q, k, v, cache, meta, 0.088, **kw)
                    row["variants"][key] = bench(
                        lambda: attention_triton_paged(q, k, v, cache, meta, 0.088, **kw), REP) * 1e3
                except Exception as e:  # noqa: BLE001
                    row["variants"][key] = f"error: {type(e).__name__}"
                    continue
                if not torch.equal(y, ref):
                    row["bits_differ"].append(key)
        ok = {c: t for c, t in row["variants"].items() if isinstance(t, float)}
        best = min(ok, key=ok.get)
        row["best"], row["best_us"] = best, ok[best]
        row["default_us"] = ok.get("m16_w4_st2_seq" if b * kv_heads >= 132 else "m16_w4_st2_par")
        print(f"attn b={b:4d} ctx={ctx}: default {row['default_us'] or -1:7.1f} best {ok[best]:7.1f} {best} "
              f"floor {floor_us:6.1f}  differ={row['bits_differ']}", flush=True)
        top = sorted(ok.items(), key=lambda kv: kv[1])[:6]
        print("   top:", ", ".join(f"{c} {t:.1f}" for c, t in top), flush=True)
        res.append(row)
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="tune.json")
    ap.add_argument("--ms", default="8,64,128,256")
    ap.add_argument("--batches", default="1,8,64,256")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--copies", type=int, default=8)
    ap.add_argument("--skip", default="", help="gemm, attention, prefill and/or moe")
    ap.add_argument("--prefill-lens", default="2048,8192", help="prompt lengths of the prefill attention sweep")
    ap.add_argument("--moe-ms", default="1,8,64", help="token counts of the MoE tile sweep (MoE presets)")
    ap.add_argument("--model", default="llama-3.1-8b", help="preset whose dense GEMM and attention shapes are swept")
    ap.add_argument("--block-ns", default="64", help="KV tiles of the attention sweeps (not neutral: each is its own set)")
    ap.add_argument("--no-tma", action="store_true", help="time pointer-load tiles only")
    a = ap.parse_args()
    t0 = time.time()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    mc = config_of(a.model)
    if "attention" not in a.skip:
        block_ns = tuple(int(x) for x in a.block_ns.split(","))
        out["attention"] = attention([int(b) for b in a.batches.split(",")], a.ctx, mc.num_heads, mc.num_kv_heads,
                                     mc.head_dim, block_ns)
    if "prefill" not in a.skip:
        out["prefill_attention"] = prefill_attention([int(n) for n in a.prefill_lens.split(",")], mc.num_heads,
                                                     mc.num_kv_heads, mc.head_dim,
                                                     tuple(int(x) for x in a.block_ns.split(",")))
    if "moe" not in a.skip:
        out["moe"] = moe(mc, [int(m) for m in a.moe_ms.split(",")], max(2, a.copies // 2))
    if "gemm" not in a.skip:
        out["gemm"] = gemm([int(m) for m in a.ms.split(",")], a.copies, shapes_of(a.model), tma=not a.no_tma)
    out["seconds"] = time.time() - t0
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(f"done in {out['seconds']:.0f} s", flush=True)


if __name__ == "__main__":
    main()
