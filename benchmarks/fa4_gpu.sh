#!/usr/bin/env bash
# Issue 19 on one GPU, after FlashAttention-4 is installed on the device (docs/performance.md,
# "FlashAttention-4 as the deployment's attention": the three chunk calls, then FA4's `eval`):
#   tests:   FA4 registered, then tests/gpu/test_gpu_fa4.py and test_gpu_attention.py;
#   prefill: benchmarks/prefill.py with either implementation, Llama-3.1-8B and Qwen3-30B-A3B shapes;
#   decode:  benchmarks/decode.py, the Triton tuple beside the FA4 tuple.
#   pages:   benchmarks/prefill.py with FA4 and detent-serve's graphs at pages of 16 and 128 tokens
#            (FA4 loads pages through TMA only when a page is its 128-key tile); not in `all`.
# Each part is bounded (`timeout`), so one that hangs leaves the others' files.
# Usage: bash benchmarks/fa4_gpu.sh OUTDIR [tests|prefill|decode|pages|all]
set -u
OUT=$1
PART=${2:-all}
mkdir -p "$OUT"
source "$(dirname "$0")/gpu_timed.sh"
python3 -c "from detent.kernels import registry; print(registry.why_unavailable('attention', 'fa4') or 'fa4 registered')"
if [ "$PART" = tests ] || [ "$PART" = all ]; then
    timed gpu_tests 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/gpu/test_gpu_fa4.py \
        tests/gpu/test_gpu_attention.py
fi
if [ "$PART" = prefill ] || [ "$PART" = all ]; then
    for m in llama-3.1-8b qwen3-30b-a3b; do
        for a in triton_paged fa4; do
            timed "prefill_${a}_$m" 150 python3 benchmarks/prefill.py --model $m --modes pinned --attention $a \
                --out "$OUT/prefill_${a}_$m.json"
        done
    done
fi
if [ "$PART" = decode ] || [ "$PART" = all ]; then
    timed decode_fa4 240 python3 benchmarks/decode.py --model llama-3.1-8b --batches 1,8,64 \
        --modes pinned,pinned+attention.impl=fa4 --out "$OUT/decode_fa4.json" --png "$OUT/decode_fa4.png"
fi
if [ "$PART" = pages ]; then
    for bs in 16 128; do
        timed "prefill_fa4_page$bs" 150 python3 benchmarks/prefill.py --model llama-3.1-8b --modes pinned \
            --attention fa4 --graphs serving --block-size $bs --out "$OUT/prefill_fa4_page$bs.json"
    done
fi
