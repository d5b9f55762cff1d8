"""Fused mixture-of-experts in Triton: token -> expert alignment, then two
grouped GEMMs (w13, then w2) over expert-sorted row blocks.

    routing   softmax(router_logits) in fp32, top-k, optional renormalisation
    align     the M*k (token, slot) rows sorted by expert (stable), each
              expert's rows padded to BLOCK_M; one expert per row block
    gemm1     h[r] = x[token(r)] @ w13[e].T             [M*k, 2I]
    act       silu(gate) * up                            [M*k, I]
    gemm2     y[r] = act[r] @ w2[e].T                    [M*k, H]
    combine   out[t] = sum over slots s = 0..k-1, in order, of y[t, s] * w[t, s]

A row's GEMMs reduce over K in ascending BLOCK_K steps inside one program;
the block it lands in and its neighbours never enter its arithmetic. The
tile config is a parameter: the selection passes a row of the tuned table in
selection/programs/moe.py (GPU_CONFIGS).
The alignment is integer work on the device (no host sync, graph-safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from detent.kernels.common_triton import check_device, check_dtype, empty, lazy_jit
from detent.kernels.rowwise_triton import silu_and_mul_triton
from detent.kernels.registry import register


@lazy_jit(do_not_specialize=["R", "NUM_BLK"])
def _grouped_gemm_kernel(a_ptr, w_ptr, c_ptr, rows_ptr, blk_expert_ptr, R, N, K, TOPK_DIV, NUM_BLK,
                         sa, swe, swn, sc,
                         IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    """c[r] = a[r // TOPK_DIV] @ w[e].T for the rows r of one expert block.
    Programs walk (row block, N tile) in GROUP_M-row-block groups (L2 reuse of
    w tiles); the order does not enter any row's arithmetic."""
    pid = tl.program_id(0)
    num_n = tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * num_n)
    first = group * GROUP_M
    size = tl.minimum(NUM_BLK - first, GROUP_M)
    blk = first + (pid % size)
    pid_n = (pid % (GROUP_M * num_n)) // size
    e = tl.load(blk_expert_ptr + blk)
    if e >= 0:
        rows = tl.load(rows_ptr + blk * BLOCK_M + tl.arange(0, BLOCK_M))
        row_ok = rows < R
        src = (rows // TOPK_DIV).to(tl.int64)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < N
        rk = tl.arange(0, BLOCK_K)
        wbase = w_ptr + e.to(tl.int64) * swe
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            k_ok = kk < K
            a = tl.load(a_ptr + src[:, None] * sa + kk[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(wbase + rn[None, :] * swn + kk[:, None], mask=n_ok[None, :] & k_ok[:, None], other=0.0)
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        tl.store(c_ptr + rows.to(tl.int64)[:, None] * sc + rn[None, :], acc.to(c_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & n_ok[None, :])


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype):
    probs = torch.softmax(router_logits.float(), dim=-1)
    topw, topi = torch.topk(probs, top_k, dim=-1)  # [M, k]
    if renormalize:
        topw = topw / topw.sum(-1, keepdim=True)
    return topw.to(dtype), topi


@lazy_jit
def _route_kernel(logits_ptr, topw_ptr, topi_ptr, E, stride, TOPK: tl.constexpr, TOPK_PAD: tl.constexpr,
                  E_PAD: tl.constexpr, RENORM: tl.constexpr):
    """`route` for one token in one program: fp32 softmax over the experts,
    the top k by repeated maximum (ties: the lowest expert id), optional
    renormalisation. A row's result depends on its logits only."""
    t = tl.program_id(0).to(tl.int64)
    ev = tl.arange(0, E_PAD)
    kv = tl.arange(0, TOPK_PAD)
    x = tl.load(logits_ptr + t * stride + ev, mask=ev < E, other=float("-inf")).to(tl.float32)
    p = tl.exp(x - tl.max(x, 0))
    p = p / tl.sum(p, 0)
    left = tl.where(ev < E, p, -1.0)
    ws = tl.zeros([TOPK_PAD], dtype=tl.float32)
    ids = tl.zeros([TOPK_PAD], dtype=tl.int64)
    for s in tl.static_range(TOPK):
        best = tl.max(left, 0)
        idx = tl.min(tl.where(left == best, ev, E_PAD), 0)
        ws = tl.where(kv == s, best, ws)
        ids = tl.where(kv == s, idx.to(tl.int64), ids)
        left = tl.where(ev == idx, -1.0, left)
    if RENORM:
        ws = ws / tl.sum(ws, 0)
    tl.store(topw_ptr + t * TOPK + kv, ws.to(topw_ptr.dtype.element_ty), mask=kv < TOPK)
    tl.store(topi_ptr + t * TOPK + kv, ids, mask=kv < TOPK)


def route_fused(router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype):
    """`route` in one launch: the same definition, but its own softmax and sums,
    so the weights' low bits differ from `route`'s (each row's still depend
    on that row alone)."""
    router_logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    m, e = router_logits.shape
    topw = empty((m, top_k), dtype, router_logits.device)
    topi = torch.empty((m, top_k), dtype=torch.long, device=router_logits.device)
    if m:
        _route_kernel[(m,)](router_logits, topw, topi, e, router_logits.stride(0), TOPK=top_k,
                            TOPK_PAD=triton.next_power_of_2(top_k), E_PAD=triton.next_power_of_2(e),
                            RENORM=bool(renormalize), num_warps=1 if e <= 256 else 4)
    return topw, topi


def max_row_blocks(rows: int, num_experts: int, block_m: int) -> int:
    """How many row blocks the alignment can need, from sizes alone (the grid
    must not depend on the routing). An expert with c > 0 rows takes
    ceil(c / block_m) <= c blocks, so never more than `rows` in all; nor more
    than (rows + E (block_m - 1)) / block_m. At decode the first bound is
    the small one (8 blocks instead of 120 for one token, top-8 of 128):
    fewer programs that only find an empty block and exit."""
    return min(rows, (rows + num_experts * (block_m - 1)) // block_m)


def align(topi: torch.Tensor, num_experts: int, block_m: int):
    """Rows (t * k + s) sorted by expert, each expert padded to block_m with
    the sentinel R = M*k; and each row block's expert (-1: unused block).
    Sizes depend only on (M, k, E, block_m), so the grid is static."""
    r = topi.numel()
    flat = topi.reshape(-1)
    order = torch.sort(flat, stable=True).indices  # rows grouped by expert, ascending row order
    # [E] per-expert row counts (scatter_add, not bincount: bincount sizes its
    # output from the data, a host sync that CUDA-graph capture refuses)
    counts = torch.zeros(num_experts, dtype=torch.long, device=flat.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_start = torch.cumsum(padded, 0) - padded  # exclusive
    start = torch.cumsum(counts, 0) - counts
    e_sorted = flat[order]
    dest = pad_start[e_sorted] + torch.arange(r, device=flat.device) - start[e_sorted]
    max_blocks = max_row_blocks(r, num_experts, block_m)
    rows = torch.full((max_blocks * block_m,), r, dtype=torch.int32, device=flat.device)
    rows[dest] = order.to(torch.int32)
    blk_start = torch.arange(max_blocks, device=flat.device) * block_m  # [B]
    ends = torch.cumsum(padded, 0)  # [E]
    blk_expert = torch.searchsorted(ends, blk_start, right=True).to(torch.int32)
    blk_expert = torch.where(blk_start < ends[-1], blk_expert, torch.full_like(blk_expert, -1))
    return rows, blk_expert


@lazy_jit(do_not_specialize=["R"])
def _align_count_kernel(ids_ptr, hist_ptr, R, E_PAD: tl.constexpr, CH: tl.constexpr):
    """Each program's CH rows counted per expert: hist[p, e] (the prefill path of `_align_kernel`)."""
    p = tl.program_id(0)
    idx = p * CH + tl.arange(0, CH)
    counts = tl.histogram(tl.load(ids_ptr + idx, mask=idx < R, other=0).to(tl.int32), E_PAD, mask=idx < R)
    tl.store(hist_ptr + p * E_PAD + tl.arange(0, E_PAD), counts)


@lazy_jit(do_not_specialize=["R", "NUM_BLK"])
def _align_kernel(ids_ptr, hist_ptr, rows_ptr, blk_expert_ptr, R, NUM_BLK, HCH: tl.constexpr, E_PAD: tl.constexpr,
                  BLOCK_M: tl.constexpr, CH: tl.constexpr, SUB: tl.constexpr, COUNTED: tl.constexpr):
    """`align` with no program waiting on another. Every program counts all
    rows per expert (padded starts, ends) and the rows of each expert before
    its own CH rows, then places those rows SUB at a time: a row goes to its
    expert's start + that expert's earlier rows + those before it in its SUB
    (the stable order of `align`'s sort). It also takes CH row blocks: each
    gets the expert whose padded range holds it, or -1 past the end. The
    sentinel R fills each expert's padding (program 0) and the blocks past
    the end. Real, padding and tail slots are disjoint, so the stores never
    race: the same integers as `align`. COUNTED: the counts come from
    `_align_count_kernel`'s per-program histograms (hist, launched before) instead
    of every program reading every row (at 8,192 tokens, top-8: 128 programs
    reading 65,536 ids each)."""
    p = tl.program_id(0)
    first = p * CH
    ev = tl.arange(0, E_PAD)
    counts = tl.zeros([E_PAD], dtype=tl.int32)
    base = tl.zeros([E_PAD], dtype=tl.int32)  # rows before this program's, per expert
    if COUNTED:
        for c0 in range(0, tl.cdiv(R, CH), 16):
            ci = c0 + tl.arange(0, 16)
            h = tl.load(hist_ptr + ci[:, None] * E_PAD + ev[None, :], mask=(ci < tl.cdiv(R, CH))[:, None], other=0)
            counts += tl.sum(h, axis=0)
            base += tl.sum(tl.where((ci < p)[:, None], h, 0), axis=0)
    else:
        for c0 in range(0, R, HCH):
            idx = c0 + tl.arange(0, HCH)
            ids = tl.load(ids_ptr + idx, mask=idx < R, other=0).to(tl.int32)
            counts += tl.histogram(ids, E_PAD, mask=idx < R)
            base += tl.histogram(ids, E_PAD, mask=(idx < R) & (idx < first))
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)  # inclusive
    total = tl.sum(padded, 0)
    base += ends - padded
    lane = tl.arange(0, SUB)
    earlier = lane[None, :] < lane[:, None]  # [SUB, SUB]: column j is an earlier row than row i
    for s0 in range(0, CH, SUB):
        i = first + s0 + lane
        ok = i < R
        e = tl.load(ids_ptr + i, mask=ok, other=0).to(tl.int32)
        rank = tl.sum(((e[:, None] == e[None, :]) & earlier).to(tl.int32), axis=1)
        dest = tl.sum(tl.where(e[:, None] == ev[None, :], base[None, :], 0), axis=1) + rank
        tl.store(rows_ptr + dest, i, mask=ok)
        base += tl.histogram(e, E_PAD, mask=ok)
    slot = tl.arange(0, BLOCK_M)
    for s0 in range(0, CH, SUB):  # row blocks: searchsorted(ends, start, right=True), -1 past the end
        b = first + s0 + lane
        start = b * BLOCK_M
        n_before = tl.sum((ends[None, :] <= start[:, None]).to(tl.int32), axis=1)
        tl.store(blk_expert_ptr + b, tl.where(start < total, n_before, -1), mask=b < NUM_BLK)
        tail = start[:, None] + slot[None, :]
        tl.store(rows_ptr + tail, R, mask=(b < NUM_BLK)[:, None] & (tail >= total))
    if p == 0:  # each expert's padding after its rows
        pad = (ends - padded + counts)[:, None] + slot[None, :]
        tl.store(rows_ptr + pad, R, mask=pad < ends[:, None])


def align_fused(topi: torch.Tensor, num_experts: int, block_m: int):
    """`align`'s result from one kernel launch (about 25 small torch kernels
    otherwise, each a few microseconds on the device and more on the host).
    One program per 64 rows up to 4,096 rows, each counting every row; above,
    one per 512 rows after a launch that counts each program's rows once
    (prefill chunks)."""
    r = topi.numel()
    max_blocks = max_row_blocks(r, num_experts, block_m)
    rows = torch.empty(max_blocks * block_m, dtype=torch.int32, device=topi.device)
    blk_expert = torch.empty(max_blocks, dtype=torch.int32, device=topi.device)
    if r == 0:
        return rows, blk_expert
    const = align_constexprs(r, num_experts, block_m)
    ids = topi.reshape(-1)
    hist = rows  # not read unless counted
    if const["COUNTED"]:
        hist = torch.empty((triton.cdiv(r, const["CH"]), const["E_PAD"]), dtype=torch.int32, device=topi.device)
        _align_count_kernel[(hist.shape[0],)](ids, hist, r, E_PAD=const["E_PAD"], CH=const["CH"], num_warps=4)
    _align_kernel[(triton.cdiv(max(r, max_blocks), const["CH"]),)](
        ids, hist, rows, blk_expert, r, max_blocks, **const, num_warps=4)
    return rows, blk_expert


def align_constexprs(rows: int, num_experts: int, block_m: int) -> dict:
    """`_align_kernel`'s constexprs for `rows` (tokens x top_k) > 0: each distinct value is
    its own compile, which the step's size decides (`step_variants`)."""
    r_pad = triton.next_power_of_2(rows)
    sub = min(64, r_pad)
    counted = rows > 4096
    return dict(HCH=min(r_pad, 4096), E_PAD=triton.next_power_of_2(num_experts), BLOCK_M=block_m,
                CH=512 if counted else sub, SUB=sub, COUNTED=counted)


def step_variants(selection: dict, *, query_lens, num_experts: int, top_k: int, **_step) -> set[tuple]:
    """The compiles an eager step of these query lengths needs from `selection` beyond what it
    fixes: the alignment's (`align_constexprs`, from the step's token count). The warm start
    runs a step for each (engine/warmup.py `probe_variants`): lease 31's tune profiled
    Qwen3-30B-A3B steps of more than 512 tokens eagerly and compiled the counted alignment
    then. The routing, combine and grouped GEMM launches take theirs from the selection."""
    if not selection.get("fuse_glue"):
        return set()
    rows = sum(query_lens) * top_k
    return {("align", *sorted(align_constexprs(rows, num_experts, selection["block_m"]).items()))} if rows else set()


@lazy_jit
def _combine_kernel(y_ptr, w_ptr, out_ptr, H, TOPK: tl.constexpr, BLOCK_H: tl.constexpr):
    """out[t] = y[t, 0] * w[t, 0] + y[t, 1] * w[t, 1] + ... in slot order, each
    product and each partial sum rounded to the activation dtype, as the
    torch expression `y * w[..., None]` then `out + y[:, s]` rounds them."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < H
    dt = out_ptr.dtype.element_ty
    w0 = tl.load(w_ptr + t * TOPK).to(tl.float32)
    acc = (tl.load(y_ptr + t * TOPK * H + h, mask=ok, other=0.0).to(tl.float32) * w0).to(dt)
    for s in tl.static_range(1, TOPK):
        ws = tl.load(w_ptr + t * TOPK + s).to(tl.float32)
        term = (tl.load(y_ptr + (t * TOPK + s) * H + h, mask=ok, other=0.0).to(tl.float32) * ws).to(dt)
        acc = (acc.to(tl.float32) + term.to(tl.float32)).to(dt)
    tl.store(out_ptr + t * H + h, acc, mask=ok)


def combine_fused(y: torch.Tensor, topw: torch.Tensor) -> torch.Tensor:
    """`combine` (y [M, k, H] weighted by topw [M, k], slots summed in order) in one launch."""
    y = y.contiguous()  # the kernel walks [M, k, H] rows
    m, k, hdim = y.shape
    out = empty((m, hdim), y.dtype, y.device)
    block_h = min(1024, triton.next_power_of_2(hdim))
    # no mul+add contraction into FMA: fp32 activations must round like torch's two ops
    _combine_kernel[(m, triton.cdiv(hdim, block_h))](y, topw.contiguous(), out, hdim, TOPK=k, BLOCK_H=block_h,
                                                    num_warps=4, enable_fp_fusion=False)
    return out


def combine(y: torch.Tensor, topw: torch.Tensor) -> torch.Tensor:
    """The slots of y [M, k, H] weighted by topw [M, k] and summed in slot order."""
    y = y * topw[..., None]  # [M, k, H], in the activation dtype
    out = y[:, 0]
    for s in range(1, y.shape[1]):  # fixed slot order
        out = out + y[:, s]
    return out


def _grouped_gemm(a, w, rows, blk_expert, r, topk_div, cfg):
    e, n, k = w.shape
    c = empty((r, n), a.dtype, a.device)
    bm, bn, bk = cfg["block_m"], cfg["block_n"], cfg["block_k"]
    nblk = blk_expert.numel()
    grid = (nblk * triton.cdiv(n, bn),)
    _grouped_gemm_kernel[grid](a, w, c, rows, blk_expert, r, n, k, topk_div, nblk,
                               a.stride(0), w.stride(0), w.stride(1), c.stride(0),
                               IEEE=a.dtype == torch.float32, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                               GROUP_M=cfg["group_m"], num_warps=cfg["num_warps"],
                               num_stages=cfg["num_stages"])
    return c


TILE_PARAMS = ("block_m", "block_n", "block_k", "group_m", "num_warps", "num_stages")


def _config(name: str, tile: dict) -> dict:
    given = {k: v for k, v in tile.items() if v is not None}
    missing = [k for k in ("block_m", "block_n", "block_k") if k not in given]
    if missing:
        raise ValueError(f"{name}: a tile config needs block_m, block_n and block_k; missing {missing} "
                         f"(the tuned rows: selection/programs/moe.py GPU_CONFIGS)")
    for k in ("block_m", "block_n", "block_k"):
        v = given[k]
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}: {k}={v} must be a power of two >= 16")
    return {"group_m": 1, "num_warps": 4, "num_stages": 3, **given}


@register("moe", "triton_fused", params=TILE_PARAMS + ("fuse_glue",), devices=("cuda",), variants=step_variants)
def moe_triton_fused(x, router_logits, w13, w2, top_k: int, renormalize: bool,
                     block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                     group_m: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None, fuse_glue: int = 0):
    """block_m, block_n, block_k (required), group_m, num_warps, num_stages:
    the tile, a row of selection/programs/moe.py's table. fuse_glue=1: the alignment and the
    slot combine run as one Triton launch each instead of ~30 small torch
    kernels; the same integers and the same roundings, so the same bits
    (tests/kernels under the interpreter, tests/gpu/test_gpu_moe.py on the
    H200). fuse_glue=2: the routing too (`route_fused`: one launch instead
    of six, its own softmax, so other low bits of the weights; still a
    per-row program). The SelIR program passes
    fuse_glue=2 on CUDA: Qwen3-30B-A3B decode on the H200 went from 6.94 to
    4.41 ms per step at batch 1 (docs/performance.md)."""
    name = "moe/triton_fused"
    check_device(name, x, router_logits, w13, w2)
    check_dtype(name, "x", x)
    if x.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"{name}: x must be [M, H], w13 [E, 2I, H], w2 [E, H, I]; got "
                         f"{tuple(x.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    m, hdim = x.shape
    ne, two_i, h13 = w13.shape
    if h13 != hdim or w2.shape != (ne, hdim, two_i // 2) or router_logits.shape != (m, ne):
        raise ValueError(f"{name}: shapes disagree: x {tuple(x.shape)}, router_logits "
                         f"{tuple(router_logits.shape)}, w13 {tuple(w13.shape)}, w2 {tuple(w2.shape)}")
    if w13.dtype != x.dtype or w2.dtype != x.dtype:
        raise TypeError(f"{name}: w13/w2 dtype ({w13.dtype}, {w2.dtype}) must equal x dtype {x.dtype}")
    cfg = _config(name, dict(block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m,
                                      num_warps=num_warps, num_stages=num_stages))
    if not 1 <= top_k <= ne:
        raise ValueError(f"{name}: top_k={top_k} must be in 1..{ne}")
    for f, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {f} must have a contiguous last dimension")
    if m == 0:
        return x.new_empty(0, hdim)
    topw, topi = (route_fused if fuse_glue >= 2 else route)(router_logits, top_k, renormalize, x.dtype)
    r = m * top_k
    rows, blk_expert = (align_fused if fuse_glue else align)(topi, ne, cfg["block_m"])
    h = _grouped_gemm(x, w13, rows, blk_expert, r, top_k, cfg)  # [M*k, 2I]
    a = silu_and_mul_triton(h)  # [M*k, I]
    y = _grouped_gemm(a, w2, rows, blk_expert, r, 1, cfg).view(m, top_k, hdim)
    return combine_fused(y, topw) if fuse_glue else combine(y, topw)


def moe_reference(x, router_logits, w13, w2, top_k, renormalize):
    """Pure torch: each (token, slot) through its expert, GEMMs in fp64."""
    topw, topi = route(router_logits, top_k, renormalize, x.dtype)
    m, hdim = x.shape
    i = w13.shape[1] // 2
    y = x.new_empty(m, top_k, hdim)
    for t in range(m):
        for s in range(top_k):
            e = int(topi[t, s])
            h = (x[t].double() @ w13[e].double().t()).to(x.dtype)
            g = h[:i].double()
            a = ((g / (1 + torch.exp(-g))).to(x.dtype).double() * h[i:].double()).to(x.dtype)
            y[t, s] = (a.double() @ w2[e].double().t()).to(x.dtype)
    return combine(y, topw)


__all__ = ["align", "align_constexprs", "align_fused", "combine", "combine_fused",
           "moe_reference", "moe_triton_fused", "route", "route_fused", "step_variants"]
