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
STEP_N=$(basename "$(dirname "$TRAINER")"); STEP_N=${STEP_N#step_}

step "ckpt extract-adapter: the checkpoint's LoRA as a PEFT adapter (alpha from the run's orch.toml)"
$CKPT extract-adapter "$TRAINER" "$OUT/adapter"

step "ckpt fix-adapter: prime-rl's own broadcast export (PEFT silently ignores it) repaired"
$CKPT inspect "$OUT/run/outputs/run_default/broadcasts/step_$STEP_N" >/dev/null
$CKPT fix-adapter "$OUT/run/outputs/run_default/broadcasts/step_$STEP_N" "$OUT/adapter-fixed"
cmp "$OUT/adapter/adapter_model.safetensors" "$OUT/adapter-fixed/adapter_model.safetensors" \
  && echo "the repaired export holds exactly the extracted tensors"

step "ckpt adapter-to-dcp: back to a checkpoint prime-rl resumes from (fresh AdamW, new lr, warmup restarts)"
$CKPT adapter-to-dcp "$OUT/adapter" "$OUT/resume/outputs/checkpoints/step_$STEP_N/trainer" \
  --base "$OUT/run/base_model" --lr 5e-3 --step "$STEP_N" --scheduler linear --warmup-steps 2 --scheduler-step 0
$CKPT inspect "$OUT/resume/outputs/checkpoints/step_$STEP_N/trainer" --alpha 16
