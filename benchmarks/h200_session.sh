#!/usr/bin/env bash
# The H200 device calls behind the GPU rows of benchmarks/RESULTS.md (issues 4 and 5): `bash
# benchmarks/h200_session.sh serve` (steps 1-3) and `... kernels` (step 4), each one call, run from the repo root on the
# GPU machine with the wheels of .whl carried (fla-core, einops, fastapi, uvicorn, pydantic, ...; see
# benchmarks/hf_anchor.py). Each step has its own time limit so one slow step cannot take the others' figures;
# every log lands in $OUT.
#   1. GPU tests (background, 2 workers): Triton kernels in fp32/bf16 and the CUDA-graph serving path
#   2. k3 pretrain --preset small, STEPS steps of 16k tokens (bf16 autocast, Triton KDA forward + backward)
#   3. benchmarks/serve.py on the trained checkpoint (bf16): concurrency 1/8/64, prefix hit, MTP speculative,
#      Hugging Face anchors at batch 1 and 32
#   4. (`kernels`) benchmarks/serve_step.py (engine decode: eager, CUDA graphs, compiled + graphs), benchmarks/kda.py
#      --no-fla --decode-sweep, benchmarks/model_breakdown.py --profile-step (k3-small training step by kernel
#      category), the CUDA-graph tests, benchmarks/mla_decode.py
# The 2026-11-29 calls ran earlier versions of these steps (benchmarks/model.py in place of the breakdown; no
# --compile-decode); the next session should first re-run `kernels` and take the figures from there.
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/k3out}
STEPS=${STEPS:-100}  # 150 steps + the 274M-parameter release export did not fit the 225 s step on 2026-11-29
MODE=${1:-serve}
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

if [ "$MODE" = kernels ]; then  # second call: engine step (graphs, compiled), kernels, a profiled training step
  timeout 150 python3 benchmarks/serve_step.py --batch 1 8 32 64 --new-tokens 48 --compile-decode \
    > "$OUT/serve_step.log" 2>&1
  echo "serve_step rc=$?"; grep -v Warn "$OUT/serve_step.log" | tail -12
  timeout 150 python3 benchmarks/kda.py --no-fla --decode-sweep > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; cat "$OUT/kda.log"
  # the solve kernel got 2x slower from 4 to 8 warps (serial substitution with cross-warp reductions): try fewer
  timeout 80 python3 benchmarks/kda_tune.py --warps 1,2,4 --stages 1 --bv 64 --iters 3 > "$OUT/tune.log" 2>&1
  echo "tune rc=$?"; grep -v "^#" "$OUT/tune.log" | tail -14
  timeout 60 python3 benchmarks/model_breakdown.py --model k3-small --device cuda --batch 4 --seq 4096 \
    --profile-step > "$OUT/breakdown.log" 2>&1
  echo "breakdown rc=$?"; tail -22 "$OUT/breakdown.log"
  K3_KERNELS=triton timeout 120 python3 -m pytest tests/serve/test_decode_graphs.py tests/serve/test_decode_compile.py -q \
    -p no:cacheprovider -k cuda \
    > "$OUT/graph_tests.log" 2>&1
  echo "graph tests rc=$?"; tail -5 "$OUT/graph_tests.log"
  timeout 20 python3 benchmarks/mla_decode.py > "$OUT/mla.log" 2>&1
  echo "mla rc=$?"; cat "$OUT/mla.log"
  exit 0
fi

(
  timeout 200 python3 -m pytest tests/kernels/test_kda_triton.py tests/kernels/test_mla_decode.py \
    tests/kernels/test_glu_triton.py -q -p no:cacheprovider -n 2 -k "intra2 or l2norm or mla or dispatch or safe_gate"
  echo "kernel tests rc=$?"
  K3_KERNELS=triton timeout 120 python3 -m pytest tests/serve/test_decode_graphs.py -q -p no:cacheprovider -rs -k cuda
  echo "graph tests rc=$?"
) > "$OUT/gpu_tests.log" 2>&1 &
tests_pid=$!

timeout 225 python3 -m k3.cli.main pretrain --preset small --out /tmp/small --set train.max_steps="$STEPS" \
  --set train.grad_accum=1 --set train.eval_every=0 --set ckpt.every=0 --set train.log_every=20 \
  --set data.tokenizer_sample_bytes=5000000 > "$OUT/pretrain.log" 2>&1
echo "pretrain rc=$?"; tail -4 "$OUT/pretrain.log"
cp /tmp/small/metrics.jsonl "$OUT/metrics.jsonl" 2>/dev/null
wait "$tests_pid"; tail -4 "$OUT/gpu_tests.log"

if [ -f /tmp/small/final/config.json ]; then SRC="--ckpt /tmp/small/final --speculative-tokens 2"; else SRC="--model k3-small"; fi
timeout 270 python3 benchmarks/serve.py $SRC --subprocess --device cuda --dtype bfloat16 --concurrency 1 8 64 --input-len 128 \
  --output-len 128 --prefix-len 2048 --hf-anchor --hf-batch 1 32 > "$OUT/serve.log" 2>&1
echo "serve rc=$?"; cat "$OUT/serve.log" | grep -v Warning | tail -40

