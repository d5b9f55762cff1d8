"""Attention: FlashAttention-3's split-KV heuristic (hopper/heuristics.h
num_splits_heuristic, hopper/tile_size.h), transcribed to SelIR and adapted
to Detent's paged split-KV kernels (kernels/attention.py, attention_triton.py).

Stock FA3 picks a number of KV splits from the batch size, the SM count and
the KV length, and a query tile from the longest query; the split size in KV
tokens is then cdiv(max_seqlen_k, num_splits) rounded up to a page. Detent's
kernels take that split size in KV tokens, so a row reduces over the same
KV segments in the same order however the batch looks once it is pinned.
On stock kernels a single split is FA3's unsplit kernel (`sdpa` on CPU).

On CUDA the deployment's tuple chooses the implementation, knob `impl`:
`triton_paged` (split-KV decode, the Triton prefill) or `fa4`
(FlashAttention-4: FA-class prefill, unsplit decode). One implementation
serves every step, prefill and decode, so a row's bits never depend on
what else is in its step (docs/selir.md, "Attention: one implementation
per deployment"). The `fa4` branch transcribes flash-attn-4 4.0.0b36's own
selection (flash_attn/cute/interface.py: `_get_fwd_config`,
`_tile_size_fwd_sm90`, `num_splits_heuristic`).
"""
from detent.selection.compiler.lang import Fact, Runtime, assume, cdiv, knob, neutral, require, round_up  # noqa: F401

L2_BYTES = 50 * 1024 * 1024
MAX_SPLITS = 128
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
KV_BLOCK_GPU = 64  # the Triton kernel's KV block (BLOCK_N)
FA4_VERSION = "4.0.0b36"  # the flash-attn-4 whose selection fa4_select transcribes
FA4_MAX_SPLITS = 128
FA4_THREADS_SM90 = 384  # one producer and two MMA warpgroups (FA4's default outside SM80/SM120)


def tile_size(device):
    """(kBlockM, kBlockN) the split heuristic counts blocks with: FA3's 64-row
    (PackGQA) query tiles and 128-key blocks on GPU; the CPU kernel's 16-query
    chunks against 64-key blocks."""
    if device == "cpu":
        return (16, 64)
    return (64, 128)


def num_splits_heuristic(total_mblocks, num_sms, num_n_blocks, num_m_blocks, size_one_kv_head, is_causal,
                         max_splits):
    # enough work to nearly fill the SMs: one split, unless one KV head overflows L2
    if total_mblocks >= 0.8 * num_sms:
        if size_one_kv_head > L2_BYTES and num_m_blocks >= num_sms * 2 and not is_causal:
            return min(cdiv(size_one_kv_head, L2_BYTES), max_splits)
        return 1
    if num_n_blocks <= 4:
        return 1
    max_splits = min(max_splits, num_sms, num_n_blocks)
    # the best wave efficiency, then the fewest splits within 85% of it
    max_eff = 0.0
    for s in range(1, MAX_SPLITS + 1):
        if s <= max_splits:
            n_waves = total_mblocks * s / num_sms
            eff = n_waves / cdiv(total_mblocks * s, num_sms)
            if eff > max_eff:
                max_eff = eff
    for s in range(1, MAX_SPLITS + 1):
        if s <= max_splits:
            n_waves = total_mblocks * s / num_sms
            eff = n_waves / cdiv(total_mblocks * s, num_sms)
            if eff >= 0.85 * max_eff:
                return s
    return 1


def fa4_tile_sm90(head_dim):
    """FA4's SM90 forward tile for causal attention (not local, no block
    sparsity, head_dim_v == head_dim): (tile_m, tile_n, mma_pv_is_rs,
    intra_wg_overlap). Read from head dim and causality only."""
    if head_dim <= 64:
        return (192, 128, True, True)
    if head_dim <= 96:
        return (192, 128, False, True)  # causal; 192 x 144 without a mask
    if head_dim <= 128:
        return (128, 128, True, True)
    if head_dim <= 192:
        return (128, 112, True, True)  # tile_n 128 only when head_dim_v <= 128
    return (128, 80, True, True)


def fa4_select(fa4, arch, dtype, stock_kernels, num_sms, num_heads, num_kv_heads, head_dim, block_size, num_seqs,
               max_seqlen_q, max_seqlen_k):
    require(fa4 == FA4_VERSION, 'attention impl "fa4" needs flash-attn-4 4.0.0b36: pip install "detent[fa4]"')
    require(arch == "sm90", "the fa4 selection is transcribed (and its invariance measured) for SM90 only")
    require(dtype == "bfloat16" or dtype == "float16", "FlashAttention-4 runs bf16 or fp16")
    require(8 <= head_dim <= 256 and head_dim % 8 == 0, "FA4 on SM90 takes head dims 8..256, multiples of 8")
    gqa = num_heads // num_kv_heads
    tile_m, tile_n, mma_pv_is_rs, intra_wg_overlap = fa4_tile_sm90(head_dim)
    pack_gqa = gqa > 1  # FA4's default: the query heads of one KV head share a tile
    # the split count FA4 derives from the batch when asked to (num_splits=0); q_stage is 1 on SM90
    num_m_blocks = cdiv(max_seqlen_q * gqa if pack_gqa else max_seqlen_q, tile_m)
    total_mblocks = num_seqs * num_kv_heads * (1 if pack_gqa else gqa) * num_m_blocks
    num_n_blocks = cdiv(max_seqlen_k, tile_n)
    num_splits = 1  # FA4's num_splits_heuristic: no split for short KV, else as many as idle SMs allow
    if num_n_blocks > 4 and total_mblocks > 0:
        num_splits = max(1, min(num_sms // total_mblocks, FA4_MAX_SPLITS, num_n_blocks))
    if stock_kernels:
        num_splits = 1  # a stock caller on SM90 passes the API's default, 1: more asserts there
    # FA4 asserts "SplitKV not supported on SM 9.0"; and its splits follow each sequence's own
    # KV length, so a decode row and the same row inside a prefill would reduce differently
    require(num_splits == 1, "FA4 4.0.0b36 has no split-KV on SM90, and its splits would follow the KV length")
    # not parameters: FA4 picks its tile scheduler from the batch inside the call (static
    # persistent when every sequence's rows fit one tile, a block-to-batch lookup above 256
    # sequences); that moves tiles between CTAs, not a tile's arithmetic (tests/gpu/test_gpu_fa4.py)
    return {"impl": "fa4", "tile_m": tile_m, "tile_n": tile_n, "num_threads": FA4_THREADS_SM90,
            "pack_gqa": pack_gqa, "num_splits": num_splits, "mma_pv_is_rs": mma_pv_is_rs,
            "intra_wg_overlap": intra_wg_overlap, "page_size": block_size}


def select(device: Fact[str], arch: Fact[str], triton: Fact[bool], fa4: Fact[str], stock_kernels: Fact[bool],
           num_sms: Fact[int], dtype: Fact[str], num_heads: Fact[int], num_kv_heads: Fact[int], head_dim: Fact[int],
           block_size: Fact[int], max_context: Fact[int], max_num_batched_tokens: Fact[int],
           max_num_seqs: Fact[int], num_seqs: Runtime[int], max_seqlen_q: Runtime[int],
           max_seqlen_k: Runtime[int]):
    assume(1 <= num_seqs <= max_num_seqs, "more sequences in the step than max_num_seqs")
    assume(1 <= max_seqlen_q <= max_num_batched_tokens, "a query chunk longer than max_num_batched_tokens")
    assume(1 <= max_seqlen_k <= max_context, "a sequence longer than max_context")
    assume(max_seqlen_q <= max_seqlen_k, "more new queries than KV tokens")
    gpu = device == "cuda" and triton
    if gpu:
        # one implementation for every step of the deployment: chosen by the tuple, never by the batch
        impl = knob("impl", ("triton_paged", "fa4"), "triton_paged")
        if impl == "fa4":
            return fa4_select(fa4, arch, dtype, stock_kernels, num_sms, num_heads, num_kv_heads, head_dim,
                              block_size, num_seqs, max_seqlen_q, max_seqlen_k)
    gqa = num_heads // num_kv_heads
    block_m, block_n = tile_size(device)
    num_m_blocks = cdiv(max_seqlen_q * gqa, block_m)          # PackGQA
    num_n_blocks = cdiv(max_seqlen_k, block_n)
    size_one_kv_head = max_seqlen_k * head_dim * 2 * DTYPE_BYTES[dtype]
    total_mblocks = num_seqs * num_kv_heads * num_m_blocks
    num_splits = num_splits_heuristic(total_mblocks, num_sms, num_n_blocks, num_m_blocks, size_one_kv_head,
                                      True, MAX_SPLITS)
    if stock_kernels:
        stride = KV_BLOCK_GPU if gpu else block_size
    else:
        # Detent's split stride: a knob the tuner sets (benchmarks/tune_decode.py)
        stride = knob("split_stride", (block_size, 64, 256, 1024), 256)
    split_tokens = round_up(cdiv(max_seqlen_k, num_splits), stride)
    require(split_tokens % block_size == 0, "a split must cover whole KV pages")
    if gpu:
        # query tile by query length; with the MMA row sum its bits do not depend
        # on the tile (tests/gpu block_m neutrality): neutral when pinned. Long
        # chunks take 128 rows on 8 warps (H200, one prompt attending to itself,
        # us: 2,928 vs 3,182 at 8k tokens, 252 vs 265 at 2k; identical bits)
        q_tile, warps = (16, 4) if max_seqlen_q * gqa <= 16 else (64, 4)
        if max_seqlen_q * gqa >= 512:
            q_tile, warps = 128, 8
        if stock_kernels:
            return {"impl": "triton_paged", "split_tokens": split_tokens, "block_m": q_tile,
                    "block_n": KV_BLOCK_GPU, "num_warps": warps, "rowsum": "sum"}
        # decode launch, by the number of (sequence, KV head) programs (benchmarks/
        # tune_decode.py with the kernel's decode mapping, H200, 1k contexts, us per
        # layer): up to 32 - one program per split, then the combine kernel, 8 warps
        # (Llama batch 1: 11.5 vs 12.7 at 4; Qwen3-30B-A3B batch 8: 12.2 vs 13.2);
        # 128 to 511 - the same with 2 warps, 4 stages (Qwen3 batch 64, 4 KV heads:
        # 46.4 vs 51.5 for the splits in one program); from 512 - the splits in one
        # program, 2 warps, no prefetch stage (Llama batch 64: 75.1 vs 79.1 for split
        # programs, batch 256: 271.3 vs 281.1); with one loop over the splits (tile_loop
        # "auto" / "prefetch", lease 17) 3 stages: batch 64 75.6, 105 128.9, 256 283.5 against
        # 83.7, 150.3, 303.0 at 1 stage. Every launch tried gave the same bits.
        # the exponent's form (kernels/attention_triton.py): "exp2" is FlashAttention's (other bits, the
        # same in prefill and decode; rows invariant on the H200 in lease 16, 35/35 battery cells);
        # overlap_short runs a mixed step's short launch on a second stream beside the prompt tiles
        # (same bits). Both on by default since lease 18: on a mixed step of 998 prompt tokens and
        # 26 decodes, 133.8 us per layer with neither, 97.1 with the overlap, 89.0 with both; under
        # load beside vLLM in one hold, TPOT p50 1.00x vLLM's at 80 % of its maximum and 1.05x at
        # 20 req/s with both, 1.13x and 1.15x without (docs/performance.md "Lease 18"). The
        # kernel's split_mask (skip the causal mask in tiles a q tile sees whole) stays off: on the
        # H200 it moved a row's bits with the chunking and the decode launch (lease 16)
        softmax = knob("softmax", ("exp", "exp2"), "exp2")
        overlap = knob("overlap_short", (False, True), True)
        # the KV tiles' loop (kernels/attention_triton.py tile_loop, same bits): "nested" a loop
        # per split, as measured side by side with vLLM (lease 17); "auto" walks a decode
        # program's splits in one loop (lease 17: 105 decodes 128.9 vs 150.3 us per layer at 2
        # warps, 3 vs 1 stage) but was not separated from hold-to-hold variation under load;
        # "prefetch" one loop everywhere with the block table read a tile ahead, and 3 stages
        # for the prompt tiles, the form in which the compiler keeps the next tile's K and V
        # copies in flight (tests/kernels/test_sm90_compile.py); not yet timed on the device
        tile_loop = knob("tile_loop", ("nested", "auto", "prefetch"), "nested")
        # each KV tile's row-sum MMA folded into the row sum at the next tile (kernels/attention_triton.py
        # defer_rowsum, same bits): one MMA wait per tile instead of two in the prompt tiles' loop on
        # sm_90 (tests/kernels/test_sm90_compile.py); a knob, off: timed on the H200 in lease 19 it made
        # the attention 3-11 % slower (docs/performance.md "Lease 19")
        defer = knob("defer_rowsum", (False, True), False)
        combine, stages = "auto", 2
        if q_tile > 16 and tile_loop == "prefetch":
            stages = 3
        if q_tile == 16:
            programs = num_seqs * num_kv_heads
            if programs >= 512:
                combine, warps, stages = "sequential", 2, 1
                if tile_loop != "nested":
                    stages = 3
            elif programs >= 128:
                combine, warps, stages = "parallel", 2, 4
            else:
                combine = "parallel"
                if programs <= 32:
                    warps = 8
        return {"impl": "triton_paged", "split_tokens": split_tokens, "block_m": neutral(q_tile),
                "block_n": KV_BLOCK_GPU, "num_warps": neutral(warps), "num_stages": neutral(stages),
                "combine": neutral(combine), "rowsum": "mma", "softmax": softmax,
                "split_mask": False, "overlap_short": overlap, "tile_loop": tile_loop, "defer_rowsum": defer}
    if stock_kernels and num_splits == 1:
        return {"impl": "sdpa"}
    return {"impl": "paged_split", "split_tokens": split_tokens, "q_chunk": 16}


def conservative(device: Fact[str], triton: Fact[bool], block_size: Fact[int], max_context: Fact[int]):
    # no split-KV: one split covers the longest possible sequence
    if device == "cuda" and triton:
        return {"impl": "triton_paged", "split_tokens": round_up(max_context, KV_BLOCK_GPU), "block_m": 64,
                "block_n": KV_BLOCK_GPU, "num_warps": 4, "combine": "sequential", "rowsum": "sum"}
    return {"impl": "paged_split", "split_tokens": round_up(max_context, block_size), "q_chunk": 16}
