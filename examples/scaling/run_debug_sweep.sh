#!/usr/bin/env bash
# Debug-scale scaling study on a CPU (~5-8 min on 2 cores): `k3 sweep` trains 9 K3-shaped models (3 sizes x
# 3 token budgets) on the Python standard library, then `k3 scaling-fit` fits L(N, D) = E + A/N^alpha + B/D^beta.
#
#   bash examples/scaling/run_debug_sweep.sh                    # runs in ./runs/scaling-debug, fit in .../fit
#   OUT=/tmp/sw FIT=/tmp/fit bash examples/scaling/run_debug_sweep.sh
#   bash examples/scaling/run_debug_sweep.sh --update-example   # the fit replaces the committed fit.* beside this
#
# Interrupt it at any time (Ctrl-C checkpoints the running model); running it again skips the finished runs and
# resumes the interrupted one. K3 names the k3 executable (default `k3`; e.g. K3="python -m k3.cli").
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
OUT="${OUT:-runs/scaling-debug}"    # sweep directory: runs/<size>-<ratio>/, runs.csv, token cache
FIT="${FIT:-$OUT/fit}"              # where fit.json, fit.png and a copy of runs.csv go
# the committed example outputs (runs.csv, fit.json, fit.png beside this script) change only when asked to
case "$#:${1:-}" in
  0:) ;;
  1:--update-example) FIT="$HERE" ;;
  *) echo "usage: bash $0 [--update-example]  (OUT, FIT, THREADS and K3 are environment variables)" >&2; exit 2 ;;
esac
echo "sweep: $OUT; fit: $FIT"
THREADS="${THREADS:-2}"
K3="${K3:-k3}"

# Sizes are active non-embedding parameters (what scaling-fit's N means by default). At this scale the sweep picks
# d = 32 with 2, 3 and 4 layers (the debug preset's smallest K3-shaped models, 23k-51k parameters). Token budgets
# span 2.5-25 tokens per parameter so that both terms of L(N, D) matter. Batch 32 x seq 64 = 2048 tokens per step;
# no evaluation until the final one (8 batches = 16k validation tokens); 5 MB of text = ~2.1M training tokens, more
# than the largest run reads.
$K3 sweep --preset debug --sizes 25k,35k,50k --tokens-per-param 2.5,8,25 \
  --set train.batch_size=32 --set train.eval_every=0 --set train.eval_batches=8 --set train.log_every=10 \
  --set ckpt.every=100 --set data.max_bytes=5000000 --set train.threads="$THREADS" \
  --set data.cache_dir="$OUT/cache" --out "$OUT"

mkdir -p "$FIT"
cp "$OUT/runs.csv" "$FIT/runs.csv"
$K3 scaling-fit "$FIT/runs.csv" --out "$FIT" --budget 1e12 --budget 1e13
