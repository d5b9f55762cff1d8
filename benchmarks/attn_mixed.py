"""The paged attention of a mixed step, launch by launch variant (issue 16).

Under load at 80 % of vLLM's maximum, Detent's mixed steps spend about 7.4 ms
of 27 in attention (docs/performance.md, "Lease 12"): 5.2 for the decode rows'
short launch, 2.2 for the prompt rows. This times the attention op alone
(Llama-3.1-8B shapes: 32 query / 8 KV heads, head dim 128, pages of 16) on
the step sizes seen under load, each variant replayed from a CUDA graph, and
checks with `torch.equal` that every variant of one KV tile gives the first
one's bits:

- the long launch's q tile, warps and stages, the short launch's warps and
  stages, the decode launch's warps, stages and combine (all neutral);
- the long launch's q tiles first to last (`tile_order="ascending"`) against
  the default last to first, and one loop over a program's KV tiles
  (`tile_loop="flat"`, and `"prefetch"`: the block table read a tile ahead)
  against a loop per split (the default's long launch; all neutral);
- the short launch on a second stream beside the long one (`overlap_short`);
- softmax="exp2" with and without split_mask (FlashAttention's exponent form,
  in which the tiles every row sees whole can skip the mask: other bits than
  "exp", checked among its own);
- block_n 128 (another KV tile: other bits, so checked among its own);
- where vLLM is importable (`--vllm-path`, the peer's install), vLLM's own
  attention on the same step: its KV store (`reshape_and_cache_flash`) and
  FlashAttention 3's varlen paged launch, as `vllm serve` runs them on the
  H200 (its bits are its own: not checked).

    python3 benchmarks/attn_mixed.py --out $OUT/attn_mixed.json [--only CASES] [--variants KEYS]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from detent.kernels import attention_plan
from detent.kernels.attention_triton import attention_triton_paged
from detent.selection.context import AttentionMetadata
from kernel_bench import bench

H, KVH, D, PAGE = 32, 8, 128, 16
CTX = 1100  # the decodes' context under load


def step(seqs: list[tuple[int, int]], seed: int = 0):
    """One step: per sequence (query length, KV length after the step), decodes first."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    nblk = [-(-kv // PAGE) for _, kv in seqs]
    total = sum(nblk)
    cache = torch.randn(2, total + 1, PAGE, KVH, D, device="cuda", dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(total, device="cuda", generator=g).int() + 1
    tables = torch.zeros(len(seqs), max(nblk), dtype=torch.int32, device="cuda")
    slots, at = [], 0
    for b, ((ql, kv), n) in enumerate(zip(seqs, nblk)):
        tables[b, :n] = perm[at:at + n]
        at += n
        pos = torch.arange(kv - ql, kv, device="cuda")
        slots.append(tables[b].long()[pos // PAGE] * PAGE + pos % PAGE)
    qlens = [ql for ql, _ in seqs]
    qsl = [0]
    for ql in qlens:
        qsl.append(qsl[-1] + ql)
    t = qsl[-1]
    meta = AttentionMetadata(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device="cuda"),
        seq_lens=torch.tensor([kv for _, kv in seqs], dtype=torch.int32, device="cuda"), block_tables=tables,
        slot_mapping=torch.cat(slots), num_seqs=len(seqs), num_tokens=t, max_seqlen_q=max(qlens),
        max_seqlen_k=max(kv for _, kv in seqs), block_size=PAGE, query_start_loc_cpu=tuple(qsl),
        seq_lens_cpu=tuple(kv for _, kv in seqs))
    q = torch.randn(t, H, D, device="cuda", dtype=torch.bfloat16, generator=g)
    k = torch.randn(t, KVH, D, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(t, KVH, D, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, cache, meta


def cases() -> list[tuple[str, list[tuple[int, int]]]]:
    dec = lambda n: [(1, CTX)] * n  # noqa: E731
    return [("r80: 105 decodes + 750 prompt", dec(105) + [(750, 750)]),
            ("r80: 105 decodes + 750 chunk after 274", dec(105) + [(750, 1024)]),
            ("c128: 105 decodes + 1024 + 780 prompt", dec(105) + [(1024, 1024), (780, 780)]),
            ("r20: 20 decodes + 620 prompt", dec(20) + [(620, 620)]),
            # fresh 1,024-token prompts (lease 18): a chunk cut to end the step on 1,024 tokens
            ("r20 fresh: 26 decodes + 998 prompt", dec(26) + [(998, 998)]),
            ("r80 fresh: 40 decodes + 984 chunk after 40", dec(40) + [(984, 1024)]),
            ("26 decodes alone", dec(26)),
            ("750 prompt alone", [(750, 750)]),
            ("2048 prompt alone", [(2048, 2048)]),
            ("105 decodes alone", dec(105)),
            ("48 decodes alone", dec(48))]


def variants(mixed: bool, decode: bool, long_m: int):
    """(key, attention kwargs, short launch (warps, stages, parallel) or None for the program's own)."""
    out = []
    for bn in (64, 128):
        tag = "" if bn == 64 else "n128_"
        base = dict(split_tokens=256, block_n=bn, rowsum="mma", combine="auto")
        if decode:
            for nw, ns, comb in ((2, 1, "sequential"), (2, 2, "sequential"), (4, 1, "sequential"),
                                 (4, 2, "sequential"), (8, 1, "sequential"), (2, 4, "parallel"), (2, 2, "parallel"),
                                 (4, 2, "parallel")):
                out.append((f"{tag}dec_w{nw}_st{ns}_{comb[:3]}",
                            dict(base, block_m=16, num_warps=nw, num_stages=ns, combine=comb), None))
            for nw, ns, comb in ((2, 3, "sequential"), (2, 4, "parallel")):
                out.append((f"{tag}dec_w{nw}_st{ns}_{comb[:3]}_prefetch",
                            dict(base, block_m=16, num_warps=nw, num_stages=ns, combine=comb, tile_loop="prefetch"),
                            None))
            for nw, ns, comb in ((2, 1, "sequential"), (2, 3, "sequential"), (2, 4, "parallel"),
                                 (4, 2, "sequential")):
                out.append((f"{tag}dec_w{nw}_st{ns}_{comb[:3]}_flat",
                            dict(base, block_m=16, num_warps=nw, num_stages=ns, combine=comb, tile_loop="flat"),
                            None))
            for nw, ns, comb in ((2, 1, "sequential"), (2, 4, "parallel")):
                for sm in (False, True):
                    out.append((f"{tag}dec_w{nw}_st{ns}_{comb[:3]}_exp2{'_smask' if sm else ''}",
                                dict(base, block_m=16, num_warps=nw, num_stages=ns, combine=comb, softmax="exp2",
                                     split_mask=sm), None))
            continue
        for (bm, nw, ns) in ((long_m, 8 if long_m == 128 else 4, 2), (64, 4, 2), (128, 8, 3), (64, 4, 3)):
            out.append((f"{tag}m{bm}_w{nw}_st{ns}", dict(base, block_m=bm, num_warps=nw, num_stages=ns), None))
        # before lease 17: the q tiles first to last, a loop per split
        for bm in (long_m, 64) if long_m != 64 else (64,):
            for order, loop in (("ascending", "nested"), ("heavy_first", "flat")):
                out.append((f"{tag}m{bm}_w{8 if bm == 128 else 4}_st2_{order}_{loop}",
                            dict(base, block_m=bm, num_warps=8 if bm == 128 else 4, num_stages=2,
                                 tile_order=order, tile_loop=loop), None))
        for bm, nw, ns in ((long_m, 8 if long_m == 128 else 4, 4), (64, 4, 4), (64, 8, 3)):
            out.append((f"{tag}m{bm}_w{nw}_st{ns}", dict(base, block_m=bm, num_warps=nw, num_stages=ns), None))
        # the block table read a tile ahead: from 3 stages the next tile's K and V copies are in
        # flight during this tile's MMAs (tests/kernels/test_sm90_compile.py)
        for bm in (long_m, 64) if long_m != 64 else (64,):
            for ns in (2, 3, 4):
                out.append((f"{tag}m{bm}_w{8 if bm == 128 else 4}_st{ns}_prefetch",
                            dict(base, block_m=bm, num_warps=8 if bm == 128 else 4, num_stages=ns,
                                 tile_loop="prefetch"), None))
        # each tile's row-sum MMA folded at the next tile (one MMA wait per KV tile instead of two),
        # alone and with the default knobs since lease 18 (exp2, the short launch beside): against
        # the `_exp2` (`_exp2_overlap` in a mixed step) variants below
        for bm in (long_m, 64) if long_m != 64 else (64,):
            nw = 8 if bm == 128 else 4
            out.append((f"{tag}m{bm}_w{nw}_st2_defer", dict(base, block_m=bm, num_warps=nw, num_stages=2,
                                                             defer_rowsum=True), None))
            out.append((f"{tag}m{bm}_w{nw}_st2_exp2_ov_defer",
                        dict(base, block_m=bm, num_warps=nw, num_stages=2, defer_rowsum=True, softmax="exp2",
                             overlap_short=mixed), None))
        if mixed:  # the first long launch, with each short launch, and the program's beside it on a stream
            # tile_loop="auto": the short launch in one loop over its splits, 3 stages from 512 programs
            out.append((f"{tag}m{long_m}_w{8 if long_m == 128 else 4}_st2_auto",
                        dict(base, block_m=long_m, num_warps=8 if long_m == 128 else 4, num_stages=2,
                             tile_loop="auto"), None))
            # the short launch's splits walked in one program (seq) or one program per split and
            # the combine (par, the default up to 512 programs since lease 18)
            for sw, ss, par in ((2, 1, False), (2, 2, False), (4, 1, False), (4, 2, False), (2, 4, True),
                                (4, 2, True), (2, 2, True)):
                out.append((f"{tag}m{long_m}_short_w{sw}_st{ss}_{'par' if par else 'seq'}",
                            dict(base, block_m=long_m, num_warps=8 if long_m == 128 else 4, num_stages=2),
                            (sw, ss, par)))
            for bm, nw in ((long_m, 8 if long_m == 128 else 4), (64, 4)):
                out.append((f"{tag}m{bm}_w{nw}_st2_overlap",
                            dict(base, block_m=bm, num_warps=nw, num_stages=2, overlap_short=True), None))
        for sm in (False, True):  # another softmax form (other bits: checked among its own)
            for bm, nw in ((long_m, 8 if long_m == 128 else 4), (64, 4)):
                out.append((f"{tag}m{bm}_w{nw}_st2_exp2{'_smask' if sm else ''}",
                            dict(base, block_m=bm, num_warps=nw, num_stages=2, softmax="exp2", split_mask=sm), None))
                if mixed:
                    out.append((f"{tag}m{bm}_w{nw}_st2_exp2{'_smask' if sm else ''}_overlap",
                                dict(base, block_m=bm, num_warps=nw, num_stages=2, softmax="exp2", split_mask=sm,
                                     overlap_short=True), None))
    return out


def fa3(q, k, v, cache, meta, scale: float):
    """vLLM's attention of the step (KV store, then FlashAttention 3 varlen over the paged
    cache), or None where vLLM's package is not importable."""
    try:
        from vllm import _custom_ops as ops
        from vllm.vllm_flash_attn import flash_attn_varlen_func
    except Exception as e:  # noqa: BLE001
        print("vLLM's attention not timed:", type(e).__name__, str(e)[:200], flush=True)
        return None
    kc, vc = cache[0], cache[1]
    one = torch.ones((), device="cuda", dtype=torch.float32)
    out = torch.empty_like(q)

    def run():
        ops.reshape_and_cache_flash(k, v, kc, vc, meta.slot_mapping, "auto", one, one)
        flash_attn_varlen_func(q, kc, vc, max_seqlen_q=meta.max_seqlen_q, cu_seqlens_q=meta.query_start_loc,
                               max_seqlen_k=meta.max_seqlen_k, seqused_k=meta.seq_lens, softmax_scale=scale,
                               causal=True, block_table=meta.block_tables, out=out, fa_version=3)
        return out
    return run


def run_case(name: str, seqs, keep=()) -> dict:
    q, k, v, cache, meta = step(seqs)
    decode = all(ql == 1 for ql, _ in seqs)
    mixed = not decode and any(ql == 1 for ql, _ in seqs)
    long_m = 128 if max(ql for ql, _ in seqs) * (H // KVH) >= 512 else 64
    tokens = meta.num_tokens
    row = {"case": name, "tokens": tokens, "seqs": len(seqs), "us": {}, "bits_differ": []}
    refs: dict[tuple, torch.Tensor] = {}  # (block_n, softmax) -> the first variant's output
    own = attention_plan.short_launch_config
    for key, kw, short in variants(mixed, decode, long_m):
        if keep and not any(x in key for x in keep):
            continue
        attention_plan.short_launch_config = (lambda p, loop="nested", comb="auto": short) if short else own
        try:
            fn = lambda: attention_triton_paged(q, k, v, cache, meta, 0.088, **kw)  # noqa: E731
            y = fn().clone()
            row["us"][key] = bench(fn, 50) * 1e3
        except Exception as e:  # noqa: BLE001
            row["us"][key] = f"error: {type(e).__name__}: {str(e)[:200]}"
            continue
        finally:
            attention_plan.short_launch_config = own
        if not torch.equal(y, refs.setdefault((kw["block_n"], kw.get("softmax", "exp")), y)):
            row["bits_differ"].append(key)
    ok = {c: t for c, t in row["us"].items() if isinstance(t, float)}
    ref = fa3(q, k, v, cache, meta, 0.088)
    if ref is not None:
        try:
            ref()
            row["vllm_fa3_us"] = bench(ref, 50) * 1e3
        except Exception as e:  # noqa: BLE001
            row["vllm_fa3_us"] = f"error: {type(e).__name__}: {str(e)[:200]}"
        print(f"   vLLM (KV store + FA3): {row['vllm_fa3_us']}", flush=True)
    first = next(iter(ok))
    row["baseline"], row["baseline_us"] = first, ok[first]
    row["best"] = min((c for c in ok if not c.startswith("n128")), key=ok.get)
    row["best_n128"] = min((c for c in ok if c.startswith("n128")), key=ok.get, default=None)
    print(f"{name} ({tokens} tokens): baseline {first} {ok[first]:.1f} us | best {row['best']} "
          f"{ok[row['best']]:.1f} | n128 best {row['best_n128']} {ok.get(row['best_n128'], -1):.1f} "
          f"| differ {row['bits_differ']}", flush=True)
    print("   " + ", ".join(f"{c} {t:.1f}" for c, t in sorted(ok.items(), key=lambda x: x[1])[:8]), flush=True)
    del q, k, v, cache, meta
    torch.cuda.empty_cache()
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="attn_mixed.json")
    ap.add_argument("--only", default="", help="comma-separated case-name prefixes")
    ap.add_argument("--variants", default="",
                    help="comma-separated substrings: only the variants whose key holds one (each case's first "
                         "variant is its baseline; e.g. 'm128_w8_st2,overlap,_par')")
    ap.add_argument("--vllm-path", default="", help="where the vLLM peer is installed (e.g. /tmp/vsite): also time "
                                                    "vLLM's attention on each step")
    a = ap.parse_args()
    if a.vllm_path:
        sys.path.insert(0, a.vllm_path)
    only = [x for x in a.only.split(",") if x]
    res = []
    for n, s in cases():
        if not only or any(n.startswith(o) for o in only):
            res.append(run_case(n, s, tuple(x for x in a.variants.split(",") if x)))
            with open(a.out, "w") as f:  # after every case: a later crash keeps the earlier ones
                json.dump({"device": torch.cuda.get_device_name(), "results": res}, f, indent=1)


if __name__ == "__main__":
    main()
