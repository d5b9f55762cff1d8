# Sourced by the device scripts (fa4_gpu.sh, arms_gpu.sh); needs OUT set.
# timed NAME SECONDS CMD...: run bounded, keep stdout+stderr in OUT/NAME.txt, print exit status,
# seconds and the output's last lines (progress bars left out)
timed() {
    local name=$1 limit=$2; shift 2
    local t0=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - t0)) s"
    grep -v "it/s\]\|step/s\]" "$OUT/$name.txt" | tail -"${TIMED_TAIL:-6}"
    return $rc
}
