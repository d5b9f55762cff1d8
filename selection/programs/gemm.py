"""GEMM: the library GEMM picks its kernel by M (MKL fp32: M = 1, 2-3, >= 4;
cuBLAS: tile by M), so its row bits follow the batch. Detent's candidates fix
the shape a row sees: `torch_chunked` calls the library on fixed chunks of
rows (CPU); on GPU a Triton persistent matmul (fp32 accumulation, K in
ascending order, no split-K) whose tile configs were measured bit-identical
on the H200 (tests/gpu): its config may follow M, declared `neutral`, and the
GPU GEMM has no pin.

On CPU the chunk is a knob, not a pin: it does not follow the batch, so it
does not follow the token budget either (a pin taken from the batch's M
would be 4 for max_num_batched_tokens = 8 and 16 for 8192, and MKL's 4-row
and 16-row kernels give a row other bits). Its choices are the chunks whose
rows were measured position-invariant on every MKL path (SSE4.2, AVX2,
AVX-512, COMPATIBLE: tests/kernels/test_cpu_isa.py): 4 is not (SSE4.2),
nor 8 or 32 (AVX2).
"""
from detent.selection.compiler.lang import Fact, Runtime, assume, cdiv, knob, neutral  # noqa: F401

CPU_CHUNKS = (1, 16)
# Tile configs for the H200 (Llama-3.1-8B shapes, bf16), by row count and
# output width: the fastest of `benchmarks/tune_decode.py` (CUDA-graph timing
# over 400 MB of weight copies, so no config is helped by weights left in
# L2). Narrow outputs (N = 4096) need narrow tiles at M <= 256 to give the
# SMs enough programs without split-K. Tiles move by TMA (`tma=1`) where that
# measured faster: the wide and tiny ones from M = 17, the mid from M = 33, the narrow from
# M = 65. At M = 2048 and 8192 that matches cuBLAS (gate_up at 2048: 740 us
# against 740 us; pointer loads 864 us), and it takes 10-20% off M = 128 and
# 256. M = 17-32 has its own row: with the 64-row TMA tiles, o and down at M = 24 took
# 21.8 and 66.5 us against 12.3 and 33.7 (cuBLAS 14.2, 32.4), which made a
# 17-row decode step 1.5 ms slower than a 16-row one (docs/performance.md,
# lease 8). Every config of the table (and of MEASURED) gave identical row bits on the H200
# for every shape and M tried, with and without TMA (benchmarks/tune_decode.py checks
# it, and tests/gpu/test_gpu_gemm.py re-checks it on the device), so
# choosing among them by M does not break batch invariance.
# Rows: (block_m, block_n, block_k, num_warps, num_stages, tma) by max M and N
# width ("tiny": N <= 1024 (MoE routers), "narrow": N <= 4096, "mid": 4096 < N < 16384, "wide": N >= 16384).
WIDE = (128, 256, 64, 8, 3, 1)
TINY = (64, 32, 256, 4, 3, 1)
GEMM_TABLE = (
    (16, {"tiny": (16, 32, 256, 4, 5, 0), "narrow": (16, 32, 256, 4, 5, 0), "mid": (16, 64, 256, 4, 4, 0),
          "wide": (16, 128, 128, 4, 4, 0)}),
    (32, {"tiny": TINY, "narrow": (32, 32, 256, 4, 4, 0), "mid": (32, 64, 256, 4, 4, 0), "wide": (64, 256, 64, 8, 4, 1)}),
    (64, {"tiny": TINY, "narrow": (64, 32, 128, 4, 5, 0), "mid": (64, 64, 128, 4, 5, 1), "wide": (64, 256, 64, 8, 4, 1)}),
    (128, {"tiny": TINY, "narrow": (64, 64, 128, 4, 5, 1), "mid": (128, 64, 128, 4, 4, 1), "wide": WIDE}),
    (256, {"tiny": TINY, "narrow": (128, 64, 128, 4, 4, 1), "mid": (128, 128, 128, 8, 3, 1), "wide": WIDE}),
    (2 ** 30, {"tiny": (128, 64, 128, 4, 4, 1), "narrow": WIDE, "mid": WIDE, "wide": WIDE}),
)
# mid-M configs the sweep also measured bit-identical: with the table's, the set
# tests/gpu/test_gpu_gemm.py checks for neutrality (`programs.gemm_tile_configs()`)
MEASURED = ((128, 64, 128, 4, 4, 0), (64, 128, 128, 4, 3, 0), (128, 128, 128, 8, 3, 0), (128, 256, 64, 8, 3, 0))


# Prefill bands: (width, lo, hi, config) for lo < M <= hi, where one launch of a
# 128 x 128 tile beat the wide tile and its wave cut (`benchmarks/gemm_waves.py
# --sweep`, H200, at the whole-step graphs' buckets; us per layer, o + down then
# qkv): N = 4,096 at M = 384 and 512 took 175.5 and 177.1 on the wide tile (48 and
# 64 tiles for 132 SMs) against 110.3 and 119.8; at 1,408 and 1,536 (a second round
# the cut cannot take: more than 256 rows past it) 394.1 and 403.9 against 357.5 and
# 369.0; qkv at 1,024 (192 wide tiles: two rounds, the second half full) 92.7
# against 81.9. Elsewhere the wide tile (and its cut) was within 3 % of the best.
BANDS = (("narrow", 256, 512, (128, 128, 64, 8, 4, 1)), ("narrow", 1280, 1536, (128, 128, 64, 4, 4, 1)),
         ("mid", 896, 1024, (128, 128, 64, 4, 4, 1)))


def width_of(n):
    return "tiny" if n <= 1024 else "narrow" if n <= 4096 else ("wide" if n >= 16384 else "mid")


def band(m, n):
    """The prefill band's config for M = m rows and N = n, or None."""
    w = width_of(n)
    for bw, lo, hi, cfg in BANDS:
        if bw == w and lo < m <= hi:
            return cfg
    return None


# Whole waves: the H200 has 132 SMs, and a persistent launch of t tiles takes
# cdiv(t, 132) rounds of its slowest tile. With the wide tile, M = 1,152 and
# N = 4,096 (o_proj, down_proj on Llama-3.1-8B shapes) is 144 tiles: a second
# round for 12 of them, the price of a 2,048-token step for 1,152 tokens
# (docs/performance.md, lease 5). Where the rows past the last whole round are
# at most 256, they run in a second launch on the table's small-M tiles, which
# spread them over every SM. Rows are independent and every config here is
# neutral, so where the cut falls changes no bit.
SMS = 132
TAIL_MAX = 256


def wave_split(m, n):
    """Rows the first launch takes (the whole rounds of wide tiles), where the rest fit one
    round of the table's tiles for their count; m where a cut saves no round."""
    per_row = cdiv(n, WIDE[1])
    rounds = cdiv(cdiv(m, WIDE[0]) * per_row, SMS)
    head = (rounds - 1) * SMS // per_row * WIDE[0]
    if m <= TAIL_MAX or n >= 16384 or rounds < 2 or m - head > TAIL_MAX or band(m, n) is not None:
        return m
    tail = triton_config(m - head, n)
    if cdiv(m - head, tail[0]) * cdiv(n, tail[1]) > SMS:
        return m
    return head


def triton_config(m, n):
    cfg = band(m, n)
    if cfg is not None:
        return cfg
    width = width_of(n)
    for upto, row in GEMM_TABLE:
        if m <= upto:
            return row[width]
    return WIDE


def select(device: Fact[str], triton: Fact[bool], stock_kernels: Fact[bool], n: Fact[int], k: Fact[int],
           max_num_batched_tokens: Fact[int], num_tokens: Runtime[int]):
    assume(0 <= num_tokens <= max_num_batched_tokens, "more rows than max_num_batched_tokens")
    if stock_kernels:
        return {"impl": "torch"}  # the library on the real M (MKL / cuBLAS pick a kernel by M)
    if device == "cuda" and triton:
        head = neutral(wave_split(num_tokens, n))
        cfg = neutral(triton_config(head, n))
        if neutral(head < num_tokens):  # where the rows are cut changes no bit
            tail = neutral(triton_config(num_tokens - head, n))
            return {"impl": "triton_persistent", "block_m": cfg[0], "block_n": cfg[1], "block_k": cfg[2],
                    "num_warps": cfg[3], "num_stages": cfg[4], "tma": cfg[5], "split_m": head,
                    "tail_block_m": tail[0], "tail_block_n": tail[1], "tail_block_k": tail[2],
                    "tail_num_warps": tail[3], "tail_num_stages": tail[4], "tail_tma": tail[5]}
        return {"impl": "triton_persistent", "block_m": cfg[0], "block_n": cfg[1], "block_k": cfg[2],
                "num_warps": cfg[3], "num_stages": cfg[4], "tma": cfg[5]}
    # rows per library call: one fixed chunk for the deployment (see the docstring)
    return {"impl": "torch_chunked", "chunk": knob("chunk", CPU_CHUNKS, 16)}


def conservative(device: Fact[str], triton: Fact[bool]):
    if device == "cuda" and triton:
        return {"impl": "triton_persistent", "block_m": 128, "block_n": 128, "block_k": 64, "num_warps": 8,
                "num_stages": 3, "tma": 0}
    return {"impl": "torch_chunked", "chunk": 1}
