#!/usr/bin/env bash
# Issue 20's arms on one GPU, one part per device call, results merged in /tmp/arms* (keep the
# machine warm between calls) and packed into OUTDIR/ARMS.tgz after each part (with the tuples)
# (docs/performance.md, "Arms and workloads"; Llama-3.1-8B shapes, or Qwen3-30B-A3B's with MODEL=
# below, dummy weights, word-level tokenizer, 64 requests a load):
#   stock | pinned-default | conservative | tuned-W-A | tuned-W-B | tuned-W-C:  serve_arms.py run --arms PART
#   pinned-default-again:  the default once more (--tag @2), for the report's run-to-run drift
#       (stock first: its lambda_max sets the others' rates; tuned-W-X takes the last lease's tuple
#       unless /tmp/arms has one: W-C's from lease 28 (whole, under the tpot objective: the default's
#       assignments), W-B's from lease 30 (64 requests, loads as closed loops: Triton attention with
#       the prefetch tile loop), W-A's from lease 22 (whole);
#       every load sends its own prompts: benchmarks/workloads/README.md)
#   tune-W-A | tune-W-B | tune-W-C:  `detent tune` on the workload the arms serve (64 requests; Poisson loads
#              at fractions of stock's lambda_max when the folder or LAMBDA_MAX_FROM has it), timed, into
#              $TUNES/tuple-W-X.json (its time budget 570 s, inside the 590 s the part and the
#              600 s a device call may take; TUNE_BUDGET=S for less, when the call installs too;
#              TUNE_ARGS: more `detent tune` arguments, e.g. "--num-requests 16" for the workload's head)
#   vllm:      `vllm serve` from the peer bundle (PYTHONPATH=VLLM_PATH, default /tmp/vsite), same
#              deployment facts, then the same client and rates (serve_arms.py --vllm-url)
#   vllm-bi:   the same with VLLM_BATCH_INVARIANT=1 (vLLM's batch-invariant mode), stored as arm vllm-bi
#   report:    serve_arms.py report
# SERVER_ARGS="..." TAG=-X with stock, pinned-default or conservative: more detent-serve arguments (not
# deployment facts), the arm stored as ARM-X (e.g. SERVER_ARGS="--max-mixed-batched-tokens 8192" TAG=-mix8k)
# Usage: bash benchmarks/arms_gpu.sh OUTDIR PART [PART...]
set -u
OUT=$1
shift
# MODEL=qwen3-30b-a3b: Qwen3-30B-A3B shapes (/tmp/wlq3; its tunes and arms in /tmp/arms-q3*; W-C's
# tuple from lease 31, W-B's from lease 33, W-A's from lease 34: the default tuple, kept); default Llama-3.1-8B's (/tmp/wl8b, /tmp/arms*; SEEDS: the tuples named above)
case ${MODEL:-llama-3.1-8b} in
    llama-3.1-8b) M=/tmp/wl8b; TUNES=/tmp/arms; SHAPE=""
        SEEDS="h100-2026-12-06-lease28/tune/tuple-W-C.json h200-2026-12-05-lease22/tune/tuple-W-A.json
               h100-2026-12-06-lease30/tune/tuple-W-B.json" ;;
    qwen3-30b-a3b) M=/tmp/wlq3; TUNES=/tmp/arms-q3; SHAPE=--qwen3-30b-a3b
        SEEDS="h100-2026-12-06-lease31/tune/tuple-W-C.json h100-2026-12-06-lease33/tune/tuple-W-B.json
               h100-2026-12-06-lease34/tune/tuple-W-A.json" ;;
    *) echo "MODEL: llama-3.1-8b or qwen3-30b-a3b"; exit 2 ;;
esac
ARMS=$TUNES
FACTS="--load-format dummy --device cuda --dtype bfloat16 --max-model-len 8192"
# WORKLOADS (default W-A,W-C): the workloads the arms serve; add W-B for its tuned arm. Results for
# other workloads go to their own folder (serve_arms.py never merges two sets of workloads); the
# tuples stay in $TUNES, where the tunes write them, and are copied to that folder
WL=${WORKLOADS:-W-A,W-C}
[ "$WL" = W-A,W-C ] || ARMS=$TUNES-${WL//,/_}
N=64  # requests a load; the tunes tune the same workload (W-B's 200 did not fit a tune's 600 s, lease 30)
# LAMBDA_MAX_FROM="DIR [DIR...]": earlier folders' stock lambda_max sets the rates, for arms served
# without a stock part (lease 30: benchmarks/results/h100-2026-12-06-lease29/arms-W-B)
FROM=""
for D in ${LAMBDA_MAX_FROM:-}; do FROM="$FROM --lambda-max-from $D"; done
# LOADS="A1,W-B": the stock, pinned and tuned parts serve only these loads (or workloads' loads), so
# one arm over two workloads can be split across calls (each part under its 560 s)
A="--model $M $FACTS --num-requests $N --workloads $WL --out $ARMS$FROM${LOADS:+ --loads $LOADS}"
mkdir -p "$OUT" "$ARMS" $TUNES
[ -f $M/config.json ] || python3 benchmarks/wordlevel_model.py $M $SHAPE > /dev/null
for T in $SEEDS; do  # the last leases' tuples, unless this machine tuned its own
    [ -f $TUNES/$(basename $T) ] || cp benchmarks/results/$T $TUNES/
done
source "$(dirname "$0")/gpu_timed.sh"
TIMED_TAIL=12
for PART in "$@"; do
    case $PART in
        tuned-W-A|tuned-W-B|tuned-W-C)  # a tuple tuned in its own part: a tune inside this one would not fit its limit
            [ "$ARMS" = $TUNES ] || cp -u $TUNES/tuple-*.json "$ARMS/" 2> /dev/null  # -u: a newer tune's
            T=$ARMS/tuple-${PART#tuned-}.json
            if [ -f "$T" ]; then
                # the tuple names the FA4 version it was tuned with ("" for none), a deployment fact: a
                # tuple tuned without FA4 (W-A's, lease 22) is served with FA4 off the path (the default's
                # attention is the Triton kernel either way, so the arms' kernels compare like for like)
                P=$PYTHONPATH
                python3 -c "import json,sys; sys.exit(json.load(open('$T'))['deployment']['facts']['fa4'] != '')" \
                    && P=$(echo "$P" | tr ':' '\n' | grep -v fa4site | paste -sd:)
                PYTHONPATH=$P timed "arms-$PART" 560 python3 benchmarks/serve_arms.py run $A --arms "$PART"
            else
                echo "$PART: no $T; run tune-${PART#tuned-} first"
            fi ;;
        stock|pinned-default|conservative)  # SERVER_ARGS, TAG: a scheduling experiment stored as its own arm
            timed "arms-$PART" 560 python3 benchmarks/serve_arms.py run $A --arms "$PART" ${TAG:+"--tag=$TAG"} \
                ${SERVER_ARGS:+"--server-args=$SERVER_ARGS"} ;;
        pinned-default-again)  # the default's second run, pinned-default@2: the run-to-run drift
            timed "arms-$PART" 560 python3 benchmarks/serve_arms.py run $A --arms pinned-default --tag @2 ;;
        tune-W-A|tune-W-B|tune-W-C)  # W-C: with FA4 on the path (its attention candidates)
            W=${PART#tune-}
            B=${TUNE_BUDGET:-570}  # less when the call also installs (its 600 s holds both)
            # the Poisson loads' rates are fractions of stock's served lambda_max where a stock part (or
            # LAMBDA_MAX_FROM) gave one: the tune's own maximum, offline under the default, is higher
            LM=$(python3 benchmarks/serve_arms.py lambda-max $W $ARMS ${LAMBDA_MAX_FROM:-})
            timed "$PART" $((B + 20)) detent tune --model $M $FACTS --workload $W --num-requests $N --cost kernels \
                --time-budget "$B" ${LM:+--max-throughput $LM} ${TUNE_ARGS:-} -o $TUNES/tuple-$W.json ;;
        vllm|vllm-bi)  # vllm-bi: VLLM_BATCH_INVARIANT=1, vLLM's batch-invariant mode (the paper's vLLM-Det)
            BI=0; VTAG=""
            [ "$PART" = vllm-bi ] && BI=1 && VTAG=-bi
            VLLM_BATCH_INVARIANT=$BI PYTHONPATH=${VLLM_PATH:-/tmp/vsite} \
                setsid python3 -m vllm.entrypoints.openai.api_server --model $M --load-format dummy \
                --dtype bfloat16 --max-model-len 8192 --served-model-name m --port 8200 \
                --gpu-memory-utilization 0.88 > "$OUT/$PART-server.log" 2>&1 &
            V=$!
            for _ in $(seq 300); do
                python3 -c "import urllib.request as u; u.urlopen('http://127.0.0.1:8200/health', timeout=2)" \
                    2> /dev/null && break
                sleep 1
            done
            timed "arms-$PART" 480 python3 benchmarks/serve_arms.py run $A --arms '' --tag="$VTAG" \
                --vllm-url http://127.0.0.1:8200
            kill -- -$V; wait $V 2> /dev/null ;;  # its process group: vLLM's engine core too
        report)
            python3 benchmarks/serve_arms.py report $ARMS | tail -30 ;;
        *)
            echo "unknown part $PART"; exit 2 ;;
    esac
    # one archive of the arms' folder (and the tuples): a device call's $OUT returns a few files, and
    # a folder of many came back without its logs and figures (lease 29)
    tar czf "$OUT/$(basename $ARMS).tgz" -C /tmp "$(basename $ARMS)" $([ "$ARMS" = $TUNES ] || basename $TUNES)
done
