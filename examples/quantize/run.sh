#!/usr/bin/env bash
# QAT vs PTQ on the README's default checkpoint (runs/tiny/final, k3-tiny-cpu), on the CPU, at equal data and steps:
#   ft/             the bf16 control: 60 steps of k3 pretrain --init on the standard library, the settings of
#                   k3cli/presets/quantize/default.yaml (lr 1e-3, 5 warmup steps, cosine, 16 x 256 tokens a step)
#   ptq-experts/    RTN and calibrated PTQ of the control: w4a8, group 32, routed experts
#   ptq-all/        the same over all_linear
#   qat-experts/    QAT of runs/tiny/final with the same data, steps and settings: w4a8, group 32, routed experts
#   qat-all/        the same over all_linear
# then summarize.py prints the table of examples/quantize/README.md (4 min 57 s on 2 idle cores, 2026-12-04).
# Usage: bash examples/quantize/run.sh [CKPT [OUT]]; K3 names the k3 executable (default: k3).
set -euo pipefail
CKPT=${1:-runs/tiny/final}
OUT=${2:-runs/quantize-example}
K3=${K3:-k3}
HERE=$(cd "$(dirname "$0")" && pwd)
if [[ ! -f "$CKPT/config.json" ]]; then
  echo "no release at $CKPT: train it first (k3 pretrain --out runs/tiny, about 10 minutes)" >&2
  exit 2
fi
STEPS=(--set train.max_steps=60 --set optim.lr=0.001 --set optim.warmup_steps=5 --set train.eval_every=0
       --set ckpt.every=30)
mkdir -p "$OUT"
[[ -f "$OUT/ft/final/config.json" ]] || "$K3" pretrain --preset tiny --init "$CKPT" --out "$OUT/ft" "${STEPS[@]}"
for mods in experts all; do
  m=$([[ $mods == experts ]] && echo routed_experts || echo all_linear)
  [[ -f "$OUT/ptq-$mods/final/config.json" ]] || \
    "$K3" quantize "$OUT/ft/final" --out "$OUT/ptq-$mods" --modules "$m" --data stdlib
  [[ -f "$OUT/qat-$mods/final/config.json" ]] || \
    "$K3" quantize "$CKPT" --out "$OUT/qat-$mods" --mode qat --modules "$m" --data stdlib
done
python3 "$HERE/summarize.py" "$CKPT" "$OUT"
