#!/usr/bin/env bash
# The main workflow on a small genuine prime-rl-style checkpoint (written by 4 gloo FSDP2 ranks).
set -euo pipefail
PY=${1:-.venv/bin/python}
OUT=${2:-demo-out}
CKPT="$PY -m ckpt_tools"
step() { echo; echo "==> $*"; }

step "generate a prime-rl-layout run (4 FSDP2 ranks, LoRA r=8 on all 7 projections)"
$PY -m ckpt_tools.fixtures.factory "$OUT/run"
TRAINER=$(ls -d "$OUT"/run/outputs/checkpoints/step_*/trainer | tail -1)

step "ckpt inspect $TRAINER"
$CKPT inspect "$TRAINER"
