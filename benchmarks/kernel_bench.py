"""Kernel micro-benchmarks on the GPU: picks the pinned configs.

GEMM: cuBLAS (torch, the stock choice) vs the Triton persistent matmul
under several fixed configs, at Llama-3.1-8B's (N, K) and M = 1..8192; also
whether the configs give identical bits (numerics-neutral configs).
Attention: decode at batch 1/8/64/256 with 1k contexts, and a 2k prefill,
over split sizes.

    python benchmarks/kernel_bench.py --out kernels.json
"""
from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
import triton

from detent.kernels.attention_triton import attention_triton_paged
from detent.kernels.gemm_triton import gemm_triton_persistent

BF16 = torch.bfloat16
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
CONFIGS = [  # (block_m, block_n, block_k, num_warps, num_stages)
    (16, 64, 256, 4, 4), (16, 32, 256, 4, 5), (16, 128, 128, 4, 4),
    (32, 64, 128, 4, 4), (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (128, 256, 64, 8, 3),
    # round 2: mid-size M
    (64, 64, 128, 4, 4), (64, 128, 128, 4, 3), (32, 128, 128, 4, 4), (64, 64, 256, 4, 3),
    (128, 64, 128, 4, 4), (128, 128, 64, 8, 4), (64, 256, 64, 8, 4), (128, 128, 128, 8, 3)]


def bench(fn, rep=25):
    """Median ms of CUDA-graph replays (no launch overhead: what decode sees)."""
    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def copy_bw():
    a = torch.empty(2 ** 30, dtype=torch.uint8, device="cuda").random_()
    b = torch.empty_like(a)
    ms = bench(lambda: b.copy_(a))
    return 2 * a.numel() / (ms * 1e-3) / 1e12


def gemm_sweep(ms):
    res = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=BF16) * 0.02
        for m in ms:
            x = torch.randn(m, k, device="cuda", dtype=BF16)
            row = {"shape": name, "n": n, "k": k, "m": m,
                   "cublas_ms": bench(lambda: F.linear(x, w)),
                   "floor_ms": max((n * k + m * k + m * n) * 2 / 4.23e12, 2 * m * n * k / 795e12) * 1e3}
            outs = []
            for cfg in CONFIGS:
                bm, bn, bk, nw, ns = cfg
                if (m >= 1024 and bm < 64) or (m <= 16 and bm >= 64):
                    continue
                kw = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=nw, num_stages=ns)
                try:
                    outs.append(gemm_triton_persistent(x, w, None, **kw))
                    row[str(cfg)] = bench(lambda: gemm_triton_persistent(x, w, None, **kw))
                except Exception as e:  # noqa: BLE001  (a config that does not compile)
                    row[str(cfg)] = f"error: {type(e).__name__}: {str(e)[:80]}"
            row["configs_bit_identical"] = all(torch.equal(o, outs[0]) for o in outs[1:])
            res.append(row)
            best = min((v, c) for c, v in row.items() if c.startswith("(") and isinstance(v, float))
            print(f"gemm {name:8s} m={m:5d} cublas {row['cublas_ms']*1e3:8.1f}us  best {best[0]*1e3:8.1f}us "
                  f"{best[1]}  floor {row['floor_ms']*1e3:7.1f}us  same_bits={row['configs_bit_identical']}",
                  flush=True)
        del w
    return res


def attn_case(batch, ctx, q_len, h=32, kvh=8, d=128, bs=16):
    from detent.selection.context import AttentionMetadata
    nblk = -(-ctx // bs)
    num_blocks = batch * nblk + 1
    cache = torch.randn(2, num_blocks, bs, kvh, d, device="cuda", dtype=BF16)
    tables = torch.randperm(num_blocks - 1, device="cuda")[: batch * nblk].view(batch, nblk).int() + 1
    t = batch * q_len
    qsl = torch.arange(0, t + 1, q_len, device="cuda", dtype=torch.int32)
    lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
    pos = torch.arange(ctx - q_len, ctx, device="cuda")
    slots = (tables.long()[:, pos // bs] * bs + pos % bs).reshape(-1)
    meta = AttentionMetadata(query_start_loc=qsl, seq_lens=lens, block_tables=tables, slot_mapping=slots,
                             num_seqs=batch, num_tokens=t, max_seqlen_q=q_len, max_seqlen_k=ctx, block_size=bs,
                             query_start_loc_cpu=tuple(qsl.tolist()), seq_lens_cpu=(ctx,) * batch)
    q = torch.randn(t, h, d, device="cuda", dtype=BF16)
    k = torch.randn(t, kvh, d, device="cuda", dtype=BF16)
    v = torch.randn_like(k)
    return q, k, v, cache, meta


def attn_sweep():
    import importlib.util, pathlib
    spec = importlib.util.spec_from_file_location(
        "fa3_reference", pathlib.Path(__file__).resolve().parents[1] / "tests" / "selection" / "fa3_reference.py")
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)
    fa3_num_splits = ref.fa3_num_splits
    res = []
    for batch, ctx, q_len in ((1, 1024, 1), (8, 1024, 1), (64, 1024, 1), (256, 1024, 1), (1, 2048, 2048),
                              (1, 8192, 2048)):
        q, k, v, cache, meta = attn_case(batch, ctx, q_len)
        kv_bytes = batch * ctx * 8 * 128 * 2 * 2
        row = {"batch": batch, "ctx": ctx, "q_len": q_len, "kv_floor_us": kv_bytes / 4.23e12 * 1e6}
        fa3 = fa3_num_splits(batch, 8, q_len, ctx, 4, 132)
        row["fa3_splits"] = fa3
        fa3_split = -(-(-(-ctx // fa3)) // 64) * 64
        for split in sorted({64, 128, 256, 512, 8192, fa3_split}):
            for bm, nw, ns in ((16, 4, 2), (64, 4, 2), (128, 8, 2), (64, 4, 3)):
                if q_len == 1 and bm == 128:
                    continue
                kw = dict(split_tokens=split, block_m=bm, block_n=64, num_warps=nw, num_stages=ns)
                try:
                    row[f"s{split}_m{bm}_w{nw}_st{ns}"] = bench(
                        lambda: attention_triton_paged(q, k, v, cache, meta, 0.088, **kw)) * 1e3
                except Exception as e:  # noqa: BLE001
                    row[f"s{split}_m{bm}_w{nw}_st{ns}"] = f"error: {type(e).__name__}: {str(e)[:80]}"
        if q_len > 1:
            qq = q.view(1, -1, 32, 128).transpose(1, 2)
            kk = torch.randn(1, 8, ctx, 128, device="cuda", dtype=BF16)
            row["torch_sdpa_us"] = bench(lambda: F.scaled_dot_product_attention(
                qq, kk, kk, is_causal=False, enable_gqa=True)) * 1e3
        res.append(row)
        print("attn", {kk: (round(vv, 1) if isinstance(vv, float) else vv) for kk, vv in row.items()}, flush=True)
    return res


def attn_variants(env_out: str | None):
    """Row-sum variants of the attention kernel: decode at batch 256 / 1 and a
    2k-query prefill over 8k of KV; picks the pinned policy (writes shell
    exports to env_out): the MMA row sum with tile rows by query length when
    its decode is within 3% of tl.sum at 16 rows, else 16 rows with tl.sum."""
    res = {}
    cases = {"dec256": attn_case(256, 1024, 1), "dec1": attn_case(1, 1024, 1), "pre8k": attn_case(1, 8192, 2048)}
    for cname, (q, k, v, cache, meta) in cases.items():
        for rowsum in ("mma", "sum"):
            for bm, split in ((16, 256), (64, 256), (16, 8256), (64, 8256)):
                if cname == "dec1" and bm == 64:
                    continue
                kw = dict(split_tokens=split, block_m=bm, block_n=64, num_warps=4, rowsum=rowsum)
                key = f"{cname}_{rowsum}_m{bm}_s{split}"
                res[key] = bench(lambda: attention_triton_paged(q, k, v, cache, meta, 0.088, **kw)) * 1e3
                print(f"{key:28s} {res[key]:9.1f} us", flush=True)
    p1 = res["dec256_mma_m16_s256"]
    p2 = res["dec256_sum_m16_s256"]
    choice = "by_query/mma" if p1 <= 1.03 * p2 else "16/sum"
    res["pinned_choice"] = choice
    print("pinned attention policy:", choice, flush=True)
    if env_out:
        bm, rs = choice.split("/")
        with open(env_out, "w") as f:
            f.write(f"export DETENT_PINNED_ATTN_BLOCK_M={bm} DETENT_PINNED_ATTN_ROWSUM={rs}\n")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="kernels.json")
    ap.add_argument("--attn-variants", action="store_true", help="only the row-sum variant sweep")
    ap.add_argument("--env-out", default=None)
    ap.add_argument("--ms", default="1,8,64,128,256,2048")
    a = ap.parse_args()
    if a.attn_variants:
        with open(a.out, "w") as f:
            json.dump(attn_variants(a.env_out), f, indent=1)
        return
    t0 = time.time()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    out["copy_bw_tbs"] = copy_bw()
    print(f"copy bandwidth {out['copy_bw_tbs']:.2f} TB/s", flush=True)
    out["attention"] = attn_sweep()
    out["gemm"] = gemm_sweep([int(m) for m in a.ms.split(",")])
    out["seconds"] = time.time() - t0
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
