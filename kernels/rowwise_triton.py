"""Row-wise kernels in Triton: RMSNorm (+ fused residual add), RoPE
(rotate-half), SiLU-and-mul, log-softmax, and the KV-cache store.

One program per row (token), one fixed block shape per call site: a row's
reductions (the RMS mean, the log-softmax max and sum) run over the same
tile in the same order whatever else is in the batch, so these are
batch-invariant by construction. The one exception is the norm of narrow rows
(Qwen3's 128-wide heads): several rows per program, a count fixed by the width.
Each kernel has a launcher (checks) and a pure-torch reference (`*_reference`)
that the tests compare against.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from detent.kernels.common_triton import (check_device, check_dtype, check_last_contiguous, empty,
                                          empty_like, lazy_jit)
from detent.kernels.registry import register

# --------------------------------------------------------------------- norm


@lazy_jit
def _rms_norm_kernel(x_ptr, r_ptr, w_ptr, y_ptr, ro_ptr, eps, H, NH, sx, sx1, sr, sy, sro,
                     HAS_RES: tl.constexpr, BLOCK: tl.constexpr):
    """Row `row` of x is x[row // NH, row % NH] (strides sx, sx1): a [T, NH, D]
    view normalises each head in place of a copy (Qwen3's q/k norm reads the
    heads straight out of the fused qkv output). NH = 1 for [rows, H]."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + (row // NH) * sx + (row % NH) * sx1 + cols, mask=mask, other=0.0)
    if HAS_RES:
        r = tl.load(r_ptr + row * sr + cols, mask=mask, other=0.0)
        x = x + r  # in the activation dtype, as the torch path does
        tl.store(ro_ptr + row * sro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / H
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    y = (w.to(tl.float32) * normed.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * sy + cols, y, mask=mask)


@lazy_jit
def _rms_norm_rows_kernel(x_ptr, w_ptr, y_ptr, eps, H, NH, n_rows, sx, sx1, sy,
                          BLOCK: tl.constexpr, ROWS: tl.constexpr):
    """`_rms_norm_kernel` without the residual, ROWS rows per program: for narrow rows (Qwen3's
    q/k norm: 128 wide, T x 32 rows), where one program per row spends its time on launch and
    scheduling. ROWS follows the width only, so a row's place in a program does not follow the
    batch; every row's reduction runs over the same tile layout (tests/gpu/test_gpu_rowwise.py
    checks every offset)."""
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (rows < n_rows)[:, None] & (cols < H)[None, :]
    base = (rows // NH) * sx + (rows % NH) * sx1
    x = tl.load(x_ptr + base[:, None] + cols[None, :], mask=mask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / H
    normed = (xf * tl.rsqrt(var + eps)[:, None]).to(x.dtype)
    w = tl.load(w_ptr + cols, mask=cols < H, other=0.0)
    y = (w.to(tl.float32)[None, :] * normed.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + rows[:, None] * sy + cols[None, :], y, mask=mask)


# rows per program of the residual-free norm, by width: one program per row at 1,024 and
# wider (every norm of a layer), 2,048 elements per program below (the heads' q/k norm)
def norm_rows(width: int) -> int:
    block = triton.next_power_of_2(width)
    return 1 if block >= 1024 else 2048 // block


@register("norm", "triton_rowwise", devices=("cuda",))
def rms_norm_triton(x: torch.Tensor, w: torch.Tensor, eps: float, residual: torch.Tensor | None):
    name = "norm/triton_rowwise"
    check_device(name, x, w, residual)
    check_dtype(name, "x", x)
    h = x.shape[-1]
    if w.shape != (h,):
        raise ValueError(f"{name}: weight must be [{h}], got {tuple(w.shape)}")
    if w.dtype != x.dtype:
        raise TypeError(f"{name}: weight dtype {w.dtype} != x dtype {x.dtype}")
    check_last_contiguous(name, "x", x)
    if x.dim() == 3 and residual is None:  # [T, NH, D], any strides on T and NH: no copy
        x2, nh, sx, sx1 = x, x.shape[1], x.stride(0), x.stride(1)
        y = empty((x.shape[0] * nh, h), x.dtype, x.device)
    else:
        x2 = x.reshape(-1, h)
        nh, sx, sx1 = 1, x2.stride(0), 0
        y = empty_like(x2)
    r2 = ro = None
    if residual is not None:
        if residual.shape != x.shape or residual.dtype != x.dtype:
            raise ValueError(f"{name}: residual must match x ({tuple(x.shape)} {x.dtype}), got "
                             f"{tuple(residual.shape)} {residual.dtype}")
        r2 = residual.reshape(-1, h)
        check_last_contiguous(name, "residual", r2)
        ro = empty_like(x2)
    rows = y.shape[0]
    per = norm_rows(h)
    if rows and residual is None and per > 1:
        _rms_norm_rows_kernel[(triton.cdiv(rows, per),)](
            x2, w, y, float(eps), h, nh, rows, sx, sx1, y.stride(0),
            BLOCK=triton.next_power_of_2(h), ROWS=per, num_warps=4)
    elif rows:
        _rms_norm_kernel[(rows,)](
            x2, r2 if r2 is not None else x2, w, y, ro if ro is not None else y, float(eps), h, nh,
            sx, sx1, r2.stride(0) if r2 is not None else 0, y.stride(0),
            ro.stride(0) if ro is not None else 0,
            HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(h),
            num_warps=_warps(h))
    y = y.view(x.shape)
    return y if residual is None else (y, ro.view(x.shape))


def rms_norm_reference(x, w, eps, residual):
    if residual is not None:
        x = x + residual
        residual = x
    xf = x.double()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    y = (w.double() * normed.double()).to(x.dtype)
    return y if residual is None else (y, residual)


def _warps(width: int) -> int:
    return 4 if width <= 2048 else 8 if width <= 8192 else 16

# --------------------------------------------------------------------- rope


@lazy_jit
def _rope_kernel(q_ptr, k_ptr, qo_ptr, ko_ptr, pos_ptr, cs_ptr,
                 sq_t, sq_h, sk_t, sk_h, sqo_t, sqo_h, sko_t, sko_h, scs,
                 HQ, HK, HALF: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * scs + d)[None, :]  # [1, D/2] fp32
    sin = tl.load(cs_ptr + pos * scs + HALF + d)[None, :]
    hh = tl.arange(0, BLOCK_H)
    for which in tl.static_range(2):
        if which == 0:
            src, dst, s_t, s_h, so_t, so_h, nh = q_ptr, qo_ptr, sq_t, sq_h, sqo_t, sqo_h, HQ
        else:
            src, dst, s_t, s_h, so_t, so_h, nh = k_ptr, ko_ptr, sk_t, sk_h, sko_t, sko_h, HK
        for h0 in range(0, nh, BLOCK_H):
            h = h0 + hh
            m = (h < nh)[:, None]
            base = src + t * s_t + h[:, None] * s_h + d[None, :]
            x1 = tl.load(base, mask=m, other=0.0)
            x2 = tl.load(base + HALF, mask=m, other=0.0)
            f1 = x1.to(tl.float32)
            f2 = x2.to(tl.float32)
            o1 = f1 * cos - f2 * sin
            o2 = f2 * cos + f1 * sin
            obase = dst + t * so_t + h[:, None] * so_h + d[None, :]
            tl.store(obase, o1.to(x1.dtype), mask=m)
            tl.store(obase + HALF, o2.to(x1.dtype), mask=m)


@register("rope", "triton_rowwise", devices=("cuda",))
def rope_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor):
    name = "rope/triton_rowwise"
    check_device(name, q, k, positions, cos_sin)
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(f"{name}: q must be [T, H, D] and k [T, KVH, D], got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}")
    t, hq, d = q.shape
    if d % 2 or (d // 2) & (d // 2 - 1):
        raise ValueError(f"{name}: head_dim {d} must be twice a power of two")
    if positions.shape != (t,) or positions.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: positions must be [{t}] int32/int64, got "
                         f"{tuple(positions.shape)} {positions.dtype}")
    if cos_sin.dim() != 2 or cos_sin.shape[1] != d or cos_sin.dtype != torch.float32:
        raise ValueError(f"{name}: cos_sin must be [max_pos, {d}] float32, got "
                         f"{tuple(cos_sin.shape)} {cos_sin.dtype}")
    check_dtype(name, "q", q)
    if k.dtype != q.dtype:
        raise TypeError(f"{name}: k dtype {k.dtype} != q dtype {q.dtype}")
    for f, x in (("q", q), ("k", k), ("cos_sin", cos_sin)):
        check_last_contiguous(name, f, x)
    qo, ko = empty_like(q), empty_like(k)
    if t:
        _rope_kernel[(t,)](q, k, qo, ko, positions, cos_sin,
                           q.stride(0), q.stride(1), k.stride(0), k.stride(1),
                           qo.stride(0), qo.stride(1), ko.stride(0), ko.stride(1), cos_sin.stride(0),
                           hq, k.shape[1], HALF=d // 2, BLOCK_H=min(16, triton.next_power_of_2(hq)),
                           num_warps=4)
    return qo, ko


def rope_reference(q, k, positions, cos_sin):
    half = q.shape[-1] // 2
    cs = cos_sin.index_select(0, positions.long()).double()
    cos, sin = cs[:, None, :half], cs[:, None, half:]

    def rot(x):
        xf = x.double()
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
    return rot(q), rot(k)

# ---------------------------------------------------------------------- act


@lazy_jit
def _silu_mul_kernel(x_ptr, y_ptr, I, sx, sy, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    g = tl.load(x_ptr + row * sx + cols, mask=mask, other=0.0)
    u = tl.load(x_ptr + row * sx + I + cols, mask=mask, other=0.0)
    gf = g.to(tl.float32)
    s = (gf / (1.0 + tl.exp(-gf))).to(g.dtype)  # silu rounded to the dtype, as torch does
    y = (s.to(tl.float32) * u.to(tl.float32)).to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + row * sy + cols, y, mask=mask)


@register("act", "triton_rowwise", devices=("cuda",))
def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    name = "act/triton_rowwise"
    check_device(name, x)
    check_dtype(name, "x", x)
    if x.shape[-1] % 2:
        raise ValueError(f"{name}: last dimension {x.shape[-1]} must be even ([gate | up])")
    i = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * i)
    check_last_contiguous(name, "x", x2)
    y = empty((x2.shape[0], i), x.dtype, x.device)
    if x2.shape[0]:
        block = min(1024, triton.next_power_of_2(i))
        _silu_mul_kernel[(x2.shape[0], triton.cdiv(i, block))](x2, y, i, x2.stride(0), y.stride(0),
                                                               BLOCK=block, num_warps=4)
    return y.view(*x.shape[:-1], i)


def silu_and_mul_reference(x):
    i = x.shape[-1] // 2
    g = x[..., :i].double()
    return ((g / (1 + torch.exp(-g))).to(x.dtype).double() * x[..., i:].double()).to(x.dtype)

# --------------------------------------------------------------- logsoftmax


@lazy_jit
def _log_softmax_kernel(x_ptr, y_ptr, V, sx, sy, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = tl.full((BLOCK,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK,), tl.float32)
    for v0 in range(0, V, BLOCK):  # lane-wise online max/sum, fixed order
        c = v0 + cols
        x = tl.load(x_ptr + row * sx + c, mask=c < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.exp(x - m_safe)
        m = m_new
    mx = tl.max(m, axis=0)
    total = tl.sum(s * tl.exp(m - mx), axis=0)
    lse = mx + tl.log(total)
    for v0 in range(0, V, BLOCK):
        c = v0 + cols
        x = tl.load(x_ptr + row * sx + c, mask=c < V, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * sy + c, x - lse, mask=c < V)


@register("logsoftmax", "triton_rowwise", devices=("cuda",))
def log_softmax_triton(logits: torch.Tensor) -> torch.Tensor:
    name = "logsoftmax/triton_rowwise"
    check_device(name, logits)
    check_dtype(name, "logits", logits)
    if logits.dim() != 2:
        raise ValueError(f"{name}: logits must be [R, V], got {tuple(logits.shape)}")
    check_last_contiguous(name, "logits", logits)
    r, v = logits.shape
    y = empty((r, v), torch.float32, logits.device)
    if r:
        _log_softmax_kernel[(r,)](logits, y, v, logits.stride(0), y.stride(0),
                                  BLOCK=min(4096, triton.next_power_of_2(v)), num_warps=8)
    return y


def log_softmax_reference(logits):
    return torch.log_softmax(logits.double(), dim=-1).float()

# ----------------------------------------------------------------- store kv


@lazy_jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, KVH, sk_t, sk_h, sv_t, sv_h,
                     sc_blk, sc_off, sc_h, BLOCK_SIZE: tl.constexpr, D: tl.constexpr,
                     BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:  # slot -1: a padded token (CUDA-graph padding) writes nothing
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, D)
        m = (h < KVH)[:, None]
        kx = tl.load(k_ptr + t * sk_t + h[:, None] * sk_h + d[None, :], mask=m)
        vx = tl.load(v_ptr + t * sv_t + h[:, None] * sv_h + d[None, :], mask=m)
        dst = blk * sc_blk + off * sc_off + h[:, None] * sc_h + d[None, :]
        tl.store(kc_ptr + dst, kx.to(kc_ptr.dtype.element_ty), mask=m)
        tl.store(vc_ptr + dst, vx.to(vc_ptr.dtype.element_ty), mask=m)


def store_kv_triton(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """kv_cache: [2, num_blocks, block_size, KVH, D]; k, v: [T, KVH, D];
    slot_mapping: [T] (block_id * block_size + offset; negative = skip)."""
    name = "store_kv/triton"
    check_device(name, k, v, kv_cache, slot_mapping)
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"{name}: kv_cache must be [2, num_blocks, block_size, KVH, D], got "
                         f"{tuple(kv_cache.shape)}")
    _, nb, bs, kvh, d = kv_cache.shape
    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (kvh, d):
        raise ValueError(f"{name}: k, v must be [T, {kvh}, {d}], got {tuple(k.shape)}, {tuple(v.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"{name}: slot_mapping must be [{k.shape[0]}], got {tuple(slot_mapping.shape)}")
    if d & (d - 1):
        raise ValueError(f"{name}: head_dim {d} must be a power of two")
    for f, x in (("k", k), ("v", v), ("kv_cache", kv_cache)):
        check_last_contiguous(name, f, x)
    t = k.shape[0]
    if t:
        kc, vc = kv_cache[0], kv_cache[1]
        _store_kv_kernel[(t,)](k, v, kc, vc, slot_mapping, kvh, k.stride(0), k.stride(1),
                               v.stride(0), v.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
                               BLOCK_SIZE=bs, D=d, BLOCK_H=triton.next_power_of_2(kvh), num_warps=4)


def store_kv_reference(k, v, kv_cache, slot_mapping):
    keep = slot_mapping >= 0
    _, nb, bs, kvh, d = kv_cache.shape
    s = slot_mapping[keep].long()
    kv_cache[0].view(nb * bs, kvh, d).index_copy_(0, s, k[keep].to(kv_cache.dtype))
    kv_cache[1].view(nb * bs, kvh, d).index_copy_(0, s, v[keep].to(kv_cache.dtype))


__all__ = ["rms_norm_triton", "rope_triton", "silu_and_mul_triton", "log_softmax_triton",
           "store_kv_triton", "rms_norm_reference", "rope_reference", "silu_and_mul_reference",
           "log_softmax_reference", "store_kv_reference"]
