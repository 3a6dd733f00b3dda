#!/usr/bin/env bash
# Byte-identity check of two source trees: every ckpt command on the same inputs, outputs compared.
#   scripts/compare_trees.sh OLD_REV NEW_REV [WORKDIR]     e.g. scripts/compare_trees.sh main HEAD
# A REV of "." is this working tree as it is (uncommitted changes included). Each REV is exported with
# `git archive` into WORKDIR/tree-<label>; scripts/compare_trees.py runs the commands (the demo workflow on
# a factory run and on the genuine fixture, the HEAD fixtures through the commands that take them) with
# each tree and compares exit codes, normalized stdout/stderr and the sha256 of every output file (DCP
# .metadata by decoded content: it holds a random save id). Exit 0 when all match.
set -euo pipefail
cd "$(dirname "$0")/.."
OLD=${1:?usage: compare_trees.sh OLD_REV NEW_REV [WORKDIR]}
NEW=${2:?usage: compare_trees.sh OLD_REV NEW_REV [WORKDIR]}
WORK=${3:-/tmp/ckpt-compare}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$WORK"
tree() {   # REV LABEL -> prints the tree's path
  local rev=$1 label=$2 dst="$WORK/tree-$2"
  if [ "$rev" = "." ]; then echo "$PWD"; return; fi
  rm -rf "$dst"; mkdir -p "$dst"
  git archive "$rev" | tar -x -C "$dst"
  echo "$dst"
}
OLD_TREE=$(tree "$OLD" old)
NEW_TREE=$(tree "$NEW" new)
echo "old: $OLD ($(git rev-parse --short "$([ "$OLD" = . ] && echo HEAD || echo "$OLD")")) at $OLD_TREE"
echo "new: $NEW ($(git rev-parse --short "$([ "$NEW" = . ] && echo HEAD || echo "$NEW")")$([ "$NEW" = . ] && echo ' + working tree')) at $NEW_TREE"
exec "$PY" scripts/compare_trees.py --old "$OLD_TREE" --new "$NEW_TREE" --work "$WORK"
