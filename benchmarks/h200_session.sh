#!/usr/bin/env bash
# The H200 device calls behind the GPU rows of benchmarks/RESULTS.md (issues 4 and 5), one mode per call, run from the
# repo root on the GPU machine with the wheels of .whl carried (fla-core, einops, fastapi, uvicorn, pydantic, ...;
# see benchmarks/hf_anchor.py):  bash benchmarks/h200_session.sh kernels | serve1 | serve2
# Each step has its own time limit (the modes fit one 600 s call each) and prints as it goes; logs land in $OUT.
#   kernels: GPU kernel tests (KDA chunk/recurrent, K-block backward inter kernel, paged MLA decode) alongside the
#            CUDA serving tests (decode / verify / MTP graphs, compiled decode), then benchmarks/kda.py: k3 against fla
#            in the same process, the library defaults
#   serve1:  CUDA serving tests (decode / verify / MTP graphs, compiled decode, --cuda-graph-batches) in the
#            background while k3 pretrain --preset small trains STEPS steps; then benchmarks/serve.py on that trained
#            checkpoint: concurrency 1, the 2k-token prefix hit, the MTP speculative row (k = 2); then the paged MLA
#            decode kernel, single pass vs split keys (flash-decoding)
#   serve2:  the compiled server (--compile-decode --cuda-graph-batches 1 32) against the Hugging Face anchors at
#            batch 1 and 32 through HTTP (random weights), then the compiled engine step at batch 32
# Session 3 (2026-11-29) ran earlier versions of these steps by hand (RESULTS.md, "Session 3").
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/k3out}
STEPS=${STEPS:-100}  # k3-small steps of 16k tokens that fit the 225 s step with the release export
MODE=${1:-kernels}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

case "$MODE" in
kernels)
  K3_KERNELS=triton timeout -s INT -k 10 200 python3 -m pytest tests/serve/test_decode_graphs.py tests/serve/test_spec_graphs.py \
    tests/serve/test_decode_compile.py -q -p no:cacheprovider -rfs -k cuda -n 3 > "$OUT/serve_tests.log" 2>&1 &
  serve_tests=$!
  timeout -s INT -k 10 200 python3 -m pytest tests/kernels/test_kda_triton.py tests/kernels/test_kda_bwd_kblocks.py \
    tests/kernels/test_mla_decode.py -q -p no:cacheprovider -rf -n 10 > "$OUT/ktests.log" 2>&1
  echo "kernel tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/ktests.log" | tail -12
  wait "$serve_tests"; echo "serve tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/serve_tests.log" | tail -8
  # fla's autotuner compiles its configurations on the first shape: minutes on a fresh machine
  timeout 300 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; cat "$OUT/kda.log"
  ;;
serve1)
  K3_KERNELS=triton timeout 220 python3 -m pytest tests/serve/test_decode_graphs.py tests/serve/test_spec_graphs.py \
    tests/serve/test_decode_compile.py -q -p no:cacheprovider -rs -k cuda > "$OUT/serve_tests.log" 2>&1 &
  tests_pid=$!
  timeout 225 python3 -m k3.cli.main pretrain --preset small --out /tmp/small --set train.max_steps="$STEPS" \
    --set train.grad_accum=1 --set train.eval_every=0 --set ckpt.every=0 --set train.log_every=20 \
    --set data.tokenizer_sample_bytes=5000000 > "$OUT/pretrain.log" 2>&1
  echo "pretrain rc=$?"; tail -4 "$OUT/pretrain.log"
  cp /tmp/small/metrics.jsonl "$OUT/metrics.jsonl" 2>/dev/null
  wait "$tests_pid"; echo "serve tests rc=$?"; tail -4 "$OUT/serve_tests.log"
  if [ -f /tmp/small/final/config.json ]; then
    timeout 230 python3 benchmarks/serve.py --ckpt /tmp/small/final --subprocess --device cuda --dtype bfloat16 \
      --concurrency 1 --input-len 128 --output-len 128 --prefix-len 2048 --speculative-tokens 2 \
      > "$OUT/serve1.log" 2>&1
    echo "serve rc=$?"; grep -v "Warn\|warn" "$OUT/serve1.log" | tail -12
  fi
  timeout 45 python3 benchmarks/mla_decode.py --split-keys 256 512 > "$OUT/mla.log" 2>&1
  echo "mla rc=$?"; cat "$OUT/mla.log"
  ;;
serve2)
  timeout 360 python3 benchmarks/serve.py --model k3-small --subprocess --device cuda --dtype bfloat16 \
    --compile-decode --cuda-graph-batches 1 32 --concurrency 1 32 --input-len 128 --output-len 128 --prefix-len 0 \
    --hf-anchor --hf-batch 1 32 > "$OUT/serve2.log" 2>&1
  echo "serve rc=$?"; grep -v "Warn\|warn" "$OUT/serve2.log" | tail -30
  timeout 180 python3 benchmarks/serve_step.py --batch 32 --new-tokens 32 --modes compiled > "$OUT/step.log" 2>&1
  echo "step rc=$?"; grep "^|\|^#" "$OUT/step.log"
  ;;
*)
  echo "usage: bash benchmarks/h200_session.sh kernels|serve1|serve2" >&2; exit 2
  ;;
esac
