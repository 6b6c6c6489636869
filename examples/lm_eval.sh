#!/usr/bin/env bash
# lm-evaluation-harness on a k3 checkpoint: `k3 eval lm` starts `k3 serve CKPT` on a free loopback port, runs
# lm-eval's local-completions model against it on the two local tasks of tests/serve/lm_eval_task/ (k3_python_mc:
# multiple choice by log-likelihood; k3_python_gen: one greedy line of Python, exact match; no downloads), prints the
# results table, writes OUT/results.json and stops the server. Needs the `eval` extra: pip install -e '.[eval]'.
#
#   bash examples/lm_eval.sh                          # runs/tiny/final -> runs/lm-eval/results.json
#   bash examples/lm_eval.sh runs/small/final /tmp/ev # another checkpoint and output folder
#
# Hub tasks download their data on first use, e.g. `k3 eval lm runs/tiny/final --tasks hellaswag,arc_easy --limit
# 200 --output runs/lm-eval/hub.json`. K3 names the k3 executable (default `k3`; e.g. K3="python -m k3.cli").
set -euo pipefail
CKPT=${1:-runs/tiny/final}
OUT=${2:-runs/lm-eval}
K3=${K3:-k3}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [[ ! -f "$CKPT/config.json" ]]; then
  echo "no release at $CKPT: train it first (k3 pretrain --out runs/tiny, about 10 minutes), or pass one" >&2
  exit 2
fi
CKPT=$(cd "$CKPT" && pwd)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$ROOT/tests/serve/lm_eval_task"  # lm-eval reads the tasks' relative data_files from the working directory
$K3 eval lm "$CKPT" --tasks k3_python_mc,k3_python_gen --include-path . --output "$OUT/results.json"
