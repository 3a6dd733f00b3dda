#!/usr/bin/env bash
# The main workflow on a small genuine prime-rl-style checkpoint (written by 4 gloo FSDP2 ranks).
set -euo pipefail
PY=${1:-.venv/bin/python}
DEMO_DIR=${2:-demo-out}
CKPT="$PY -m ckpt_tools"
step() { echo; echo "==> $*"; }

step "generate a prime-rl-layout run (4 FSDP2 ranks, LoRA r=8 on all 7 projections)"
$PY -m tests.factory "$DEMO_DIR/run"
TRAINER=$(ls -d "$DEMO_DIR"/run/outputs/checkpoints/step_*/trainer | tail -1)

step "ckpt inspect $TRAINER"
$CKPT inspect "$TRAINER"
STEP_N=$(basename "$(dirname "$TRAINER")"); STEP_N=${STEP_N#step_}

step "ckpt extract-adapter: the checkpoint's LoRA as a PEFT adapter (alpha from the run's orch.toml)"
$CKPT extract-adapter "$TRAINER" "$DEMO_DIR/adapter"

step "ckpt fix-adapter: prime-rl's own broadcast export (PEFT silently ignores it) repaired"
$CKPT inspect "$DEMO_DIR/run/outputs/run_default/broadcasts/step_$STEP_N" >/dev/null
$CKPT fix-adapter "$DEMO_DIR/run/outputs/run_default/broadcasts/step_$STEP_N" "$DEMO_DIR/adapter-fixed"
cmp "$DEMO_DIR/adapter/adapter_model.safetensors" "$DEMO_DIR/adapter-fixed/adapter_model.safetensors" \
  && echo "the repaired export holds exactly the extracted tensors"

step "ckpt adapter-to-dcp: back to a checkpoint prime-rl resumes from (fresh AdamW, new lr, warmup restarts)"
$CKPT adapter-to-dcp "$DEMO_DIR/adapter" "$DEMO_DIR/resume/outputs/checkpoints/step_$STEP_N/trainer" \
  --base "$DEMO_DIR/run/base_model" --lr 5e-3 --step "$STEP_N" --scheduler linear --warmup-steps 2 --scheduler-step 0
$CKPT inspect "$DEMO_DIR/resume/outputs/checkpoints/step_$STEP_N/trainer" --alpha 16

step "ckpt merge: the checkpoint's LoRA merged into the bf16 base (fp32 math, one rounding), streaming"
$CKPT merge "$DEMO_DIR/run/base_model" "$TRAINER" "$DEMO_DIR/merged" --dry-run
$CKPT merge "$DEMO_DIR/run/base_model" "$TRAINER" "$DEMO_DIR/merged"

step "ckpt merge --base-from-checkpoint: no base download, the checkpoint's fp32 masters are the base"
$CKPT merge --base-from-checkpoint "$TRAINER" "$DEMO_DIR/merged-from-ckpt" --config-from "$DEMO_DIR/run/base_model"
diff -r "$DEMO_DIR/merged" "$DEMO_DIR/merged-from-ckpt" && echo "identical bytes either way"

step "ckpt diff-vs-base: prime-rl's own weights export is bitwise the base (exit 3: the LoRA was not merged)"
GENUINE="$(dirname "$0")/../tests/fixtures/primerl-tiny"
if [ -d "$GENUINE/outputs/weights/step_3" ]; then
  EXPORT="$GENUINE/outputs/weights/step_3"; EXPORT_BASE="$GENUINE/base_model"
else  # no genuine fixture beside the repo: prime-rl's export holds exactly the base's bytes
  EXPORT="$DEMO_DIR/primerl-weights-export"; EXPORT_BASE="$DEMO_DIR/run/base_model"; cp -r "$EXPORT_BASE" "$EXPORT"
fi
rc=0; $CKPT diff-vs-base "$EXPORT" "$EXPORT_BASE" || rc=$?
[ "$rc" -eq 3 ] || { echo "expected exit 3 (identical to base), got $rc"; exit 1; }
echo "exit 3, as expected: identical to base"

step "ckpt diff-vs-base: our merge differs from the base exactly by the LoRA (0 ulps off)"
$CKPT diff-vs-base "$DEMO_DIR/merged" "$DEMO_DIR/run/base_model" --adapter "$TRAINER" --top 3

step "ckpt verify: integrity of the checkpoint (CRC32 of every payload) and of the merged model"
$CKPT verify "$TRAINER" --deep
$CKPT verify "$DEMO_DIR/merged"

step "ckpt slim: keep only the unique state, then rehydrate it bit-exactly from the base"
$CKPT slim "$TRAINER" "$DEMO_DIR/slim" --base "$DEMO_DIR/run/base_model"
$CKPT inspect "$DEMO_DIR/slim"
$CKPT rehydrate "$DEMO_DIR/slim" "$DEMO_DIR/rehydrated" --base "$DEMO_DIR/run/base_model"
$CKPT verify "$DEMO_DIR/rehydrated"

step "ckpt set-lr: halve the lr of the whole remaining schedule, keeping the Adam moments (hard links + KB)"
$CKPT set-lr "$TRAINER" "$DEMO_DIR/lr-half" --scale 0.5 --dry-run
$CKPT set-lr "$TRAINER" "$DEMO_DIR/lr-half" --scale 0.5
$CKPT inspect "$DEMO_DIR/lr-half" --json | "$PY" -c 'import json,sys; r=json.load(sys.stdin); print("lr now", r["result"]["lr"])'

step "ckpt restart-prep: a fresh-LR restart on the merged model (merged bf16 dir + the next command)"
$CKPT restart-prep "$TRAINER" "$DEMO_DIR/restart-merged" --base "$DEMO_DIR/run/base_model" --lr 5e-3

echo; echo "demo done: outputs in $DEMO_DIR/"
