#!/usr/bin/env bash
# The benchmark on the GPU host (16 cores, 128 GiB RAM, 64 GiB disk, no network), one job of at most 600 s:
#
#   the tree and .whl/ copied to the host, 600 s at most:
#     bash bench/device_run.sh
#
# First, here: `bash bench/device_wheels.sh` puts the wheels the host lacks into .whl/ (tomlkit; with
# --mergekit, mergekit and its dependencies too), and `echo /.whl/ >> .git/info/exclude`.
#
# It runs bench/harness.py at 8B, then 0.6B with whatever time is left, stopping new work after
# BUDGET_S seconds, and renders the report there too. Everything lands in $RESULTS_DIR (6 files):
# results.json, report.md, device_run.log and three PNG plots. Back here:
#   python bench/report.py $FILES_AT/results.json --label "16-core GPU host" --plots docs/bench \
#          --record docs/benchmarks.md
#
# Three calls cover issue 14 (each fits the 600 s limit: BUDGET_S 480 stops new work, the harness is
# killed at BUDGET_S + 60; a fresh machine per call rebuilds its inputs, which the budget includes):
#
#   1. PHASE=floors    bash bench/device_run.sh   8B (then 0.6B) at N = 1: every command beside its floors
#                                                 (cat, cp && sync, the safetensors rewrite) and peers
#   2. PHASE=ranks-hf  bash bench/device_run.sh   8B at N = 1, 2, 4, 8 (--ranks-only: the ckpt commands
#                                                 alone; their floors are call 1's): merge, diff-vs-base,
#                                                 diff-vs-base --adapter, verify --deep HF dir
#   3. PHASE=ranks-dcp bash bench/device_run.sh   8B at N = 1, 2, 4, 8 (--ranks-only): adapter-to-dcp,
#                                                 verify --deep DCP, slim, rehydrate, merge --base-from-checkpoint
#
# i.e. a job on the GPU host (the tree and .whl/, 600 s at most) running
# `PHASE=ranks-hf bash bench/device_run.sh` (and so on). Each call's $RESULTS_DIR holds results.json, report.md,
# device_run.log and the plots; back here, one section per call:
#   python bench/report.py $FILES_AT/results.json --label "16-core GPU host, $PHASE" --plots docs/bench \
#          --record docs/benchmarks.md
# Issue 22 (the checkpoint side at 8B, each command beside its issue-22 floor, 5 runs for a verdict) is
# three more calls, made back to back so the warm host keeps the inputs in WORK/DCP_DIR:
#   PHASE=i22-ckpt  slim, rehydrate (floors: cat dcp, cp -r dcp && sync)
#   PHASE=i22-out   export, merge --base-from-checkpoint, extract-adapter (floors: cat dcp + cp -r base && sync,
#                   cat LoRA items)
#   PHASE=i22-diff  diff-vs-base, diff-vs-base --adapter (floors: cat merged base [adapter]; with
#                   DEVICE_TESTS="tests/test_value_check_cuda.py" the CUDA check's tests first)
#   PHASE=i22-ranks N = 1 (plain and under torchrun), 2, 4, 8 of slim, rehydrate, export, diff-vs-base
#                   (--ranks-only; every N shuffled per repetition)
# Issue 35 (block-FP8 outputs at 8B, 5 repetitions, shuffled): two calls back to back on the warm host,
#   PHASE=fp8-merge   merge --dtype fp8 beside ckpt merge (bf16) and cp -r base && sync
#   PHASE=fp8-export  export --dtype fp8 beside ckpt export (bf16) and cp -r base && sync
#   (checked here at the tiny size: RESULTS_DIR=/tmp/o WORK=/tmp/w PYTHON=.venv/bin/python SIZES=tiny REPEAT=1
#   PHASE=fp8-merge bash bench/device_run.sh; the smoke line says whether the FP8 error kernel loaded)
# Knobs (environment) override a phase: SIZES, RANKS, REPEAT, BUDGET_S, CASES, EXTRA, LABEL.
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS_DIR=${RESULTS_DIR:-${OUT:-/tmp/ckpt-bench-out}}  # the host's folder that comes back, where it sets one
mkdir -p "$RESULTS_DIR"
exec > >(tee "$RESULTS_DIR/device_run.log") 2>&1

PY=${PYTHON:-python3}
PHASE=${PHASE:-floors}
if [ "$PHASE" = startup ]; then
    # issue 13's target on 2 cores: bench/startup.py pinned to 2 of the host's idle cores, for the tree
    # before (.trees/pre-s2, carried: `git archive 87c7798 ckpt_tools | tar -x -C .trees/pre-s2`) and this
    # one, with the Qwen3-32B-sized run carried in .bench-meta/run (4316 keys, 14,501 items, a 3.4 MiB
    # .metadata: `python -m tests.factory.head_factory /tmp/bigrun --kind dense --world-size 4 --layers 64
    # --hidden-size 64 --intermediate-size 128 --max-steps 1`, then its configs/ and outputs/checkpoints/
    # copied to .bench-meta/run/ if the carry limit allows, else made here). The C scan is built in
    # place first (pip installs nothing here).
    "$PY" setup.py -q build_ext --inplace 2>&1 | tail -3
    "$PY" -c "from ckpt_tools.io import pickle_scan as p; print('C scan:', p.accelerator)"
    echo "== what --version imports here (the 8B floors run measured 6.5 s and 690 MB for it)"
    "$PY" -X importtime -m ckpt_tools --version 2>&1 | sort -t'|' -k2 -n | tail -8
    "$PY" -c "import sys, subprocess; print(sys.flags, sys.path[:4])"
    BIG=$PWD/.bench-meta/run/outputs/checkpoints/step_1/trainer
    if [ ! -f "$BIG/.metadata" ]; then   # not carried (the 64 MiB carry limit): made here, ~1 min
        BIG=/tmp/bigrun/outputs/checkpoints/step_1/trainer
        [ -f "$BIG/.metadata" ] || "$PY" -m tests.factory.head_factory /tmp/bigrun --kind dense --world-size 4 \
            --layers 64 --hidden-size 64 --intermediate-size 128 --max-steps 1 | tail -2
    fi
    for tree in .trees/pre-s2 .; do
        [ -d "$tree/ckpt_tools" ] || continue
        echo "== startup: tree $tree, taskset -c 0,1"
        taskset -c 0,1 "$PY" bench/startup.py --tree "$tree" --repeat "${REPEAT:-7}" --dcp "$BIG" --markdown
    done
    exit 0
fi
case "$PHASE" in
    floors)    D_SIZES=8b,0.6b; D_RANKS=1;       D_CASES=;  D_EXTRA= ;;
    ranks-hf)  D_SIZES=8b;      D_RANKS=1,2,4,8; D_EXTRA=--ranks-only
               D_CASES="merge,diff-vs-base,diff-vs-base --adapter,verify --deep HF dir" ;;
    ranks-dcp) D_SIZES=8b;      D_RANKS=1,2,4,8; D_EXTRA=--ranks-only
               D_CASES="adapter-to-dcp,verify --deep DCP,slim,rehydrate,merge --base-from-checkpoint" ;;
    i22-ckpt)  D_SIZES=8b;      D_RANKS=1;       D_EXTRA=; D_SKIP="torch dcp,cat slim base"
               D_CASES="slim,rehydrate" ;;
    i22-out)   D_SIZES=8b;      D_RANKS=1;       D_EXTRA=; D_SKIP="torch dcp,torch _load,python -c pass,cp -r adapter,=cp -r base && sync,=cat dcp"
               D_CASES="extract-adapter,export,merge --base-from-checkpoint" ;;
    i22-diff)  D_SIZES=8b;      D_RANKS=1;       D_EXTRA=; D_SKIP=
               D_CASES="diff-vs-base,diff-vs-base --adapter" ;;
    i22-ranks) D_SIZES=8b;      D_RANKS=1,2,4,8; D_EXTRA=--ranks-only
               D_CASES="slim,rehydrate,export,diff-vs-base" ;;
    fp8-merge) D_SIZES=8b;      D_RANKS=1;       D_EXTRA=; D_SKIP=; REPEAT=${REPEAT:-5}
               D_CASES="merge --dtype fp8" ;;
    fp8-export) D_SIZES=8b;     D_RANKS=1;       D_EXTRA=; D_SKIP=; REPEAT=${REPEAT:-5}
               D_CASES="export --dtype fp8" ;;
    *) echo "PHASE must be floors, ranks-hf, ranks-dcp, i22-ckpt, i22-out, i22-diff, i22-ranks, fp8-merge or fp8-export (got $PHASE)"; exit 2 ;;
esac
SIZES=${SIZES:-$D_SIZES}
RANKS=${RANKS:-$D_RANKS}
REPEAT=${REPEAT:-1}
BUDGET_S=${BUDGET_S:-480}
CASES=${CASES:-$D_CASES}
EXTRA=${EXTRA:-$D_EXTRA}
SKIP=${SKIP:-${D_SKIP:-}}
LABEL=${LABEL:-16-core GPU host}
WORK=${WORK:-/tmp/ckpt-bench-device}
export PYTHONUNBUFFERED=1

if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || { echo "wheel install failed"; exit 1; }
    export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
    export PATH=/tmp/site/bin:$PATH
fi
MERGEKIT=$(command -v mergekit-yaml || true)
if [ -n "$MERGEKIT" ] && ! "$MERGEKIT" --help >/dev/null 2>&1; then
    echo "mergekit-yaml does not start here (a carried wheel does not fit the image): no mergekit rows"
    "$MERGEKIT" --help 2>&1 | tail -3
    MERGEKIT=
fi

echo "== host (phase $PHASE: sizes $SIZES, ranks $RANKS, cases ${CASES:-all})"; nproc; free -g; df -h / /tmp /dev/shm 2>/dev/null; "$PY" --version
# Fail in seconds, not minutes, if ckpt_tools does not run here (Python 3.12, torch 2.11).
echo "== smoke"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" setup.py -q build_ext --inplace 2>&1 | tail -3    # the C pickle scan, delta stats and FP8 error (nothing is pip-installed here)
"$PY" -c "from ckpt_tools.io import pickle_scan as p; from ckpt_tools.sources import compare as c; from ckpt_tools.core import fp8; print('C:', p.accelerator, c.accelerator, fp8.accelerator, 'path', fp8.accelerator and fp8.accelerator.best_path())"
if [ -n "${DEVICE_TESTS:-}" ]; then   # tests whose answer depends on this host's CPU/BLAS (pytest is in its image)
    # shellcheck disable=SC2086
    "$PY" -m pytest -q -p no:cacheprovider $DEVICE_TESTS 2>&1 | tail -5
fi
# (`--version` reads the package's installed metadata: nothing is pip-installed here, so it cannot run)
"$PY" -m ckpt_tools inspect --help >/dev/null || exit 1
"$PY" -m ckpt_tools inspect tests/fixtures/primerl-tiny/outputs/checkpoints/step_3/trainer >/dev/null || exit 1
"$PY" -m ckpt_tools verify --deep tests/fixtures/primerl-tiny/outputs/checkpoints/step_3/trainer || exit 1
if [ "$RANKS" != 1 ]; then   # multi-rank works here (gloo on this host) before minutes go into inputs
    "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 -m ckpt_tools verify --deep \
        tests/fixtures/primerl-tiny/outputs/checkpoints/step_3/trainer --json >/dev/null || exit 1
fi

# The 8B DCP is 34 GB: beside the base (16 GB) and one output it fits a 64 GiB disk only without the
# merged copy, so keep DCP inputs in RAM (tmpfs) when the disk is short and /dev/shm is big enough.
free_gb() { df -P --block-size=1G "$1" 2>/dev/null | awk 'NR==2 {print $4}'; }
mkdir -p "$WORK"
DCP_DIR=$WORK
if [ "$(free_gb "$WORK")" -lt 90 ] && [ "$(free_gb /dev/shm || echo 0)" -ge 40 ]; then
    DCP_DIR=/dev/shm/ckpt-bench
fi
echo "== harness (DCP inputs in $DCP_DIR)"
args=(--sizes "$SIZES" --ranks "$RANKS" --repeat "$REPEAT" --dcp ckpt --workdir "$WORK" --dcp-dir "$DCP_DIR"
      --free-inputs --defer-peers --budget-s "$BUDGET_S" --results "$RESULTS_DIR/results.json" --python "$PY")
[ -n "$CASES" ] && args+=("--cases=$CASES")
[ -n "$SKIP" ] && args+=("--skip-contenders=$SKIP")  # = form: a case may begin with "--"
[ -n "$MERGEKIT" ] && args+=(--mergekit "$MERGEKIT")
# shellcheck disable=SC2086
timeout $((BUDGET_S + 60)) "$PY" bench/harness.py "${args[@]}" $EXTRA
echo "harness exit $?"

echo "== report"
"$PY" bench/report.py "$RESULTS_DIR/results.json" --label "$LABEL" --plots "$RESULTS_DIR" > "$RESULTS_DIR/report.md" || echo "report failed"
ls -la "$RESULTS_DIR"
