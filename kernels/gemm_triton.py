"""GEMM in Triton: a persistent matmul with one fixed tile config.

y[M, N] = x[M, K] @ w[N, K].T (+ bias), fp32 accumulator, K walked in
ascending BLOCK_K steps by one program (no split-K), no TF32 for fp32
inputs. A row's result depends only on that row of x, w, and the config:
the grid, the tile a row lands in and the other rows never enter its
arithmetic. The config is a selection parameter, read from the tuned table
in selection/programs/gemm.py; whether it is numerics-neutral on a device is a question for tests/gpu, not an
assumption here. Tiles reach the SM by pointer loads, or on Hopper by TMA
(`tma=1`, `_tma_matmul_kernel`): the same tile walk and dots, faster loads.
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from detent.kernels.common_triton import check_device, check_dtype, empty, lazy_jit, sms_for
from detent.kernels.registry import register


@triton.jit
def _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """(pid_m, pid_n) of a persistent program's `tile`, in grouped order over M
    so that neighbouring programs share w tiles in L2. Jitted at import, so
    compiled or interpreted as the process runs its kernels (TRITON_INTERPRET
    is set before triton is imported on CPU)."""
    group = tile // (GROUP_M * num_pid_n)
    first_m = group * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (tile % size_m), (tile % (GROUP_M * num_pid_n)) // size_m


@lazy_jit(do_not_specialize=["M", "NUM_PROGS"])
def _persistent_matmul_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K,
                              sxm, sxk, swn, swk, sym, syn,
                              HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                              GROUP_M: tl.constexpr, NUM_PROGS):
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    rk = tl.arange(0, BLOCK_K)
    for tile in range(pid, num_tiles, NUM_PROGS):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_m = rm < M
        mask_n = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + rk
            mask_k = kk < K
            a = tl.load(x_ptr + rm[:, None] * sxm + kk[None, :] * sxk,
                        mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BM, BK]
            b = tl.load(w_ptr + rn[None, :] * swn + kk[:, None] * swk,
                        mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # [BK, BN]
            if IEEE:
                acc = tl.dot(a, b, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        if HAS_BIAS:
            bias = tl.load(b_ptr + rn, mask=mask_n, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        tl.store(y_ptr + rm[:, None] * sym + rn[None, :] * syn, acc.to(y_ptr.dtype.element_ty),
                 mask=mask_m[:, None] & mask_n[None, :])


@lazy_jit(do_not_specialize=["M", "NUM_PROGS"])
def _tma_matmul_kernel(x_desc, w_desc, y_desc, b_ptr, M, N, K,
                       HAS_BIAS: tl.constexpr, IEEE: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       GROUP_M: tl.constexpr, NUM_PROGS):
    """The persistent matmul above with tiles moved by TMA (Hopper's tensor
    memory accelerator): the same tile order, the same ascending K walk and
    the same dot per K step; tiles past M, N or K read zeros, as the masked
    loads above do."""
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_tiles = num_pid_m * num_pid_n
    for tile in range(pid, num_tiles, NUM_PROGS):
        pid_m, pid_n = _grouped_tile(tile, num_pid_m, num_pid_n, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            a = x_desc.load([off_m, k0])  # [BM, BK]
            b = w_desc.load([off_n, k0])  # [BN, BK]
            if IEEE:
                acc = tl.dot(a, b.T, acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b.T, acc)
        if HAS_BIAS:
            rn = off_n + tl.arange(0, BLOCK_N)
            bias = tl.load(b_ptr + rn, mask=rn < N, other=0.0)
            acc = acc + bias.to(tl.float32)[None, :]
        y_desc.store([off_m, off_n], acc.to(y_desc.dtype))


@functools.cache
def _has_tma(device: torch.device) -> bool:
    """TMA exists from Hopper (sm_90) on; Triton's interpreter emulates it on CPU."""
    return device.type == "cpu" or torch.cuda.get_device_capability(device)[0] >= 9


def _tma_ok(*ts: torch.Tensor) -> bool:
    """TMA needs a unit last stride and 16-byte aligned base and row stride."""
    return _has_tma(ts[0].device) and all(
        t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in ts)


def _check(name: str, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    check_device(name, x, w, bias)
    if x.dim() != 2 or w.dim() != 2:
        raise ValueError(f"{name}: x must be [M, K] and w [N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"{name}: x has K={x.shape[1]} but w has K={w.shape[1]}")
    check_dtype(name, "x", x)
    if w.dtype != x.dtype:
        raise TypeError(f"{name}: w has dtype {w.dtype}, x has {x.dtype}; they must match")
    if bias is not None and (bias.shape != (w.shape[0],) or bias.dtype != x.dtype):
        raise ValueError(f"{name}: bias must be [{w.shape[0]}] {x.dtype}, got "
                         f"{tuple(bias.shape)} {bias.dtype}")


TAIL = ("tail_block_m", "tail_block_n", "tail_block_k", "tail_num_warps", "tail_num_stages", "tail_tma")


@register("gemm", "triton_persistent", params=("block_m", "block_n", "block_k", "num_warps", "num_stages", "tma",
                                               "split_m", *TAIL), devices=("cuda",))
def gemm_triton_persistent(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None,
                           block_m: int = 64, block_n: int = 128, block_k: int = 64,
                           num_warps: int = 4, num_stages: int = 3, tma: int = 0, split_m: int = 0,
                           tail_block_m: int = 16, tail_block_n: int = 32, tail_block_k: int = 256,
                           tail_num_warps: int = 4, tail_num_stages: int = 5, tail_tma: int = 0) -> torch.Tensor:
    """`tma=1` moves the tiles with TMA where the tensors allow it (unit last
    stride, 16-byte alignment) and with pointer loads otherwise: the same
    tile walk, so the same bits (tests/gpu checks it), only the loads differ.

    With 0 < split_m < M, rows [0, split_m) run on the first config and the
    rest in a second launch on the `tail_*` config, into the same output: a
    row's bits do not depend on the rows beside it, so only the time changes
    (selection/programs/gemm.py cuts where the first launch fills whole rounds
    of the SMs)."""
    _check("gemm/triton_persistent", x, w, bias)
    cfg = (block_m, block_n, block_k, num_warps, num_stages, tma)
    tail = (tail_block_m, tail_block_n, tail_block_k, tail_num_warps, tail_num_stages, tail_tma)
    for f, v in zip(("block_m", "block_n", "block_k", *TAIL[:3]), cfg[:3] + tail[:3]):
        if v < 16 or v & (v - 1):
            raise ValueError(f"gemm/triton_persistent: {f}={v} must be a power of two >= 16")
    m = x.shape[0]
    y = empty((m, w.shape[0]), x.dtype, x.device)
    if 0 < split_m < m:
        _matmul_into(x[:split_m], w, bias, y[:split_m], *cfg)
        _matmul_into(x[split_m:], w, bias, y[split_m:], *tail)
    elif m:
        _matmul_into(x, w, bias, y, *cfg)
    return y


def _matmul_into(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, y: torch.Tensor, block_m: int,
                 block_n: int, block_k: int, num_warps: int, num_stages: int, tma: int) -> None:
    m, k = x.shape
    n = w.shape[0]
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    progs = min(tiles, sms_for(x))
    if tma and _tma_ok(x, w, y):
        from triton.tools.tensor_descriptor import TensorDescriptor
        _tma_matmul_kernel[(progs,)](
            TensorDescriptor.from_tensor(x, [block_m, block_k]), TensorDescriptor.from_tensor(w, [block_n, block_k]),
            TensorDescriptor.from_tensor(y, [block_m, block_n]), bias if bias is not None else x, m, n, k,
            HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, NUM_PROGS=progs,
            num_warps=num_warps, num_stages=num_stages)
        return
    _persistent_matmul_kernel[(progs,)](
        x, w, bias if bias is not None else x, y, m, n, k,
        x.stride(0), x.stride(1), w.stride(0), w.stride(1), y.stride(0), y.stride(1),
        HAS_BIAS=bias is not None, IEEE=x.dtype == torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP_M=8, NUM_PROGS=progs,
        num_warps=num_warps, num_stages=num_stages)


def gemm_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """Pure-torch reference: fp64 products and sums, rounded once to x.dtype."""
    y = x.double() @ w.double().t()
    if bias is not None:
        y = y + bias.double()
    return y.to(x.dtype)


__all__ = ["gemm_triton_persistent", "gemm_reference"]
