#!/usr/bin/env bash
# Here, before a lease: Detent's runtime dependencies that the GPU machine's image and the server's
# wheel set in `.whl/` lack, downloaded into `.whl/` for the device's Python (3.12, manylinux x86_64),
# so that `device_setup.sh site` installs every one. Without partial-json-parser detent-serve refuses
# to start (lease 26's first call); without jsonschema a response_format request cannot be checked.
# Usage: bash benchmarks/device_wheels_extra.sh [PIP]   (PIP defaults to `python3 -m pip`)
set -eu
PIP=${1:-python3 -m pip}
$PIP download -q --no-deps -d .whl --python-version 3.12 --platform manylinux2014_x86_64 --only-binary=:all: \
    partial-json-parser jsonschema jsonschema-specifications referencing rpds-py attrs gguf
ls .whl | wc -l
