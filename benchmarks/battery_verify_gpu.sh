#!/usr/bin/env bash
# Issue 20's invariance tools on one GPU (Llama-3.1-8B shapes, Detent's dummy
# weights written as safetensors, word-level tokenizer):
#   offline: `detent battery` in process, all 35 cells, pinned then stock;
#   http:    `detent-serve --request-log`, 100 concurrent requests
#            (benchmarks/verify_load.py), `detent battery --url`, then
#            `detent verify` on the log, and again with one pin changed
#            (the tuple hash differs: every record must be refused).
# Usage: bash benchmarks/battery_verify_gpu.sh OUTDIR [offline|http|all]
set -u
OUT=$1
PART=${2:-all}
M=/tmp/wl8b
mkdir -p "$OUT"
[ -f $M/model.safetensors.index.json ] || [ -f $M/model.safetensors ] || \
    python3 benchmarks/wordlevel_model.py $M --weights > "$OUT/weights.txt" 2>&1
timed() {  # NAME CMD...: run, keep stdout+stderr in OUT/NAME.txt, print exit status and seconds
    local name=$1; shift
    local t0=$SECONDS
    "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s"
    grep -v "it/s\]" "$OUT/$name.txt" | tail -4
}
if [ "$PART" != http ]; then
    for s in pinned stock; do
        timed battery_$s detent battery --model $M --device cuda --dtype bfloat16 --selection $s --cells all \
            --json "$OUT/battery_$s.json"
    done
fi
if [ "$PART" != offline ]; then
    rm -f /tmp/requests.jsonl
    detent-serve --model $M --max-model-len 4096 --port 8000 --request-log /tmp/requests.jsonl \
        > "$OUT/serve.log" 2>&1 &
    srv=$!
    for _ in $(seq 300); do
        curl -sf http://127.0.0.1:8000/health > /dev/null && break
        sleep 1
    done
    timed verify_load python3 benchmarks/verify_load.py --url http://127.0.0.1:8000 -n 100
    timed battery_http detent battery --url http://127.0.0.1:8000 --cells all --json "$OUT/battery_http.json"
    kill -INT $srv
    wait $srv
    cp /tmp/requests.jsonl "$OUT/"
    timed verify detent verify /tmp/requests.jsonl --model $M --json "$OUT/verify.json"
    python3 - <<'EOF'
import json
for line in open("/tmp/requests.jsonl"):
    r = json.loads(line)
    if r["type"] == "server":
        t = r["tuple"]
        break
a = t["families"]["attention"]
a["knobs"]["split_stride"] = 1024
a["pins"]["split_tokens"] = 1024
json.dump(t, open("/tmp/t_other.json", "w"))
EOF
    timed verify_other_tuple detent verify /tmp/requests.jsonl --model $M --tuple /tmp/t_other.json
fi
