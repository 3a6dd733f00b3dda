#!/usr/bin/env bash
# Put the wheels the GPU host lacks into .whl/ (ignored by git; copied to the GPU host with the tree). That host has
# Python 3.12 with torch, transformers, peft, safetensors, click and huggingface_hub, and no network.
#   bash bench/device_wheels.sh              # tomlkit (ckpt restart-prep imports it)
#   bash bench/device_wheels.sh --mergekit   # and mergekit with what it needs beyond the host's packages
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl
get() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$@"
}
get tomlkit==0.15.2
if [ "${1:-}" = "--mergekit" ]; then
    # mergekit 0.1.5's requirements that the host's image does not hold (checked against the host's
    # installed package list); the rest (torch, transformers, peft, scipy, pyarrow, ...) are there.
    get mergekit==0.1.5 immutables==0.21 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 \
        typing-inspection==0.4.5 typing-extensions==4.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
fi
ls -la .whl
du -sh .whl
