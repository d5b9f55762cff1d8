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
tile config comes from a tuned table keyed by token count: `row_key` picks
the row (stock: the row nearest the batch's token count; pinned: one row).
The alignment is integer work on the device (no host sync, graph-safe).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from detent.kernels.common_triton import check_device, check_dtype, empty, lazy_jit
from detent.kernels.rowwise_triton import silu_and_mul_triton
from detent.selection.registry import register

# token count the row is tuned for -> config (SGLang's fused_moe table shape);
# row_key is one of these keys, unless the selection passes the tile itself
MOE_CONFIGS: dict[int, dict] = {
    16: dict(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4),
    128: dict(block_m=32, block_n=64, block_k=128, group_m=8, num_warps=4, num_stages=4),
    1024: dict(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=3),
    4096: dict(block_m=128, block_n=128, block_k=64, group_m=16, num_warps=8, num_stages=3),
}


def nearest_row_key(num_tokens: int) -> int:
    """Stock selection: the table row whose token count is nearest (ties: the smaller)."""
    return min(MOE_CONFIGS, key=lambda key: (abs(key - num_tokens), key))


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
    max_blocks = (r + num_experts * (block_m - 1)) // block_m
    rows = torch.full((max_blocks * block_m,), r, dtype=torch.int32, device=flat.device)
    rows[dest] = order.to(torch.int32)
    blk_start = torch.arange(max_blocks, device=flat.device) * block_m  # [B]
    ends = torch.cumsum(padded, 0)  # [E]
    blk_expert = torch.searchsorted(ends, blk_start, right=True).to(torch.int32)
    blk_expert = torch.where(blk_start < ends[-1], blk_expert, torch.full_like(blk_expert, -1))
    return rows, blk_expert


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


def _config(name: str, row_key: int, tile: dict) -> dict:
    given = {k: v for k, v in tile.items() if v is not None}
    if not given:
        if row_key not in MOE_CONFIGS:
            raise ValueError(f"{name}: row_key={row_key} is not a row of the config table "
                             f"(token counts {sorted(MOE_CONFIGS)}); or pass the tile itself")
        return MOE_CONFIGS[row_key]
    missing = [k for k in ("block_m", "block_n", "block_k") if k not in given]
    if missing:
        raise ValueError(f"{name}: a tile config needs block_m, block_n and block_k; missing {missing}")
    for k in ("block_m", "block_n", "block_k"):
        v = given[k]
        if v < 16 or v & (v - 1):
            raise ValueError(f"{name}: {k}={v} must be a power of two >= 16")
    return {"group_m": 1, "num_warps": 4, "num_stages": 3, **given}


@register("moe", "triton_fused", params=("row_key",) + TILE_PARAMS, devices=("cuda",))
def moe_triton_fused(x, router_logits, w13, w2, top_k: int, renormalize: bool, row_key: int = 16,
                     block_m: int | None = None, block_n: int | None = None, block_k: int | None = None,
                     group_m: int | None = None, num_warps: int | None = None,
                     num_stages: int | None = None):
    """row_key: the config-table row (a token count) the selection chose; the
    tile parameters, when given, override that row's config (a SelIR program
    with its own table passes both)."""
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
    cfg = _config(name, row_key, dict(block_m=block_m, block_n=block_n, block_k=block_k, group_m=group_m,
                                      num_warps=num_warps, num_stages=num_stages))
    if not 1 <= top_k <= ne:
        raise ValueError(f"{name}: top_k={top_k} must be in 1..{ne}")
    for f, t in (("x", x), ("w13", w13), ("w2", w2)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: {f} must have a contiguous last dimension")
    if m == 0:
        return x.new_empty(0, hdim)
    topw, topi = route(router_logits, top_k, renormalize, x.dtype)
    rows, blk_expert = align(topi, ne, cfg["block_m"])
    r = m * top_k
    h = _grouped_gemm(x, w13, rows, blk_expert, r, top_k, cfg)  # [M*k, 2I]
    a = silu_and_mul_triton(h)  # [M*k, I]
    y = _grouped_gemm(a, w2, rows, blk_expert, r, 1, cfg).view(m, top_k, hdim)
    y = y * topw[..., None]  # [M, k, H], in the activation dtype
    out = y[:, 0]
    for s in range(1, top_k):  # fixed slot order
        out = out + y[:, s]
    return out


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
    y = y * topw[..., None]
    out = y[:, 0]
    for s in range(1, top_k):
        out = out + y[:, s]
    return out


__all__ = ["moe_triton_fused", "moe_reference", "MOE_CONFIGS", "nearest_row_key", "align", "route"]
