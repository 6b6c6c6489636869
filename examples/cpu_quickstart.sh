#!/usr/bin/env bash
# CPU end to end: pretrain the default tiny model on the Python standard library (~10 min on 2 cores),
# resume-safe (Ctrl-C writes a checkpoint; rerun with --resume), then sample from it.
set -euo pipefail
RUN=${1:-runs/tiny}
if [[ -d "$RUN/checkpoints" && ! -d "$RUN/final" ]]; then
  k3 pretrain --resume --out "$RUN"
elif [[ ! -d "$RUN/final" ]]; then
  k3 pretrain --out "$RUN"
fi
k3 generate "$RUN/final" --prompt "def " --max-tokens 120 --seed 0
k3 generate "$RUN/final" --prompt "class Config:" --max-tokens 120 --temperature 0
