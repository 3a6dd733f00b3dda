#!/usr/bin/env bash
# The benchmark on the GPU host (16 cores, 128 GiB RAM, 64 GiB disk, no network), one device call:
#
#   device tool `run`, carry [".whl"], timeout_s 600:
#     bash bench/device_run.sh
#
# First, here: `bash bench/device_wheels.sh` puts the wheels the host lacks into .whl/ (tomlkit; with
# --mergekit, mergekit and its dependencies too), and `echo /.whl/ >> .git/info/exclude`.
#
# It runs bench/harness.py at 8B, then 0.6B with whatever time is left, stopping new work after
# BUDGET_S seconds, and renders the report there too. Everything lands in $OUT (6 files):
# results.json, report.md, device_run.log and three PNG plots. Back here:
#   python bench/report.py $FILES_AT/results.json --label "16-core GPU host" --plots docs/bench \
#          --record docs/benchmarks.md
#
# Knobs (environment): SIZES (8b,0.6b), RANKS (1), REPEAT (1), BUDGET_S (480), CASES (all), EXTRA (more
# harness flags, e.g. "--ranks-only" for a rank sweep of the ckpt commands alone). A second call for the
# rank sweep, once `torchrun -m ckpt_tools` works:
#   RANKS=1,2,4,8 EXTRA=--ranks-only CASES="merge,diff-vs-base,verify --deep HF dir" bash bench/device_run.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/ckpt-bench-out}
mkdir -p "$OUT"
exec > >(tee "$OUT/device_run.log") 2>&1

PY=${PYTHON:-python3}
SIZES=${SIZES:-8b,0.6b}
RANKS=${RANKS:-1}
REPEAT=${REPEAT:-1}
BUDGET_S=${BUDGET_S:-480}
CASES=${CASES:-}
EXTRA=${EXTRA:-}
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

echo "== host"; nproc; free -g; df -h / /tmp /dev/shm 2>/dev/null; "$PY" --version
# Fail in seconds, not minutes, if ckpt_tools does not run here (Python 3.12, torch 2.11).
echo "== smoke"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
"$PY" -m ckpt_tools --version || exit 1
"$PY" -m ckpt_tools inspect tests/fixtures/primerl-tiny/outputs/checkpoints/step_3/trainer >/dev/null || exit 1
"$PY" -m ckpt_tools verify --deep tests/fixtures/primerl-tiny/outputs/checkpoints/step_3/trainer || exit 1

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
      --free-inputs --defer-peers --budget-s "$BUDGET_S" --results "$OUT/results.json" --python "$PY")
[ -n "$CASES" ] && args+=("--cases=$CASES")  # = form: a case may begin with "--"
[ -n "$MERGEKIT" ] && args+=(--mergekit "$MERGEKIT")
# shellcheck disable=SC2086
timeout $((BUDGET_S + 60)) "$PY" bench/harness.py "${args[@]}" $EXTRA
echo "harness exit $?"

echo "== report"
"$PY" bench/report.py "$OUT/results.json" --label "$LABEL" --plots "$OUT" > "$OUT/report.md" || echo "report failed"
ls -la "$OUT"
