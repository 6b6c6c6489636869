#!/usr/bin/env bash
# Routed on-policy distillation on a CPU: from the README's default checkpoint (k3 pretrain --out runs/tiny), fine-tune
# two teachers on two disjoint domains (prompt/completion windows of two groups of standard-library packages: formats
# and networking, GUI code) with `k3 pretrain --preset sft`, then
#   - distill both into one student from the base with routed prompts (k3 distill, reverse KL on its own samples);
#   - SFT the base on the teachers' own samples of the same prompts (the off-policy baseline), for 3x the steps at
#     about the student tokens of a distillation step per step (4 x 256 against 8 prompts + completions);
# and report each domain's validation loss of the base, the teachers and both students, and the reverse KL.
#
#   bash examples/distill/run.sh                          # writes runs/distill-example/
#   BASE=runs/tiny/final OUT=/tmp/d STEPS=30 bash examples/distill/run.sh
#
# Finished stages are kept; an interrupted k3 command resumes when the script runs again. K3 names the k3 executable
# (default `k3`), PYTHON the Python k3 is installed in.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
BASE="${BASE:-runs/tiny/final}"
OUT="${OUT:-runs/distill-example}"
TEACHER_STEPS="${TEACHER_STEPS:-60}"   # SFT steps per teacher, 8 x 256 tokens each
STEPS="${STEPS:-40}"                   # distillation steps, 8 prompts x NEW tokens each
NEW="${NEW:-48}"                       # completion tokens per prompt (distill.max_new_tokens and the samples)
SAMPLES="${SAMPLES:-160}"              # teacher samples per domain for the SFT baseline
THREADS="${THREADS:-2}"
K3="${K3:-k3}"
PYTHON="${PYTHON:-python3}"
if [ ! -f "$BASE/config.json" ]; then
  echo "no base checkpoint at $BASE: train it first with \`k3 pretrain --out runs/tiny\` (about 9 minutes on 2" \
       "cores), or set BASE" >&2
  exit 2
fi
mkdir -p "$OUT"
[ -f "$OUT/prompts.jsonl" ] || "$PYTHON" "$HERE/distill_example.py" data "$OUT" "$BASE"

resume_flag() { if [ -d "$1/checkpoints" ]; then echo --resume; fi; }
COMMON=(--set train.threads="$THREADS" --set train.batch_size=8 --set ckpt.keep_last=100)

for d in a b; do
  [ -f "$OUT/teacher_$d/final/config.json" ] && continue
  $K3 pretrain --init "$BASE" --preset sft --set data.source="$OUT/${d}_train.jsonl" \
    --set train.max_steps="$TEACHER_STEPS" --set train.eval_every=0 --set ckpt.every=0 "${COMMON[@]}" \
    --out "$OUT/teacher_$d" $(resume_flag "$OUT/teacher_$d")
done

EVERY=$(( STEPS / 4 > 0 ? STEPS / 4 : 1 ))
[ -f "$OUT/distill/final/config.json" ] || $K3 distill --student "$BASE" --teacher a="$OUT/teacher_a/final" \
  --teacher b="$OUT/teacher_b/final" --prompts "$OUT/prompts.jsonl" --out "$OUT/distill" \
  --set train.max_steps="$STEPS" --set distill.max_new_tokens="$NEW" --set ckpt.every="$EVERY" "${COMMON[@]}" \
  $(resume_flag "$OUT/distill")

[ -f "$OUT/teacher_samples.jsonl" ] || "$PYTHON" "$HERE/distill_example.py" samples "$OUT" "$NEW" "$SAMPLES"
SFT_STEPS=$(( 3 * STEPS ))
[ -f "$OUT/sft/final/config.json" ] || $K3 pretrain --init "$BASE" --preset sft \
  --set data.source="$OUT/teacher_samples.jsonl" --set train.max_steps="$SFT_STEPS" --set train.eval_every=0 \
  --set ckpt.every="$(( 3 * EVERY ))" "${COMMON[@]}" --set train.batch_size=4 --out "$OUT/sft" \
  $(resume_flag "$OUT/sft")

"$PYTHON" "$HERE/distill_example.py" evaluate "$OUT" "$BASE"
