"""FlashAttention-4 (`flash-attn-4` 4.0.0b36, CuTe DSL) as the attention candidate `fa4`.

FA4 compiles its kernels at first call (about 3 s per configuration) and
runs on sm90+ GPUs. It is an optional extra (`pip install "detent[fa4]"`):
the candidate registers only when that exact version is installed,
`flash_attn.cute` imports and the GPU is sm90 or newer; otherwise the
registry records why (`registry.unavailable`), so a tuple or an explicit
selection asking for `fa4` fails with what is missing and how to install it.

Everything FA4's own selection decides (flash_attn/cute/interface.py,
`_get_fwd_config`, `_tile_size_fwd_sm90`, `num_splits_heuristic`) is a
parameter here, passed to FA4 explicitly so FA4 decides none of it from the
batch: the tile (`tile_m`, `tile_n`, from head dim and causality), the
warpgroup layout (`num_threads`, `mma_pv_is_rs`, `intra_wg_overlap`),
`pack_gqa`, `num_splits` and the page size. The SelIR program
(selection/programs/attention.py) transcribes that selection and pins it.
The public `flash_attn_varlen_func` does not take the tile or thread
parameters, so the candidate calls the forward behind it,
`interface._flash_attn_fwd`, whose signature is checked at registration
(the extra pins the version for that reason).

What FA4 still decides from the batch inside the call, on SM90: its tile
scheduler (static persistent when every sequence's query rows fit one
tile, as in decode; a flat block-to-batch lookup above 256 sequences).
Those change which CTA computes a tile, not a tile's arithmetic; the GPU
tests compare a decode row with the same row inside a prefill
(tests/gpu/test_gpu_fa4.py).

Layout: Detent's paged cache is `kv_cache [2, num_blocks, block_size, KVH, D]`
and a block is a page, so FA4's `k_cache [num_pages, page_size, KVH, D]`
is `kv_cache[0]` and its `page_table` is `meta.block_tables`: views of the
same memory, no copy (`paged_views`).
"""
from __future__ import annotations

import inspect
from typing import Callable, NamedTuple

import torch

from detent.kernels.attention import store_kv
from detent.kernels.optional import gpu_problem, version_problem
from detent.kernels.registry import register, unavailable

FA4_VERSION = "4.0.0b36"
INSTALL = 'pip install "detent[fa4]"'
PARAMS = ("tile_m", "tile_n", "num_threads", "pack_gqa", "num_splits", "mma_pv_is_rs", "intra_wg_overlap",
          "page_size")


class PagedKV(NamedTuple):
    """Detent's paged KV as FA4's paged arguments (views, no copies)."""
    k_pages: torch.Tensor  # [num_pages, page_size, KVH, D] = kv_cache[0]
    v_pages: torch.Tensor  # [num_pages, page_size, KVH, D] = kv_cache[1]
    page_table: torch.Tensor  # [B, max_pages] int32 = meta.block_tables (page id = block id)
    seqused_k: torch.Tensor  # [B] int32 = meta.seq_lens (KV length after this step's writes)
    cu_seqlens_q: torch.Tensor  # [B + 1] int32 = meta.query_start_loc


def paged_views(kv_cache: torch.Tensor, meta) -> PagedKV:
    """FA4's view of the cache for this step. Causality lines up without
    offsets: FA4 aligns a sequence's queries to the end of its KV (query i of
    q_len sits at seqused_k - q_len + i), which is Detent's metadata contract
    (selection/context.py AttentionMetadata)."""
    name = "attention/fa4"
    if kv_cache.dim() != 5 or kv_cache.shape[0] != 2:
        raise ValueError(f"{name}: kv_cache must be [2, num_blocks, block_size, KVH, D], got {tuple(kv_cache.shape)}")
    if not kv_cache[0].is_contiguous():
        raise ValueError(f"{name}: kv_cache[0] must be contiguous (FA4 reads pages by stride)")
    b = meta.query_start_loc.shape[0] - 1
    if meta.block_tables.dim() != 2 or meta.block_tables.shape[0] != b or meta.seq_lens.shape != (b,):
        raise ValueError(f"{name}: block_tables must be [{b}, max_pages] and seq_lens [{b}] for {b} sequences, got "
                         f"{tuple(meta.block_tables.shape)} and {tuple(meta.seq_lens.shape)}")
    for f in ("query_start_loc", "seq_lens", "block_tables"):
        t = getattr(meta, f)
        if t.dtype != torch.int32 or t.stride(-1) != 1:
            raise TypeError(f"{name}: {f} must be int32 with a contiguous last dimension")
    return PagedKV(kv_cache[0], kv_cache[1], meta.block_tables, meta.seq_lens, meta.query_start_loc)


_FWD: Callable | None = None  # interface._flash_attn_fwd once registered


def attention_fa4(q, k, v, kv_cache, meta, scale: float, tile_m: int, tile_n: int, num_threads: int,
                  pack_gqa: bool, num_splits: int, mma_pv_is_rs: bool, intra_wg_overlap: bool,
                  page_size: int) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, KVH, D] (written to the cache first); returns [T, H, D]."""
    name = "attention/fa4"
    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0]:
        raise ValueError(f"{name}: q must be [T, H, D], k and v [T, KVH, D]; got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.dtype not in (torch.bfloat16, torch.float16) or kv_cache.dtype != q.dtype:
        raise TypeError(f"{name}: FA4 runs bf16 or fp16 with a cache of the same dtype; got q {q.dtype}, "
                        f"kv_cache {kv_cache.dtype}")
    if page_size != kv_cache.shape[2] or page_size != meta.block_size:
        raise ValueError(f"{name}: selected for page size {page_size}, but the KV cache's pages hold "
                         f"{kv_cache.shape[2]} tokens (meta.block_size {meta.block_size})")
    if num_splits != 1:
        # FA4 splits a sequence's KV by its own length, so a decode row and the same
        # row inside a prefill would reduce differently; SM90 has no split-KV anyway
        raise ValueError(f"{name}: num_splits={num_splits}; only 1 keeps a row's bits independent of the step")
    if _FWD is None:
        raise RuntimeError(f"{name}: FlashAttention-4 is not loaded in this process: {INSTALL}")
    d = k.shape[-1]
    if k.is_cuda and d & (d - 1) == 0:
        # the Triton path's store: one kernel for k and v, against two index_copy launches
        # (0.24 ms a step at 20 req/s against 0.07, H100, lease 27); a copy either way. Imported
        # here: triton is an extra, and this module loads without it (SelIR selects fa4 only
        # where the `triton` fact holds)
        from detent.kernels.rowwise_triton import store_kv_triton
        store_kv_triton(k, v, kv_cache, meta.slot_mapping)
    else:
        store_kv(k, v, kv_cache, meta.slot_mapping)
    if q.shape[0] == 0 or meta.num_seqs == 0:
        return torch.empty_like(q)
    kv = paged_views(kv_cache, meta)
    return _FWD(q.detach(), kv.k_pages, kv.v_pages,
                **call_args(kv, meta.max_seqlen_q, meta.max_seqlen_k, scale, tile_m=tile_m, tile_n=tile_n,
                            num_threads=num_threads, pack_gqa=pack_gqa, num_splits=num_splits,
                            mma_pv_is_rs=mma_pv_is_rs, intra_wg_overlap=intra_wg_overlap))[0]


def call_args(kv: PagedKV, max_seqlen_q: int, max_seqlen_k: int, scale: float, *, tile_m: int, tile_n: int,
              num_threads: int, pack_gqa: bool, num_splits: int, mma_pv_is_rs: bool, intra_wg_overlap: bool) -> dict:
    """The keyword arguments of FA4's forward for one step: everything its own
    selection would decide, given (the max lengths are the host-side bounds
    FA4's scheduler reads; a CUDA graph's must cover every replay)."""
    return dict(cu_seqlens_q=kv.cu_seqlens_q, seqused_k=kv.seqused_k, max_seqlen_q=max_seqlen_q,
                max_seqlen_k=max_seqlen_k, page_table=kv.page_table, softmax_scale=float(scale), causal=True,
                tile_mn=(tile_m, tile_n), mma_pv_is_rs=mma_pv_is_rs, intra_wg_overlap=intra_wg_overlap,
                num_threads=num_threads, num_splits=num_splits, pack_gqa=pack_gqa)


def register_fa4(fwd: Callable) -> None:
    """Register `fa4` with FA4's forward `fwd` (tests pass a stand-in)."""
    global _FWD
    _FWD = fwd
    register("attention", "fa4", params=PARAMS, devices=("cuda",))(attention_fa4)


def load_fa4() -> tuple[Callable | None, str | None]:
    """(FA4's forward, None), or (None, why it cannot run here)."""
    why = (version_problem("flash-attn-4", FA4_VERSION, "fa4", INSTALL)
           or gpu_problem("FlashAttention-4 needs an sm90 or newer GPU", lambda major, minor: major >= 9))
    if why is not None:
        return None, why
    try:
        from flash_attn.cute import interface
    except Exception as e:  # noqa: BLE001  (any import failure: say which)
        return None, f"flash_attn.cute does not import ({type(e).__name__}: {e}); {INSTALL}"
    fwd = getattr(interface, "_flash_attn_fwd", None)
    have = inspect.signature(fwd).parameters if fwd is not None else {}
    passed = call_args(PagedKV(*(None,) * 5), 1, 1, 1.0, tile_m=128, tile_n=128, num_threads=384, pack_gqa=True,
                       num_splits=1, mma_pv_is_rs=True, intra_wg_overlap=True)
    missing = [a for a in passed if a not in have]
    if missing:
        return None, f"flash_attn.cute.interface._flash_attn_fwd lacks {missing}; {INSTALL}"
    return fwd, None


_fwd, _why = load_fa4()
if _fwd is not None:
    register_fa4(_fwd)
else:
    unavailable("attention", "fa4", _why)
