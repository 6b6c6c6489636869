#!/usr/bin/env bash
# RoPE -> NoPE context extension on a CPU (23 min on 2 shared cores, 2026-12-02; results in README.md beside
# this): from the README's default checkpoint (k3 pretrain --out runs/tiny, trained at 256 tokens), extend to
# 1,024 tokens three ways at equal steps and data (NoPE, the K3 recipe; RoPE kept; RoPE with a 4x base), then
# passkey accuracy at 256..4,096 tokens and loss by position for the parent and the three children.
#
#   bash examples/extend_context/run.sh                    # writes runs/extend-context/{nope,rope,rope4x,eval}
#   PARENT=runs/tiny/final OUT=/tmp/ext STEPS=40 TRIALS=4 bash examples/extend_context/run.sh
#   bash examples/extend_context/run.sh --update-example   # also copies tables and plots beside this script
#
# Interrupt it at any time: Ctrl-C checkpoints the running extension and running the script again resumes it;
# finished children and evaluations are kept. K3 names the k3 executable (default `k3`; e.g. K3="python -m k3.cli").
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PARENT="${PARENT:-runs/tiny/final}"
OUT="${OUT:-runs/extend-context}"
STEPS="${STEPS:-40}"            # optimizer steps per child, 4 x 1,024 tokens each
FRACTION="${FRACTION:-0.5}"     # data.passkey_fraction (the presets' 0.1 is too few documents for 40 steps)
TRIALS="${TRIALS:-2}"           # passkey prompts per length and depth (5 depths x 5 lengths)
THREADS="${THREADS:-2}"
K3="${K3:-k3}"
PYTHON="${PYTHON:-python3}"  # a Python with matplotlib (the one k3 is installed in)
UPDATE=0
case "$#:${1:-}" in
  0:) ;;
  1:--update-example) UPDATE=1 ;;
  *) echo "usage: bash $0 [--update-example]  (PARENT, OUT, STEPS, FRACTION, TRIALS, THREADS, K3, PYTHON are" \
          "environment variables)" >&2; exit 2 ;;
esac
if [ ! -f "$PARENT/config.json" ]; then
  echo "no parent checkpoint at $PARENT: train it first with \`k3 pretrain --out runs/tiny\` (about 9 minutes on 2" \
       "cores), or set PARENT" >&2
  exit 2
fi
THETA="$("$PYTHON" -c "import json, sys; print(4 * json.load(open(sys.argv[1]))['rope_theta'])" "$PARENT/config.json")"
echo "parent: $PARENT; children and evaluations: $OUT; $STEPS steps each, passkey fraction $FRACTION"

for name in nope rope rope4x; do
  case "$name" in
    nope) position=(--position nope) ;;
    rope) position=(--position rope) ;;
    rope4x) position=(--position rope --rope-theta "$THETA") ;;
  esac
  [ -f "$OUT/$name/final/config.json" ] && continue
  resume=()
  [ -d "$OUT/$name/checkpoints" ] && resume=(--resume)
  $K3 extend-context "$PARENT" --seq-len 1024 "${position[@]}" --out "$OUT/$name" --preset tiny \
    --set train.max_steps="$STEPS" --set data.passkey_fraction="$FRACTION" --set train.threads="$THREADS" \
    "${resume[@]}"
done

for name in parent nope rope rope4x; do
  ckpt="$OUT/$name/final"
  [ "$name" = parent ] && ckpt="$PARENT"
  [ -f "$OUT/eval/$name/passkey.json" ] || $K3 eval passkey "$ckpt" --lengths 256,512,1024,2048,4096 \
    --depths 0,0.25,0.5,0.75,1 --trials "$TRIALS" --seed 0 --device cpu --out "$OUT/eval/$name"
  [ -f "$OUT/eval/$name/loss.json" ] || $K3 eval loss "$ckpt" --seq-len 4096 --batches 2 --device cpu \
    --out "$OUT/eval/$name"
done
"$PYTHON" "$HERE/summarize.py" "$OUT/eval" parent nope rope rope4x | tee "$OUT/eval/summary.md"

if [ "$UPDATE" = 1 ]; then
  mkdir -p "$HERE/results"
  cp "$OUT/eval/summary.md" "$OUT/eval/loss_by_position.png" "$HERE/results/"
  for name in parent nope rope rope4x; do
    cp "$OUT/eval/$name/passkey.png" "$HERE/results/passkey-$name.png"
    cp "$OUT/eval/$name/passkey.json" "$HERE/results/passkey-$name.json"
    cp "$OUT/eval/$name/loss.json" "$HERE/results/loss-$name.json"
  done
fi
