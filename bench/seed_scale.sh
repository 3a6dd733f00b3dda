#!/usr/bin/env bash
# Issue 23 on the device host: the seed's Qwen3-32B LoRA checkpoint written by FSDP2 over every GPU with
# NCCL, then each command timed beside its floor and checked against the generator's truth
# (bench/seed_scale.py says what each phase does).
#
#   here, once:  bash bench/device_wheels.sh && echo /.whl/ >> .git/info/exclude
#   on a 4-GPU host (H200), the tree and .whl/ copied there, 600 s at most:
#       SIZE=32b PHASE=generate bash bench/seed_scale.sh     # ~126 GB checkpoint + 65 GB base in ROOT
#       SIZE=32b PHASE=measure  bash bench/seed_scale.sh     # within 30 s of the last call: the disk is kept
#   back here:   python bench/seed_scale.py report $FILES_AT/seed-32b.json   (the docs/benchmarks.md table)
#                and copy $FILES_AT/seed-32b.json to bench/results/
#
# Until the 4-GPU host is lent, the same on the 1-GPU host: SIZE=8b or 14b (NCCL with one rank).
# PHASE=all runs both in one call (fits 600 s at 8B). Knobs: SIZE, PHASE, ROOT, RANKS, STEPS.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS_DIR=${RESULTS_DIR:-${OUT:-/tmp/seed-out}}  # the host's folder that comes back, where it sets one
mkdir -p "$RESULTS_DIR"
exec > >(tee -a "$RESULTS_DIR/seed_scale.log") 2>&1
PY=${PYTHON:-python3}
SIZE=${SIZE:-32b}
PHASE=${PHASE:-all}
ROOT=${ROOT:-/tmp/seed-$SIZE}         # the 1-GPU host's 64 GB disk: ROOT=/dev/shm/seed-8b (RAM)
WORKDIR=${WORKDIR:-/tmp/seed-work}    # each output, deleted once checked
STEPS=${STEPS:-2}
NGPU=$("$PY" -c 'import torch; print(max(1, torch.cuda.device_count()))')
RANKS=${RANKS:-$([ "$NGPU" -gt 1 ] && echo "1,$NGPU" || echo "1,4")}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" setup.py -q build_ext --inplace 2>&1 | tail -2
mkdir -p "$(dirname "$ROOT")"
echo "== $(date -u) size $SIZE, $NGPU GPU(s), ranks $RANKS, root $ROOT; disk:"; df -h "$(dirname "$ROOT")" | tail -1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -8
if [ "$PHASE" = generate ] || [ "$PHASE" = all ]; then
    rm -rf "$ROOT"
    "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NGPU" bench/seed_scale.py generate \
        --size "$SIZE" --root "$ROOT" --steps "$STEPS" || exit 1
    cp "$ROOT/seed_scale.json" "$RESULTS_DIR/seed-$SIZE-generator.json"
    du -sh "$ROOT"/outputs/checkpoints/*/trainer "$ROOT/base_model"
fi
if [ "$PHASE" = measure ] || [ "$PHASE" = all ]; then
    "$PY" bench/seed_scale.py measure --root "$ROOT" --ranks "$RANKS" --workdir "$WORKDIR" --results "$RESULTS_DIR/seed-$SIZE.json"
    rc=$?
    "$PY" bench/seed_scale.py report "$RESULTS_DIR/seed-$SIZE.json" | tee "$RESULTS_DIR/seed-$SIZE.md"
    exit $rc
fi
