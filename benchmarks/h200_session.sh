#!/usr/bin/env bash
# The H200 device calls behind the GPU rows of benchmarks/RESULTS.md (issues 4 and 5), one mode per call, run from the
# repo root on the GPU machine with the wheels of .whl carried (fla-core, einops, fastapi, uvicorn, pydantic, ...;
# see benchmarks/hf_anchor.py):
#   bash benchmarks/h200_session.sh MODE, MODE one of kernels | serve | spec | batch | anchor | table | table2 | prec
#   | ncu | tune | final | breakdown | stalls | wublock | table9 | fused | vfirst | s11b | s11c | s12 | s12b | s13 | s13b
#   | s13c | s13d | s13e | s14 | s14b | s14d | s14e | s14f | s15 | s15d | s15e | s15g | s15h | s16 | s16d | s17 | s17c | s17d | s17e | s17f | s18 | s18b | s18c | s18d | s18e | s18f | s18g | s19 | s19c | s19d | s19e | s19f | s20 | s20c | s20d | s20e | s20f | s20g | s21a | s21b | s21c | s21d | s22 | s22b | s22c | s22d | s22e | s22f | s23 | s23b | s23c | s23d | s23e | cmd (any command after the preamble)
#   (each mode's own comment below says what it runs)
# Each step has its own time limit (the modes fit one 600 s call each) and prints as it goes; logs land in $OUT.
#   kernels: GPU kernel tests (KDA chunk/recurrent, K-block backward inter kernel, paged MLA decode, C2-GLU, router,
#            the Triton serving path end to end) alongside every CUDA serving test (`tests/serve -k cuda`: graphs,
#            compiled routing, tail chunks, one-sync speculative steps, quantized serving; needs the openai wheel in
#            .whl), then benchmarks/kda_tune.py: each k3 chunk kernel at 4 / 8 warps and 1 / 2 stages
#   serve:   the compiled server (--compile-decode --cuda-graph-batches 1 32, k3-small, random weights) against the
#            Hugging Face anchors at batch 1 and 32 through HTTP, the CUDA compiled-decode test alongside; then
#            benchmarks/serve.py on the README's trained k3-tiny (carry runs/tiny): concurrency 1, the 2k-token
#            prefix hit, the MTP speculative row (k = 2); the paged MLA decode kernel (single pass vs split keys)
#            during the server's start
#   spec:    benchmarks/serve_step.py --speculative-tokens 2 --profile on the trained k3-tiny (a speculative step's
#            phases, kernels and host ops), then the speculative speedup through HTTP on it (server logs kept)
#   batch:   the compiled k3-small server at concurrency 1 and 32 (no prefix row, no anchors: the batch-32 goal),
#            then the speculative step phases on the trained k3-tiny, then one profiled k3-small training step
#            (the stacked Muon update)
#   anchor:  the compiled k3-small server at concurrency 1 and 32 and at the anchors' workload (128-token prompts,
#            256 new tokens), then the Hugging Face anchors in the same run: the batch-1 and batch-32 goals of issue 5
#   table:   the KDA GPU tests, then benchmarks/kda.py's first three shapes (k3 against fla in one process, issue
#            4's table); table2, on the same warm machine (or with table's Triton cache carried back): the fourth
#            shape and decode
#   prec:    the backward's dot precisions: GPU gradient tests, then each kernel's time per precision (kda_tune.py)
# Session 3 (2026-11-29) ran earlier versions of these steps by hand (RESULTS.md, "Session 3").
set -o pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/k3out}
MODE=${1:-kernels}
mkdir -p "$OUT"
# Triton's cache (compiled kernels and, with fla's FLA_CACHE_RESULTS default, its autotuning results) in the repo:
# carry .triton-cache (from a previous call's $OUT/triton-cache.tgz) to skip fla's ~4-minute first-shape autotuning
export TRITON_CACHE_DIR="$PWD/.triton-cache"
mkdir -p "$TRITON_CACHE_DIR"
# fla's autotuning results from an earlier call ($OUT/fla-autotune.tgz, carried back in .triton-cache-parts/): with
# them fla skips its ~5-minute first autotuning on a fresh machine (FLA_CACHE_RESULTS, fla's default)
# benchmarks/fla_autotune_h200.tgz: fla-core 0.6.0's results for benchmarks/kda.py's four shapes on the H200 (triton
# 3.6.0, torch 2.11; session 12). Their keys hash fla's kernel source and Triton's version: another version ignores them
for f in benchmarks/fla_autotune_h200.tgz .triton-cache-parts/*.tgz; do
  [ -f "$f" ] && tar xzf "$f" -C "$TRITON_CACHE_DIR"
done
# the KDA GPU tests (gradients at every dot precision, K blocks, saved intermediates, the gate), 8 processes
kda_gpu_tests() {
  timeout -s INT -k 10 "${KDA_TEST_LIMIT:-240}" python3 -m pytest tests/kernels/test_kda_triton.py \
    tests/kernels/test_kda_bwd_kblocks.py tests/kernels/test_kda_saved.py tests/kernels/test_kda_gate_triton.py \
    tests/kernels/test_kda_fused_output.py tests/kernels/test_kda_recurrent_compile.py \
    tests/kernels/test_kda_segments.py -p no:cacheprovider -rf \
    -n 8 > "$OUT/ktests.log" 2>&1
  echo "kda tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/ktests.log" | tail -12
}
# the KDA GPU tests beside every CUDA serving test (-n 3; needs the serving wheels in .whl: fastapi,
# opentelemetry-api, openai, httpx2, ...), the serving log's summary after both
kda_and_serve_tests() {
  K3_KERNELS=triton timeout -s INT -k 10 240 python3 -m pytest tests/serve tests/model/test_quant_checkpoint.py \
    -p no:cacheprovider -rfs -k cuda -n 3 > "$OUT/serve_tests.log" 2>&1 &
  local serve_tests=$!
  kda_gpu_tests
  wait "$serve_tests"; echo "serve tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/serve_tests.log" | tail -8
}
# at the two long shapes (or $SHAPES), kda_tune.py --defaults once per argument (each a set of extra flags; "" for as
# shipped): the intra, w/u, scan, output and backward kernels and the total, us per fwd+bwd
long_shapes_tune() {
  for shape in ${SHAPES:-2,16384,16,128 1,65536,16,128}; do
    for flags in "$@"; do
      timeout 90 python3 benchmarks/kda_tune.py --defaults --iters 3 --shape $shape $flags \
        > "$OUT/kda_tune_long.log" 2>&1
      echo "kda_tune $shape $flags rc=$?"; grep -E "^\| _intra_sub|^\| _solve|^\| _wu|^\| _scan|^\| _output|^\| _bwd_|^\| torch|^\| total" \
        "$OUT/kda_tune_long.log"
    done
  done
}
# session 21's A/B runs: $1 a label, the rest kda_tune.py flags; the chunk kernels' times and the total on one line
tune21() {
  local label=$1; shift
  timeout 60 python3 benchmarks/kda_tune.py --defaults --iters 5 "$@" > "$OUT/t.log" 2>&1
  echo "$label $* rc=$?"; grep -E "^\| _intra|^\| _solve|^\| _wu|^\| _scan|^\| _bwd_scan|^\| total" "$OUT/t.log" \
    | tr '\n' ' '; echo
}
# issue 4's whole table (four shapes and decode, k3 and fla in one process), then the model's call (raw z, the gate
# in kernel, both libraries) at the first shape
kda_table() {
  timeout 280 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep -v "^$" "$OUT/kda.log"
  timeout 80 python3 benchmarks/kda.py --only 8,4096,16,128 --no-decode --gate-in-kernel > "$OUT/kda_gate.log" 2>&1
  echo "kda gate rc=$?"; grep "^|\|^# [0-9]" "$OUT/kda_gate.log"
}
# which pipelined scan launches fall back to 1 stage (launch_fitting) at fp32 K = 128 and bf16 K = 256, with their fwd
# and fwd+bwd times (each configuration compiles first: 300 s)
fallback_probe() {
  timeout 300 python3 -c "import torch, triton.testing as tt; from k3.kernels.kda import chunk_kda, triton_common as C
for dt, B, T, H, D in ((torch.float32, 8, 4096, 16, 128), (torch.bfloat16, 4, 4096, 8, 256)):
    C._UNFIT.clear()
    xs = [torch.randn(B, T, H, D, device='cuda', dtype=dt) for _ in range(3)]
    xs.append(-5 * torch.rand(B, T, H, D, device='cuda'))
    xs.append(torch.rand(B, T, H, device='cuda', dtype=dt))
    kw = dict(use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0)
    leaves = [x.clone().requires_grad_() for x in xs]
    def fb():
        chunk_kda(*leaves, **kw)[0].float().sum().backward()
    fb(); torch.cuda.synchronize()
    with torch.no_grad():
        t_f = tt.do_bench(lambda: chunk_kda(*xs, **kw), return_mode='median')
    t_fb = tt.do_bench(fb, grad_to_none=leaves, return_mode='median')
    print(dt, (B, T, H, D), f'fwd {t_f:.3f} ms, fwd+bwd {t_fb:.3f} ms; at 1 stage:', sorted(k[0] for k in C._UNFIT),
          flush=True)" 2>&1 | tail -6
}
save_autotune() { (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/fla-autotune.tgz" -T -); }
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-deps --no-build-isolation --no-index -e . >/dev/null 2>&1
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"

case "$MODE" in
cmd)
  # any command after the preamble (k3 installed, the fla wheel on PYTHONPATH, Triton's cache unpacked):
  # `bash benchmarks/h200_session.sh cmd python3 my_check.py`. Session 14 lost a call running a scratch script
  # without that install
  shift
  "$@"
  ;;
kernels)
  K3_KERNELS=triton timeout -s INT -k 10 240 python3 -m pytest tests/serve tests/model/test_quant_checkpoint.py \
    -p no:cacheprovider -rfs -k cuda -n 3 > "$OUT/serve_tests.log" 2>&1 &
  serve_tests=$!
  timeout -s INT -k 10 240 python3 -m pytest tests/kernels/test_kda_triton.py tests/kernels/test_kda_bwd_kblocks.py \
    tests/kernels/test_mla_decode.py tests/kernels/test_glu_triton.py tests/kernels/test_router_triton.py \
    tests/kernels/test_triton_end_to_end.py tests/kernels/test_kda_saved.py tests/kernels/test_kda_gate_triton.py \
    -q -p no:cacheprovider -rf -n 10 \
    > "$OUT/ktests.log" 2>&1
  echo "kernel tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/ktests.log" | tail -12
  wait "$serve_tests"; echo "serve tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/serve_tests.log" | tail -8
  # k3's chunk kernels one by one at 4 and 8 warps, 1 and 2 stages (the state scans pipeline their loads from 2
  # stages on since session 6), BV 64; fla is timed by the table modes (its first autotuning takes ~5 minutes)
  timeout 300 python3 benchmarks/kda_tune.py --warps 4,8 --stages 1,2 --bv 64 --iters 3 > "$OUT/kda_tune.log" 2>&1
  echo "kda_tune rc=$?"; cat "$OUT/kda_tune.log"
  ;;
serve)
  # in the background while the server below starts and compiles (CPU work): the paged MLA decode kernel, single
  # pass vs split keys (flash-decoding), then the CUDA compiled-decode and tail-graph tests
  (timeout 45 python3 benchmarks/mla_decode.py --split-keys 256 512 > "$OUT/mla.log" 2>&1; echo "mla rc=$?" >> "$OUT/mla.log"
   K3_KERNELS=triton timeout -s INT -k 10 200 python3 -m pytest tests/serve/test_decode_compile.py \
    tests/serve/test_tail_graphs.py -k cuda -q \
    -p no:cacheprovider -rf > "$OUT/serve_tests.log" 2>&1) &
  serve_tests=$!
  timeout 355 python3 benchmarks/serve.py --model k3-small --subprocess --device cuda --dtype bfloat16 \
    --compile-decode --cuda-graph-batches 1 32 --concurrency 1 32 --input-len 128 --output-len 128 --prefix-len 2048 \
    --hf-anchor --hf-batch 1 32 > "$OUT/serve_small.log" 2>&1
  echo "serve k3-small rc=$?"; grep -v "Warn\|warn" "$OUT/serve_small.log" | tail -30
  wait "$serve_tests"; cat "$OUT/mla.log"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/serve_tests.log" | tail -4
  if [ -f runs/tiny/final/config.json ]; then  # the README's k3-tiny, trained on the CPU (carried)
    timeout 170 python3 benchmarks/serve.py --ckpt runs/tiny/final --subprocess --device cuda --concurrency 1 \
      --input-len 128 --output-len 128 --prefix-len 2048 --speculative-tokens 2 > "$OUT/serve_tiny.log" 2>&1
    echo "serve k3-tiny rc=$?"; grep -v "Warn\|warn" "$OUT/serve_tiny.log" | tail -14
  fi
  ;;
spec)
  # the CUDA speculative tests and the MLA kernel warm-up test; where a speculative step's time goes on the GPU
  # (phases, then a profile: kernels and host ops per step), plain vs k = 2, on the README's trained k3-tiny (carry
  # runs/tiny); then the speculative speedup through HTTP (both servers their own processes; their logs, with graph
  # captures at INFO, land in $OUT)
  K3_KERNELS=triton timeout -s INT -k 10 100 python3 -m pytest tests/serve/test_spec_fast.py tests/serve/test_spec_graphs.py \
    tests/kernels/test_mla_decode.py -k "cuda or warm_up" -q -p no:cacheprovider -rf > "$OUT/spec_tests.log" 2>&1
  echo "spec tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/spec_tests.log" | tail -6
  timeout 150 python3 benchmarks/serve_step.py --ckpt runs/tiny/final --batch 1 --new-tokens 96 \
    --speculative-tokens 2 --profile > "$OUT/spec_step.log" 2>&1
  echo "spec step rc=$?"; grep "^|\|^#" "$OUT/spec_step.log"
  rm -f /tmp/*.k3serve.log
  timeout 200 python3 benchmarks/serve.py --ckpt runs/tiny/final --subprocess --device cuda --concurrency 1 \
    --input-len 128 --output-len 128 --prefix-len 0 --speculative-tokens 2 > "$OUT/serve_tiny.log" 2>&1
  echo "serve k3-tiny rc=$?"; grep -v "Warn\|warn" "$OUT/serve_tiny.log" | tail -8
  i=0; for f in /tmp/*.k3serve.log; do [ -f "$f" ] && cp "$f" "$OUT/server$i.log"; i=$((i + 1)); done
  ;;
batch)
  timeout 300 python3 benchmarks/serve.py --model k3-small --subprocess --device cuda --dtype bfloat16 \
    --compile-decode --cuda-graph-batches 1 32 --concurrency 1 32 --input-len 128 --output-len 128 --prefix-len 0 \
    > "$OUT/serve_small.log" 2>&1
  echo "serve k3-small rc=$?"; grep -v "Warn\|warn" "$OUT/serve_small.log" | tail -12
  timeout 130 python3 benchmarks/serve_step.py --ckpt runs/tiny/final --batch 1 8 --new-tokens 96 \
    --speculative-tokens 2 > "$OUT/spec_step.log" 2>&1
  echo "spec step rc=$?"; grep "^|\|^#" "$OUT/spec_step.log"
  timeout 120 python3 benchmarks/model_breakdown.py --model k3-small --device cuda --batch 4 --seq 4096 \
    --profile-step > "$OUT/breakdown.log" 2>&1
  echo "breakdown rc=$?"; tail -40 "$OUT/breakdown.log"
  ;;
anchor)
  timeout 560 python3 benchmarks/serve.py --model k3-small --subprocess --device cuda --dtype bfloat16 \
    --compile-decode --cuda-graph-batches 1 32 --concurrency 1 32 --input-len 128 --output-len 128 --prefix-len 0 \
    --hf-anchor --hf-batch 1 32 > "$OUT/serve_anchor.log" 2>&1
  echo "serve anchor rc=$?"; grep -v "Warn\|warn" "$OUT/serve_anchor.log" | tail -30
  ;;
table)
  # the KDA GPU tests (gradients at every dot precision, K blocks, saved intermediates), then the first three shapes
  # of benchmarks/kda.py (k3 and fla side by side in one process; fla's first autotuning takes ~5 minutes on a
  # fresh machine, ~0 with .triton-cache-parts/ carried);
  # then `table2` on the same warm machine. fla's autotuning results come back as $OUT/fla-autotune.tgz: copy it
  # into .triton-cache-parts/ and carry that folder to skip fla's autotuning on a fresh machine
  kda_gpu_tests
  timeout 420 python3 benchmarks/kda.py --only 8,4096,16,128 2,16384,16,128 1,65536,16,128 --no-decode \
    > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; cat "$OUT/kda.log"
  save_autotune
  ;;
table2)
  # the fourth shape, then decode (k3 and fla), then the longest shape's kernels by V block, then the first shape
  # with the gate in kernel
  timeout 330 python3 benchmarks/kda.py --only 16,2048,32,64 > "$OUT/kda2.log" 2>&1
  echo "kda rc=$?"; cat "$OUT/kda2.log"
  # the longest shape's kernels by V block (the state scans run N * HV * V / BV programs: 32 at BV 64 here)
  timeout 150 python3 benchmarks/kda_tune.py --shape 1,65536,16,128 --warps 4,8 --stages 1 --bv 16,32,64 \
    --iters 3 > "$OUT/kda_tune_long.log" 2>&1
  echo "kda_tune rc=$?"; grep -v "^# per\|^# w" "$OUT/kda_tune_long.log"
  # the model's call: raw z with the gate in kernel (k3's Triton gate against fla's), first shape
  timeout 120 python3 benchmarks/kda.py --only 8,4096,16,128 --no-decode --gate-in-kernel > "$OUT/kda_gate.log" 2>&1
  echo "kda gate rc=$?"; grep "^|\|^#" "$OUT/kda_gate.log"
  save_autotune
  ;;
prec)
  # the backward's kernels: their GPU tests (gradients against the recurrence at every dot precision, K blocks,
  # saved intermediates), then each kernel's time at 2 / 4 / 8 warps, 1 / 2 stages, the intra kernel's off-diagonal
  # dots in tf32 and bf16x3, then the intra kernel at K block 16
  timeout -s INT -k 10 200 python3 -m pytest tests/kernels/test_kda_triton.py tests/kernels/test_kda_bwd_kblocks.py \
    tests/kernels/test_kda_saved.py -p no:cacheprovider -rf -n 8 > "$OUT/ptests.log" 2>&1
  echo "precision tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/ptests.log" | tail -12
  timeout 150 python3 benchmarks/kda_tune.py --warps 2,4,8 --stages 1,2 --bv 64 --iters 3 --bwd-prec bf16 \
    --bwd-intra-prec tf32,bf16x3 > "$OUT/kda_tune_prec.log" 2>&1
  echo "kda_tune rc=$?"; cat "$OUT/kda_tune_prec.log"
  timeout 60 python3 benchmarks/kda_tune.py --warps 4 --stages 2 --bv 64 --iters 3 --bwd-intra-bk 16 \
    > "$OUT/kda_tune_bk.log" 2>&1
  echo "kda_tune rc=$?"; cat "$OUT/kda_tune_bk.log"
  ;;
ncu)
  # where the time goes, kernel by kernel: k3's and fla's fwd+bwd under Nsight Compute (duration, DRAM and SM
  # throughput, registers, occupancy), fla's kernels by the torch profiler, the longest shape's kernels at V blocks 32
  # and 64 (one process each: a crash poisons the process), then the decode kernel's V block / warps sweep
  timeout 300 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section LaunchStats \
    --section Occupancy --csv python3 benchmarks/kda_ncu.py > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
  echo "ncu rc=$? ($(grep -c . "$OUT/ncu.csv") lines)"; tail -3 "$OUT/ncu.err"
  timeout 100 python3 benchmarks/kda_tune.py --warps 4 --stages 1 --bv 64 --iters 3 --fla > "$OUT/kda_tune_fla.log" 2>&1
  echo "kda_tune fla rc=$?"; grep -v "^# per\|^# w" "$OUT/kda_tune_fla.log"
  for bv in 32 64; do
    timeout 70 python3 benchmarks/kda_tune.py --shape 1,65536,16,128 --warps 4,8 --stages 1 --bv $bv --iters 3 \
      > "$OUT/kda_tune_long$bv.log" 2>&1
    echo "kda_tune long bv$bv rc=$?"; grep -v "^# per\|^# w" "$OUT/kda_tune_long$bv.log"
  done
  timeout 90 python3 benchmarks/kda.py --only 1,256,2,64 --decode-sweep > "$OUT/decode.log" 2>&1
  echo "decode rc=$?"; grep -v "^#" "$OUT/decode.log" | tail -40
  ;;
tune)
  # the KDA GPU tests, then every k3 chunk kernel at 1 / 2 / 4 warps (the solve's and the intra kernels' reductions
  # stay inside one warp at 1), then the two long shapes against fla (the state scans split into 32-wide V blocks
  # there)
  kda_gpu_tests
  timeout 200 python3 benchmarks/kda_tune.py --warps 1,2,4 --stages 1 --bv 64 --iters 3 > "$OUT/kda_tune_w.log" 2>&1
  echo "kda_tune rc=$?"; grep -v "^# per\|^# w\|^# torch" "$OUT/kda_tune_w.log"
  timeout 150 python3 benchmarks/kda.py --only 2,16384,16,128 1,65536,16,128 --no-decode > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]" "$OUT/kda.log"
  ;;
final)
  # the KDA GPU tests at the launch defaults, then issue 4's whole table (four shapes and decode, k3 and fla in one
  # process), the model's call (gate in kernel), each k3 kernel at 4 and 8 warps, then the decode kernel's V block /
  # warps sweep (k3 alone)
  kda_gpu_tests
  kda_table
  timeout 100 python3 benchmarks/kda_tune.py --warps 4,8 --stages 1 --bv 64 --iters 3 > "$OUT/kda_tune.log" 2>&1
  echo "kda_tune rc=$?"; grep -v "^# per\|^# w\|^# torch" "$OUT/kda_tune.log"
  timeout 60 python3 benchmarks/kda.py --decode-only --no-fla --decode-sweep > "$OUT/decode.log" 2>&1
  echo "decode sweep rc=$?"; sed -n '/decode sweep/,$p' "$OUT/decode.log"
  ;;
breakdown)
  # the KDA GPU tests, then where the time goes at the launch defaults (kda_tune.py --defaults: one
  # profile, every kernel at its own LAUNCH entry), the intra kernel at 1 and 2 stages (2 warps; the other kernels'
  # rows of that sweep are not their defaults), then issue 4's whole table (four shapes and decode, k3 and fla in one
  # process)
  kda_gpu_tests
  timeout 60 python3 benchmarks/kda_tune.py --defaults --iters 3 > "$OUT/kda_tune_defaults.log" 2>&1
  echo "kda_tune defaults rc=$?"; grep -v "^# per\|^# w\|^# best\|^#   " "$OUT/kda_tune_defaults.log"
  timeout 80 python3 benchmarks/kda_tune.py --warps 2 --stages 1,2 --bv 64 --iters 3 > "$OUT/kda_tune_stages.log" 2>&1
  echo "kda_tune stages rc=$?"; grep -E "^\| _intra|^\| kernel" "$OUT/kda_tune_stages.log"
  timeout 280 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep -v "^$" "$OUT/kda.log"
  ;;
stalls)
  # where the warps of each kernel wait (Nsight Compute's WarpStateStats, with SpeedOfLight, Occupancy and
  # LaunchStats), k3's fwd+bwd then fla's at (8, 4096, 16, 128); then the V-block choice at that shape (each k3
  # kernel at BV 32 and 64, 4 warps: only the rows of kernels whose default is 4 warps are their launch)
  timeout 330 ncu --clock-control none --profile-from-start off --section SpeedOfLight --section LaunchStats \
    --section Occupancy --section WarpStateStats --csv python3 benchmarks/kda_ncu.py > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
  echo "ncu rc=$? ($(grep -c . "$OUT/ncu.csv") lines)"; tail -3 "$OUT/ncu.err"
  timeout 90 python3 benchmarks/kda_tune.py --warps 4 --stages 1 --bv 32,64 --iters 3 > "$OUT/kda_tune_bv.log" 2>&1
  echo "kda_tune bv rc=$?"; grep -v "^# per\|^# w\|^# torch" "$OUT/kda_tune_bv.log"
  ;;
wublock)
  # session 9: the KDA GPU tests, then the w/u kernel's K block (a loop over K in blocks of 32 / 64 / 128; 128 is
  # the former single pass): every kernel at its defaults but that, one profile each (kda_tune.py --defaults), then
  # the first shape's row of the table
  kda_gpu_tests
  for bk in 32 64 128; do
    timeout 60 python3 benchmarks/kda_tune.py --defaults --wu-bk $bk --iters 3 > "$OUT/kda_tune_wu$bk.log" 2>&1
    echo "kda_tune wu BK $bk rc=$?"; grep -E "^\| _wu|^\| total|^#   _wu" "$OUT/kda_tune_wu$bk.log"
  done
  timeout 100 python3 benchmarks/kda.py --only 8,4096,16,128 --no-decode > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]" "$OUT/kda.log"
  ;;
table9)
  # the KDA GPU tests, then issue 4's whole table (four shapes and decode, k3 and fla in one process), then the
  # model's call (the gate in kernel, first shape)
  kda_gpu_tests
  kda_table
  ;;
fused)
  # session 10: the KDA GPU tests (with the fused-output tests), then per shape every kernel at its defaults
  # (kda_tune.py --defaults, one process each) with the forward's output fused into the state scan (--output-from 0)
  # and in its own kernel (--output-from 2^30); then the decode sweep (V block x warps)
  kda_gpu_tests
  for shape in 8,4096,16,128 2,16384,16,128 1,65536,16,128 16,2048,32,64; do
    for of in 0 1073741824; do
      timeout 75 python3 benchmarks/kda_tune.py --defaults --iters 3 --shape $shape --output-from $of \
        > "$OUT/kda_tune_fused.log" 2>&1
      echo "kda_tune $shape output-from $of rc=$?"; grep -E "^\| _wu|^\| _scan|^\| _output|^\| total" \
        "$OUT/kda_tune_fused.log"
    done
  done
  timeout 120 python3 benchmarks/kda.py --decode-only --no-fla --decode-sweep > "$OUT/decode.log" 2>&1
  echo "decode sweep rc=$?"; sed -n '/decode sweep/,$p' "$OUT/decode.log"
  ;;
vfirst)
  # the decode step with the state pool K-first (as served) and V-first (each program's tile contiguous), k3 alone
  for flag in "" "--state-v-first"; do
    timeout 100 python3 benchmarks/kda.py --decode-only --no-fla --decode-sweep $flag > "$OUT/decode$flag.log" 2>&1
    echo "decode $flag rc=$?"; grep "^|" "$OUT/decode$flag.log"
  done
  ;;
s11b)
  # session 11: the KDA GPU tests (V block 16 scans, the output always fused), the long shapes as shipped, then the
  # state scans pipelined whatever their program count at the two short shapes (--scan-stages)
  kda_gpu_tests
  long_shapes_tune ""
  SHAPES="8,4096,16,128 16,2048,32,64" long_shapes_tune "" "--scan-stages 2" "--scan-stages 3" \
    "--scan-bv 32 --bwd-scan-bv 32 --scan-stages 3"
  ;;
s11c)
  # session 11: the KDA GPU tests and issue 4's whole table with both state scans at 3 stages, then the scans at 8
  # warps (per kernel, the first and the longest shape)
  kda_gpu_tests
  kda_table
  SHAPES="8,4096,16,128 1,65536,16,128" long_shapes_tune "--scan-warps 8"
  ;;
s12)
  # prepared in session 11: the KDA GPU tests (the forward intra kernel at 1 warp for K <= 64), the gradient tests
  # with the backward's half partials on (one process: LAUNCH set before pytest starts), per kernel with and without
  # them at the first and fourth shapes, the scans' 1-stage fallback, then issue 4's whole table
  kda_gpu_tests
  timeout -s INT -k 10 200 python3 -c "import sys, pytest; from k3.kernels.kda import triton_chunk_bwd as B
B.LAUNCH['bwd_inter']['HALF_PARTIALS'] = True
sys.exit(pytest.main(['tests/kernels/test_kda_triton.py', '-k', 'gradient', '-p', 'no:cacheprovider', '-rf']))" \
    > "$OUT/half_tests.log" 2>&1
  echo "half-partials gradient tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/half_tests.log" | tail -8
  SHAPES="8,4096,16,128 16,2048,32,64" long_shapes_tune "--fp32-partials" ""
  # which 3-stage scan launches do not fit the H200's shared memory (triton_common.launch_fitting's fallback):
  # fp32 at K = 128 and bf16 at K = 256, forward and backward
  timeout 120 python3 -c "import torch; from k3.kernels.kda import chunk_kda, triton_common as C
for dt, B, H, D in ((torch.float32, 8, 16, 128), (torch.bfloat16, 2, 4, 256)):
    q, k, v = (torch.randn(B, 1024, H, D, device='cuda', dtype=dt, requires_grad=True) for _ in range(3))
    g = (-5 * torch.rand(B, 1024, H, D, device='cuda')).requires_grad_()
    beta = torch.rand(B, 1024, H, device='cuda', dtype=dt, requires_grad=True)
    o, _ = chunk_kda(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0)
    o.float().sum().backward(); torch.cuda.synchronize()
    print(dt, D, 'ok; fell back to 1 stage:', sorted(key[0] for key in C._UNFIT))" 2>&1 | tail -4
  # the table in what is left of the call (a fresh machine without .triton-cache-parts spends ~5 minutes in fla's
  # first autotuning; what it finishes comes back in fla-autotune.tgz either way)
  timeout $((560 - SECONDS)) python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$? at ${SECONDS}s"; grep -v "^$" "$OUT/kda.log"
  save_autotune
  ;;
s12b)
  # the KDA GPU tests with the training forward keeping its states for the backward (K3_KDA_RECOMPUTE unset) and
  # the half partials on by default, then issue 4's whole table in what is left of the call (fla's autotuning
  # results carried in .triton-cache-parts/ from s12; what it finishes comes back in fla-autotune.tgz)
  KDA_TEST_LIMIT=200 kda_gpu_tests
  timeout $((540 - SECONDS)) python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$? at ${SECONDS}s"; grep -v "^$" "$OUT/kda.log"
  save_autotune
  # k3 with the backward recomputing (K3_KDA_RECOMPUTE=1) at the first shape: the memory / time trade
  timeout $((585 - SECONDS)) python3 benchmarks/kda.py --only 8,4096,16,128 --no-decode --no-fla --recompute \
    > "$OUT/kda_recompute.log" 2>&1
  echo "kda --recompute rc=$?"; grep "^|" "$OUT/kda_recompute.log"
  ;;
s13)
  # prepared in session 12: the KDA GPU tests on the backward intra kernel's untimed cut (ad75bf6), issue 4's whole
  # table with the gate row, then per kernel at the first and fourth shapes (_bwd_intra_kernel before the cut:
  # 1,468 and 1,506 us, RESULTS.md session 12, call 1 with bf16 partials)
  kda_gpu_tests
  kda_table
  SHAPES="8,4096,16,128 16,2048,32,64" long_shapes_tune ""
  # the inter kernel's K loop in two blocks of 32 at K = 64 (one pass of 64 now; at 255 registers and 8 warps one
  # program fills a multiprocessor's register file), never timed at that shape
  SHAPES="16,2048,32,64" long_shapes_tune "--bwd-inter-bk 32"
  ;;
s13b)
  # session 13, call 2: launch settings never timed at these shapes (`kda_tune.py --set`), and the inference
  # forward's kernels (`--fwd-only`, what kda.py's fwd column times) at the shapes whose fwd goal is near
  SHAPES="2,16384,16,128 16,2048,32,64" long_shapes_tune "--fwd-only"
  SHAPES="2,16384,16,128" long_shapes_tune "--fwd-only --scan-warps 8" "--scan-warps 8"
  SHAPES="16,2048,32,64" long_shapes_tune "--set bwd_inter.BV=32" \
    "--set bwd_intra.BK=64 --set bwd_intra.num_warps=2" "--set bwd_intra.BK=64 --set bwd_intra.num_warps=2 --set bwd_intra.num_stages=2"
  SHAPES="8,4096,16,128" long_shapes_tune "--set bwd_intra.BK=64 --set bwd_intra.num_warps=2" \
    "--set bwd_intra.BK=128 --set bwd_intra.num_warps=4" "--set bwd_inter.BV=32"
  ;;
s13c)
  # session 13, call 3 (ran on f0ab9d2, whose in-kernel q norm and bound-check flag were then reverted): the KDA GPU
  # tests, the whole table, then per kernel at the first and fourth shapes (RESULTS.md session 13)
  kda_gpu_tests
  kda_table
  SHAPES="8,4096,16,128 16,2048,32,64" long_shapes_tune "" "--fwd-only"
  ;;
s13d)
  # session 13, call 4: the same on the solve that applies beta to its row sums (training forward)
  kda_gpu_tests
  kda_table
  SHAPES="8,4096,16,128 16,2048,32,64" long_shapes_tune "" "--fwd-only"
  ;;
s13e)
  # session 13, call 5: the widest heads (K = V = 256) on the GPU, fp32 and bf16, against the float64 recurrence
  # (test_chunk_gradients_wide_heads), then which pipelined scan launches fall back to 1 stage (launch_fitting) at
  # fp32 K = 128 and bf16 K = 256, with their fwd and fwd+bwd times (each configuration compiles first: 300 s)
  timeout -s INT -k 10 200 python3 -m pytest tests/kernels/test_kda_triton.py -k "wide_heads" -p no:cacheprovider \
    -rf > "$OUT/wide_tests.log" 2>&1
  echo "wide-head tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/wide_tests.log" | tail -6
  fallback_probe
  ;;
s14)
  # prepared in session 13, first of two calls: the KDA GPU tests (their wide-head case failed at fp32 before the
  # reverse scan's K halves; K != V; the fused w/u scan's tests: more variants to compile, so a longer limit), the
  # fp32 tests at tf32x3 and fp32 times per K3_KDA_FP32_DOTS setting
  KDA_TEST_LIMIT=320 kda_gpu_tests
  K3_KDA_FP32_DOTS=tf32x3 timeout -s INT -k 10 200 python3 -m pytest tests/kernels/test_kda_triton.py \
    tests/kernels/test_kda_saved.py -k "float32 or fp32" -p no:cacheprovider -rf -n 8 > "$OUT/tf32x3_tests.log" 2>&1
  echo "fp32 tests at tf32x3 rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/tf32x3_tests.log" | tail -8
  # fp32 fwd / fwd+bwd per K3_KDA_FP32_DOTS setting, and each output's rel_rms against the IEEE one
  timeout 240 python3 -c "import os, torch, triton.testing as tt; from k3.kernels.kda import chunk_kda
xs = [torch.randn(8, 4096, 16, 128, device='cuda') for _ in range(3)]
xs.append(-5 * torch.rand(8, 4096, 16, 128, device='cuda')); xs.append(torch.rand(8, 4096, 16, device='cuda'))
kw = dict(use_qk_l2norm_in_kernel=True, safe_gate=True, lower_bound=-5.0)
ref = None
for p in ('ieee', 'tf32x3', 'tf32'):
    os.environ['K3_KDA_FP32_DOTS'] = p
    leaves = [x.clone().requires_grad_() for x in xs]
    def fb():
        chunk_kda(*leaves, **kw)[0].sum().backward()
    with torch.no_grad():
        o = chunk_kda(*xs, **kw)[0]
        t_f = tt.do_bench(lambda: chunk_kda(*xs, **kw), return_mode='median')
    ref = o if ref is None else ref
    t_fb = tt.do_bench(fb, grad_to_none=leaves, return_mode='median')
    err = ((o - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()
    print(f'fp32 (8,4096,16,128) {p}: fwd {t_f:.3f} ms, fwd+bwd {t_fb:.3f} ms, rel_rms vs ieee {err:.2e}', flush=True)
" 2>&1 | tail -4
  ;;
s14b)
  # session 14's measurement of session 13's fused w/u scan was run by hand (RESULTS.md session 14): it lost, and was
  # removed. This mode now runs the KDA GPU tests, then issue 4's whole table
  kda_gpu_tests
  kda_table
  ;;
s14d)
  # session 14, call 5: the fp32 K-block test of the backward inter kernel hit an illegal address at the tf32x3
  # default in call 4 (taking its pytest worker down): that file per K3_KDA_FP32_DOTS (launches synchronous, so the
  # traceback names the kernel), then the KDA GPU tests
  for p in ieee tf32x3 tf32; do
    CUDA_LAUNCH_BLOCKING=1 K3_KDA_FP32_DOTS=$p timeout 150 python3 -m pytest tests/kernels/test_kda_bwd_kblocks.py \
      -p no:cacheprovider -rf -n 3 > "$OUT/kblocks_$p.log" 2>&1
    echo "kblocks $p rc=$?"; grep -E "^FAILED|^ERROR|passed|failed|^kernels/.*Error|_kernel\[" "$OUT/kblocks_$p.log" | tail -8
  done
  kda_gpu_tests
  ;;
s14e)
  # session 14, the last call: the KDA GPU tests at the session's last code commit, then issue 4's table (no gate row)
  kda_gpu_tests
  timeout 280 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep -v "^$" "$OUT/kda.log"
  ;;
s14f)
  # session 14: the KDA GPU tests alone (after the launch spy's fix)
  kda_gpu_tests
  ;;
s15)
  # prepared in session 14 for the next session's first call: the launch grid at the shape furthest from its goal,
  # (16,2048,32,64) (fwd+bwd 1.29x fla, goal 1.5x), where every LAUNCH entry but the intra kernels' SMALL_K ones was
  # tuned at K = 128: all k3 chunk kernels at 2 / 4 / 8 warps and 1 / 3 stages, V block 64 (the per-kernel
  # best is starred), then the inference forward at 1 / 2 / 4 warps. First, the inference forward with its output in
  # the separate output kernel (the scan then stores states and v_new, but does 2 dots per step instead of 4), at
  # the two fwd-goal shapes of 16 heads: the fused output was chosen on fwd+bwd times (session 11)
  SHAPES="2,16384,16,128 8,4096,16,128" long_shapes_tune "--fwd-only" "--fwd-only --output-from 1000000"
  timeout 300 python3 benchmarks/kda_tune.py --shape 16,2048,32,64 --warps 2,4,8 --stages 1,3 --bv 64 --iters 3 \
    > "$OUT/kda_tune_k64.log" 2>&1
  echo "kda_tune k64 rc=$?"; grep -v "^# per\|^# w\|^# torch" "$OUT/kda_tune_k64.log"
  timeout 120 python3 benchmarks/kda_tune.py --shape 16,2048,32,64 --warps 1,2,4 --stages 1,2 --bv 64 --iters 3 \
    --fwd-only > "$OUT/kda_tune_k64_fwd.log" 2>&1
  echo "kda_tune k64 fwd rc=$?"; grep -v "^# per\|^# w\|^# torch" "$OUT/kda_tune_k64_fwd.log"
  ;;
s15d)
  # session 15: fwd+bwd at (16,2048,32,64) with the q / k L2 norm's backward in the backward intra kernel (y from
  # the rows it holds), at its 3 stages and at 2; the inference forward there (2 scan stages at K <= 64); the
  # inference scan at 8 warps at (2,16384,16,128)
  SHAPES="16,2048,32,64" long_shapes_tune "" "--set bwd_intra.num_stages=2" "--fwd-only"
  SHAPES="2,16384,16,128" long_shapes_tune "--fwd-only --set scan.num_warps=8"
  ;;
s15e)
  # session 15: the backward inter kernel at 16 warps (at most 128 registers a thread: 16 warps a multiprocessor
  # against 8) at the two fwd+bwd shapes furthest from their goal
  SHAPES="16,2048,32,64 8,4096,16,128" long_shapes_tune "--set bwd_inter.num_warps=16"
  ;;
s15g)
  # session 15: stages of the two intra kernels at K = 128 (the backward one gained from 3 at K <= 64)
  SHAPES="8,4096,16,128" long_shapes_tune "--set bwd_intra.num_stages=2" "--set bwd_intra.num_stages=3" \
    "--set intra.num_stages=2"
  ;;
s15h)
  # session 15: the backward intra kernel at K = 128 in the K <= 64 launch's form (K block 64, 2 warps) at 3 and 2
  # stages (session 13 timed K block 64 at 1 stage only: 1,567 us against 1,447)
  SHAPES="8,4096,16,128" long_shapes_tune \
    "--set bwd_intra.BK=64 --set bwd_intra.num_warps=2 --set bwd_intra.num_stages=3" \
    "--set bwd_intra.BK=64 --set bwd_intra.num_warps=2 --set bwd_intra.num_stages=2"
  ;;
s17)
  # prepared in session 16: the gradients' accuracy (bf16 inputs, relative RMS against float64) of k3 at its
  # defaults, with the backward intra kernel's off-diagonal dots in bf16 (fwd+bwd -74 / -84 us at the two shapes
  # short of 1.5x, session 16 call 6; on the CPU dg's error grows 3.3e-3 -> 5.7e-3), and of fla-core 0.6.0 on the
  # same inputs: if k3 with bf16 there is no less accurate than fla, ship it
  timeout 300 python3 benchmarks/kda_grad_error.py --set bwd_intra.PREC=bf16 > "$OUT/grad_error.log" 2>&1
  echo "grad error rc=$?"; grep "^|\|^#" "$OUT/grad_error.log"
  # then issue 4's chunk table with it and the w/u kernel at 8 warps (kda_tune.py, session 16 calls 2 and 5: -10 us
  # at K = 128, +1 at K = 64)
  timeout 200 python3 benchmarks/kda.py --no-decode --set bwd_intra.PREC=bf16 --set wu.num_warps=8 \
    > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep -v "^$" "$OUT/kda.log"
  # then the w/u kernel and the scan in time segments (LAUNCH["scan"]["SEGMENTS"] then, a count; since session 17
  # SEGMENT_CHUNKS, chunks per segment: this loop no longer runs as written) at the two
  # shapes whose scan has fewer programs than multiprocessors (128 and 64), wall-clock (kda_tune.py sums kernel
  # times, which hides the overlap). Prediction: fwd -100 to -250 us at (2,16384,16,128) (w/u 313 us, mostly
  # hidden behind the 443 us scan if the two kernels' programs fit one multiprocessor together), more at
  # (1,65536,16,128) (68 idle multiprocessors during its scan); nothing at the other shapes (not segmented)
  for seg in 0 2 4 8; do
    timeout 150 python3 benchmarks/kda.py --only 2,16384,16,128 1,65536,16,128 --no-decode --no-fla \
      --set scan.SEGMENTS=$seg > "$OUT/seg$seg.log" 2>&1
    echo "segments $seg rc=$?"; grep "^| (" "$OUT/seg$seg.log"
  done
  ;;
s17c)
  # session 17, call 3, after CHAIN_DG and INFER_BATCH_PARTS lost (calls 1-2, removed): the KDA GPU tests (now with
  # test_kda_segments.py), then issue 4's table with the shipped defaults (segments of 128 chunks at the two long
  # shapes, the w/u kernel at 8 warps) and decode; then, no fla, segments of 64 chunks and of 128 with the w/u
  # kernel at 4 warps at the long shapes; then segments forced at the two short shapes (SEGMENT_BELOW 8: their
  # scans run 256 / 512 programs), 8 / 16 / 32 chunks. Prediction there: within -30 / +30 us of the forward (the
  # scan's programs already cover the multiprocessors; the w/u kernel only gains where they leave room)
  kda_gpu_tests
  timeout 240 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep -v "^$" "$OUT/kda.log"
  for flags in "--set scan.SEGMENT_CHUNKS=64" "--set wu.num_warps=4" "--set scan.SEGMENT_CHUNKS=0"; do
    timeout 120 python3 benchmarks/kda.py --only 2,16384,16,128 1,65536,16,128 --no-decode --no-fla $flags \
      > "$OUT/long.log" 2>&1
    echo "long shapes $flags rc=$?"; grep "^| (" "$OUT/long.log"
  done
  for per in 0 8 16 32; do
    timeout 120 python3 benchmarks/kda.py --only 8,4096,16,128 16,2048,32,64 --no-decode --no-fla \
      --set scan.SEGMENT_BELOW=8 --set scan.SEGMENT_CHUNKS=$per > "$OUT/short$per.log" 2>&1
    echo "short shapes, $per chunks a segment rc=$?"; grep "^| (" "$OUT/short$per.log"
  done
  ;;
s17d)
  # session 17, call 4: the KDA GPU tests with the w/u kernel back at 4 warps (8 hit an illegal memory access at K
  # block 16 in call 3); then the state scans at V block 128 (one program per sequence and head, 8 warps, 2 stages:
  # 192 / 208 KB of shared memory, no spills, ptxas sm_90a) at (8,4096,16,128), whose 256 programs at V block 64
  # (208 KB each, one per multiprocessor) run in two waves on the 132 multiprocessors; forward scan, backward scan,
  # both. Prediction: each scan 382 / 391 -> 270-330 us; fwd+bwd -100 to -200 us, fwd -50 to -110. Then issue 4's
  # table with the shipped defaults, and decode
  kda_gpu_tests
  fs="--set scan.BV=128 --set scan.num_warps=8 --set scan.num_stages=2"
  bs="--set bwd_scan.BV=128 --set bwd_scan.num_warps=8 --set bwd_scan.num_stages=2"
  for flags in "" "$fs" "$bs" "$fs $bs"; do
    timeout 100 python3 benchmarks/kda.py --only 8,4096,16,128 --no-decode --no-fla $flags > "$OUT/wide.log" 2>&1
    echo "wide scans [$flags] rc=$?"; grep "^| (" "$OUT/wide.log"
  done
  timeout 240 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep -v "^$" "$OUT/kda.log"
  ;;
s17e)
  # session 17, call 5: the KDA GPU tests with the reverse scan at V block 128 (8 warps, 2 stages) where its halving
  # leaves 128 (shipped after call 4); then at (16,2048,32,64), fla alongside, the training scans at 2 stages in place
  # of 3 at K <= 64 (88 / 96 KB of shared memory: two programs per multiprocessor, so the 512 programs run in two
  # waves, not four). Prediction: forward scan 319 -> 230-280 us, reverse 286 -> 200-250; fwd+bwd -50 to -120 us.
  # Then issue 4's table with the shipped defaults, and decode
  kda_gpu_tests
  for flags in "" "--set bwd_scan.SMALL_K_STAGES=2" "--set scan.SMALL_K_STAGES=2" \
               "--set bwd_scan.SMALL_K_STAGES=2 --set scan.SMALL_K_STAGES=2"; do
    timeout 100 python3 benchmarks/kda.py --only 16,2048,32,64 --no-decode $flags > "$OUT/small.log" 2>&1
    echo "K = 64 [$flags] rc=$?"; grep "^| (" "$OUT/small.log"
  done
  timeout 240 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep -v "^$" "$OUT/kda.log"
  ;;
s17f)
  # session 17, call 6 (the device time left): the wide reverse scan's GPU gradient test (call 5's version counted
  # launch_fitting's 1-stage relaunch of the fp32 launch as a second launch) and the gradient tests at the training
  # scans' 2 stages at K <= 64 (shipped after call 5); issue 4's row at (16,2048,32,64) with them; then the
  # gradients' error at (8,4096,16,128), where the reverse scan runs at V block 128
  timeout -s INT -k 10 100 python3 -m pytest tests/kernels/test_kda_triton.py -k "gradients or wide or bwd_scan" \
    -p no:cacheprovider -rf -n 8 > "$OUT/ktests.log" 2>&1
  echo "kda tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/ktests.log" | tail -12
  timeout 60 python3 benchmarks/kda.py --only 16,2048,32,64 --no-decode > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep -v "^$" "$OUT/kda.log"
  timeout 120 python3 benchmarks/kda_grad_error.py --no-fla --shape 8,4096,16,128 > "$OUT/grad.log" 2>&1
  echo "grad error rc=$?"; grep "^|" "$OUT/grad.log"
  ;;
s18)
  # prepared in session 17 (CPU): the segments' scans on a high-priority stream (LAUNCH["scan"]["SEGMENT_PRIORITY"],
  # off as shipped). Session 17 measured the segmented forward at (2,16384,16,128) at 1.575-1.586 ms in four runs and
  # 1.646 (the unsegmented time) in one: scan s and w/u s + 1 become ready together, and if the w/u programs take the
  # multiprocessors first the scan's wait for them to drain. First the KDA GPU tests (test_kda_segments.py runs the
  # priority path), then three forward-only runs each way at the two long shapes, wall-clock, no fla. Prediction:
  # without priority, some runs near 1.64 ms at (2,16384,16,128); with it, every run at 1.55-1.59
  kda_gpu_tests
  for rep in 1 2 3; do
    for flags in "" "--set scan.SEGMENT_PRIORITY=True"; do
      timeout 100 python3 benchmarks/kda.py --only 2,16384,16,128 1,65536,16,128 --no-decode --no-fla --fwd-only \
        $flags > "$OUT/prio.log" 2>&1
      echo "run $rep [$flags] rc=$?"; grep "^| (" "$OUT/prio.log"
    done
  done
  # then decode with the in-place anchor (PyTorch's pool.mul_ on a pool of the same size): whether the 0.90-of-copy
  # goal at B = 256 (141.2 us) is within reach of an in-place update at all. Prediction: the anchor at 135-145 us
  timeout 120 python3 benchmarks/kda.py --decode-only > "$OUT/decode.log" 2>&1
  echo "decode rc=$?"; grep "^|\|^(" "$OUT/decode.log"
  ;;
s18b)
  # session 18, call 2: q's L2-norm backward inside the backward intra kernel at K = 128 (LAUNCH["bwd_intra"]
  # ["Q_NORM_OUT"], its row sum from the output: sum(dq q) = sum(do o)), so only k's keeps the norm's own pass; and
  # the safe-gate check as a flag (no amin), beta in bf16 (no casts). First the KDA GPU tests, then the gradients'
  # error against float64 with it on / off (and fla's), then kda_tune.py --defaults on / off at (8, 4096, 16, 128),
  # then issue 4's rows at (8, 4096, 16, 128) and (16, 2048, 32, 64) (k3 and fla in one process). Prediction: bwd
  # intra +20 to +60 us, the norm pass -95 us, torch ops -10 to -20 more; fwd+bwd 4.995 -> 4.90-4.95 ms at the first
  # shape, 4.568 -> 4.55 at the fourth; dq's error within 10% of the pass's
  kda_gpu_tests
  timeout 150 python3 benchmarks/kda_grad_error.py --shape 1,4096,16,128 --set bwd_intra.Q_NORM_OUT=False \
    > "$OUT/grad.log" 2>&1
  echo "grad error rc=$?"; grep "^|" "$OUT/grad.log"
  for flags in "" "--set bwd_intra.Q_NORM_OUT=False"; do
    timeout 60 python3 benchmarks/kda_tune.py --defaults --iters 3 --shape 8,4096,16,128 $flags > "$OUT/t.log" 2>&1
    echo "kda_tune [$flags] rc=$?"; grep -E "^\| _|^\| torch|^\| total|^# torch ops" "$OUT/t.log" | cut -c1-400
  done
  timeout 200 python3 benchmarks/kda.py --only 8,4096,16,128 16,2048,32,64 --no-decode > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]" "$OUT/kda.log"
  ;;
s18c)
  # session 18, call 3 (at commit 4ff5f05; Q_NORM_OUT 2 lost and was removed, so run it there): q's norm row sums
  # taken by the inter kernel with its do tiles (Q_NORM_OUT 2) against the intra kernel loading o and do (1: call
  # 2's +75 us in that kernel). The KDA GPU tests, the
  # gradients' error against float64 at 2 and 1, kda_tune.py --defaults at (8, 4096, 16, 128) at 2 and 1, then issue
  # 4's whole table (four shapes and decode, k3 and fla in one process) at the lower of the two totals. Prediction:
  # inter kernel +15 to +40 us, intra back to ~1,430; total 4,947 -> 4,900-4,930 us
  kda_gpu_tests
  timeout 120 python3 benchmarks/kda_grad_error.py --shape 1,4096,16,128 --set bwd_intra.Q_NORM_OUT=1 --no-fla \
    > "$OUT/grad.log" 2>&1
  echo "grad error rc=$?"; grep "^|" "$OUT/grad.log"
  best=2; best_t=999999
  for mode in 2 1; do
    timeout 60 python3 benchmarks/kda_tune.py --defaults --iters 3 --shape 8,4096,16,128 \
      --set bwd_intra.Q_NORM_OUT=$mode > "$OUT/t$mode.log" 2>&1
    echo "kda_tune Q_NORM_OUT=$mode rc=$?"; grep -E "^\| _|^\| torch|^\| total|^# torch ops" "$OUT/t$mode.log" | cut -c1-300
    t=$(grep "^| total" "$OUT/t$mode.log" | awk -F'|' '{gsub(/[* ]/, "", $3); print int($3)}')
    if [ -n "$t" ] && [ "$t" -lt "$best_t" ]; then best=$mode; best_t=$t; fi
  done
  echo "table at Q_NORM_OUT=$best"
  timeout 300 python3 benchmarks/kda.py --set bwd_intra.Q_NORM_OUT=$best > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s18d)
  # session 18, call 4 (at commit 53616c4; BETA_TILE lost and was removed, so run it there): the training solve
  # with beta scaling its loaded diagonal blocks once (LAUNCH["solve"]["BETA_TILE"]) against beta loaded in each
  # substitution step; and the reverse scan
  # without the zero-filled final-state gradient or the unused dh0 (HAS_DHT / STORE_DH0). The KDA GPU tests, then
  # kda_tune.py --defaults at the two shapes short of 1.5x fwd+bwd, BETA_TILE on / off, then issue 4's whole table
  # at the setting with the lower sum of the two totals. Prediction: training solve 151 -> 125-140 us at
  # (16, 2048, 32, 64), 80 -> 70-75 at (8, 4096, 16, 128); fwd+bwd -15 to -30 us there
  kda_gpu_tests
  declare -A tot
  for tile in True False; do
    tot[$tile]=0
    for shape in 16,2048,32,64 8,4096,16,128; do
      timeout 60 python3 benchmarks/kda_tune.py --defaults --iters 3 --shape $shape --set solve.BETA_TILE=$tile \
        > "$OUT/t.log" 2>&1
      echo "kda_tune $shape BETA_TILE=$tile rc=$?"
      grep -E "^\| _|^\| torch|^\| total|^# torch ops" "$OUT/t.log" | cut -c1-300
      t=$(grep "^| total" "$OUT/t.log" | awk -F'|' '{gsub(/[* ]/, "", $3); print int($3)}')
      tot[$tile]=$(( ${tot[$tile]} + ${t:-999999} ))
    done
  done
  best=True; [ "${tot[False]}" -lt "${tot[True]}" ] && best=False
  echo "totals: True ${tot[True]}, False ${tot[False]}; table at BETA_TILE=$best"
  timeout 300 python3 benchmarks/kda.py --set solve.BETA_TILE=$best > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s18e)
  # session 18, call 5: launch settings for the two shapes short of 1.5x fwd+bwd ((16, 2048, 32, 64) needs -23 us,
  # (8, 4096, 16, 128) is at 1.500): the backward intra kernel at 4 stages or 4 warps (both shapes), the forward
  # intra kernel at 2 warps for K <= 64 (the fourth shape). kda_tune.py --defaults per setting; a setting is kept
  # when it lowers the sum of the totals of the shapes it touches by more than 10 us (of the two backward intra
  # ones, the lower). Then, with the kept ones: the KDA GPU tests (K3_TEST_KDA_LAUNCH) and issue 4's rows at the two
  # shapes. Prediction: at most -20 us each; more likely none kept
  tune_tot() {  # $1 shape, rest: flags -> prints the total (us)
    local shape=$1; shift
    timeout 60 python3 benchmarks/kda_tune.py --defaults --iters 3 --shape "$shape" "$@" > "$OUT/t.log" 2>&1
    echo "kda_tune $shape $* rc=$?" >&2
    grep -E "^\| _intra|^\| _bwd_intra|^\| total" "$OUT/t.log" | tr '\n' ' ' >&2; echo >&2
    grep "^| total" "$OUT/t.log" | awk -F'|' '{gsub(/[* ]/, "", $3); print int($3)}'
  }
  b16=$(tune_tot 16,2048,32,64); b8=$(tune_tot 8,4096,16,128)
  a16=$(tune_tot 16,2048,32,64 --set bwd_intra.num_stages=4); a8=$(tune_tot 8,4096,16,128 --set bwd_intra.num_stages=4)
  w16=$(tune_tot 16,2048,32,64 --set bwd_intra.num_warps=4); w8=$(tune_tot 8,4096,16,128 --set bwd_intra.num_warps=4)
  c16=$(tune_tot 16,2048,32,64 --set intra.SMALL_K_WARPS=2)
  dA=$(( a16 + a8 - b16 - b8 )); dW=$(( w16 + w8 - b16 - b8 )); dC=$(( c16 - b16 ))
  echo "deltas (us): bwd_intra 4 stages $dA, bwd_intra 4 warps $dW, intra SMALL_K_WARPS 2 $dC"
  keep=()
  if [ "$dA" -lt -10 ] && [ "$dA" -le "$dW" ]; then keep+=(bwd_intra.num_stages=4); fi
  if [ "$dW" -lt -10 ] && [ "$dW" -lt "$dA" ]; then keep+=(bwd_intra.num_warps=4); fi
  if [ "$dC" -lt -10 ]; then keep+=(intra.SMALL_K_WARPS=2); fi
  echo "kept: ${keep[*]:-none}"
  if [ ${#keep[@]} -gt 0 ]; then
    export K3_TEST_KDA_LAUNCH=$(IFS=,; echo "${keep[*]}")
    KDA_TEST_LIMIT=170 kda_gpu_tests
    sets=(); for x in "${keep[@]}"; do sets+=(--set "$x"); done
    timeout 120 python3 benchmarks/kda.py --only 8,4096,16,128 16,2048,32,64 --no-decode "${sets[@]}" \
      > "$OUT/kda.log" 2>&1
    echo "kda rc=$?"; grep "^|\|^# [0-9]" "$OUT/kda.log"
  fi
  ;;
s18f)
  # session 18, call 6 (exploratory, the last 385 s of device time): warps of the kernels not swept since their
  # launches settled, at (16, 2048, 32, 64) (-23 us short of 1.5x fwd+bwd): the backward inter kernel at 4 warps
  # (255 registers at 8 warps there: one program per multiprocessor), the reverse scan at 8 warps (V block 64, 2
  # stages), the forward scan at 8 warps (also at (8, 4096, 16, 128), whose scan shares the launch). kda_tune.py
  # --defaults totals only; nothing ships from this call without the GPU tests. Prediction: each within +-30 us
  tune_tot() {  # as s18e's
    local shape=$1; shift
    timeout 50 python3 benchmarks/kda_tune.py --defaults --iters 3 --shape "$shape" "$@" > "$OUT/t.log" 2>&1
    echo "kda_tune $shape $* rc=$?"
    grep -E "^\| _scan|^\| _bwd_scan|^\| _bwd_inter|^\| total" "$OUT/t.log" | tr '\n' ' '; echo
  }
  tune_tot 16,2048,32,64
  tune_tot 16,2048,32,64 --set bwd_inter.num_warps=4
  tune_tot 16,2048,32,64 --set bwd_scan.num_warps=8
  tune_tot 16,2048,32,64 --set scan.num_warps=8
  tune_tot 8,4096,16,128
  tune_tot 8,4096,16,128 --set scan.num_warps=8
  ;;
s18g)
  # session 18, call 7 (at commit 4b1850d: the two-pass form and --decode-forms were removed once the one-pass form
  # won, so run it there; the last ~270 s of device time): the decode step in one pass (triton_recurrent.LAUNCH
  # ["ONE_PASS"], off as committed then): the error and the output from the state before the step, the update after,
  # so the output's reduction no longer waits for the updated tile. The recurrent GPU tests (which run the one-pass
  # form too), then kda.py --decode-only --no-fla --decode-forms: both forms alternating, twice. Prediction: B = 256
  # 145.7 -> 139-144 us
  timeout 90 python3 -m pytest tests/kernels/test_kda_triton.py tests/kernels/test_kda_recurrent_compile.py \
    -k recurrent -p no:cacheprovider -n 8 > "$OUT/rtests.log" 2>&1
  echo "recurrent tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/rtests.log" | tail -5
  timeout 90 python3 benchmarks/kda.py --decode-only --no-fla --decode-forms > "$OUT/decode.log" 2>&1
  echo "decode rc=$?"; grep "^|" "$OUT/decode.log"
  ;;
s19c)
  # session 19: register caps (LAUNCH[...]["maxnreg"], Triton's maxnreg: fewer registers, some spills, more programs
  # per multiprocessor) on the latency-bound kernels, per kernel (kda_tune.py --defaults, fwd+bwd and inference
  # forward), at the two short shapes: the defaults, then two sets of caps (each kernel's cap in a set is read from
  # its own row)
  A="--set intra.maxnreg=200 --set wu.maxnreg=168 --set bwd_intra.maxnreg=200 --set scan.maxnreg=168"
  B="--set intra.maxnreg=168 --set wu.maxnreg=128 --set bwd_intra.maxnreg=168 --set bwd_inter.maxnreg=128"
  for shape in 8,4096,16,128 16,2048,32,64; do
    for mode in "" "--fwd-only"; do
      for sets in "" "$A" "$B"; do
        timeout 60 python3 benchmarks/kda_tune.py --defaults --iters 3 --shape $shape $mode $sets > "$OUT/t.log" 2>&1
        echo "$shape ${mode:-fwd+bwd} ${sets:-defaults} rc=$?"
        grep -E "^\| _|^\| torch|^\| total" "$OUT/t.log" | grep -v nan | tr '\n' ' '; echo
      done
    done
  done
  ;;
s19d)
  # session 19: the w/u kernel's register cap (call 3: 168 took it 308 -> 279 us at (8,4096,16,128)) with its other
  # launch settings, inference forward at (8,4096,16,128); then the cap at the long shape, whose w/u segments overlap
  # the scan
  for sets in "" "--set wu.maxnreg=168" "--set wu.maxnreg=168 --set wu.num_stages=1" \
      "--set wu.maxnreg=168 --set wu.num_stages=3" "--set wu.maxnreg=168 --set wu.BV=128" \
      "--set wu.maxnreg=168 --set wu.BV=32" "--set wu.maxnreg=128 --set wu.num_warps=8" \
      "--set wu.maxnreg=200" "--set wu.maxnreg=144"; do
    timeout 60 python3 benchmarks/kda_tune.py --defaults --iters 3 --fwd-only $sets > "$OUT/t.log" 2>&1
    echo "8,4096,16,128 fwd-only ${sets:-defaults} rc=$?"
    grep -E "^\| _wu|^\| total" "$OUT/t.log" | tr '\n' ' '; echo
  done
  for sets in "" "--set wu.maxnreg=168"; do
    timeout 90 python3 benchmarks/kda_tune.py --defaults --iters 3 --fwd-only --shape 2,16384,16,128 $sets \
      > "$OUT/t.log" 2>&1
    echo "2,16384,16,128 fwd-only ${sets:-defaults} rc=$?"
    grep -E "^\| _|^\| torch|^\| total" "$OUT/t.log" | grep -v nan | tr '\n' ' '; echo
  done
  ;;
s19e)
  # session 19's last call: the KDA GPU tests at the shipped code, beside every CUDA serving test (the decode step
  # changed in session 18; needs the fastapi / openai wheels in .whl), then issue 4's whole table (four shapes and
  # decode, k3 and fla in one process) once both are done
  kda_and_serve_tests
  for sets in "" "--set solve.maxnreg=96" "--set solve.maxnreg=112"; do  # the solve's register cap (1 warp, 133)
    timeout 60 python3 benchmarks/kda_tune.py --defaults --iters 3 --shape 16,2048,32,64 $sets > "$OUT/t.log" 2>&1
    echo "16,2048,32,64 fwd+bwd ${sets:-defaults} rc=$?"; grep -E "^\| _solve|^\| total" "$OUT/t.log" | tr '\n' ' '; echo
  done
  timeout 300 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s19f)
  # session 19: the KDA GPU tests with the solve capped at 112 registers (as shipped next), beside every CUDA serving
  # test (now with opentelemetry-api in .whl, which fastapi 0.165 imports); the solve's cap per kernel; then issue
  # 4's whole table
  kda_and_serve_tests
  for shape in 16,2048,32,64 8,4096,16,128; do
    for cap in 0 104 112; do
      timeout 60 python3 benchmarks/kda_tune.py --defaults --iters 3 --shape $shape --set solve.maxnreg=$cap \
        > "$OUT/t.log" 2>&1
      echo "$shape fwd+bwd solve.maxnreg=$cap rc=$?"; grep -E "^\| _solve|^\| total" "$OUT/t.log" | tr '\n' ' '; echo
    done
  done
  timeout 300 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s20)
  # session 20's first call (prepared in session 19): the KDA GPU tests beside the serving CUDA tests at -n 3, then
  # test_decode_compile.py's CUDA tests in one process, then Gamma from g in the w/u kernel off / on twice at
  # (16,2048,32,64) (measured: a loss, then removed from the code with its launch flag; the loop is gone with it:
  # RESULTS.md session 20 quotes it), then issue 4's table
  kda_and_serve_tests
  K3_KERNELS=triton timeout -s INT -k 10 120 python3 -m pytest tests/serve/test_decode_compile.py -q \
    -p no:cacheprovider -rfs -k cuda > "$OUT/serve_compile.log" 2>&1
  echo "test_decode_compile.py in one process rc=$?"; grep -E "^FAILED|passed|failed|capture failed" \
    "$OUT/serve_compile.log" | tail -6
  timeout 240 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s20c)
  # session 20: the KDA GPU tests (the torch.compile test with conftest's poisoned torch.empty mended; Gamma from g
  # removed) beside the serving CUDA tests at -n 3 once more; then where each library's inference forward goes,
  # kernel by kernel, at the two shapes short of fwd 1.3x (kda_tune.py --fwd-only --fla); then issue 4's table
  kda_and_serve_tests
  for shape in 16,2048,32,64 8,4096,16,128; do
    timeout 90 python3 benchmarks/kda_tune.py --defaults --iters 5 --fwd-only --fla --shape $shape \
      > "$OUT/fla_fwd_$shape.log" 2>&1
    echo "kda_tune --fwd-only --fla $shape rc=$?"; grep -E "^\| _|^\| torch|^\| total|^## fla|^\| [a-z]" \
      "$OUT/fla_fwd_$shape.log" | grep -v "^| kernel" | head -30
  done
  timeout 240 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s20d)
  # session 20: the w/u kernel's M and the backward inter kernel's M and Akk loaded with a block mask (16-byte loads)
  # and cut to the triangle in registers (_load_tril): ab/new holds the three kernel files with it, ab/base without
  # (untracked, carried with the working tree, which has it):
  # the KDA GPU tests with it beside the serving CUDA tests (test_decode_compile's without its own torch.empty
  # workaround), then kda_tune with / without it, alternating
  kda_and_serve_tests
  tune_ab() {  # $1 label, rest: kda_tune flags
    local label=$1; shift
    timeout 60 python3 benchmarks/kda_tune.py --defaults --iters 5 "$@" > "$OUT/t.log" 2>&1
    echo "$label $* rc=$?"; grep -E "^\| _intra|^\| _solve|^\| _wu|^\| _scan|^\| _bwd_inter|^\| total" "$OUT/t.log" \
      | tr '\n' ' '; echo
  }
  for round in 1 2; do
    tune_ab with --fwd-only --shape 16,2048,32,64
    cp ab/base/*.py kernels/kda/
    tune_ab without --fwd-only --shape 16,2048,32,64
    cp ab/new/*.py kernels/kda/
  done
  for shape in 16,2048,32,64 8,4096,16,128; do
    tune_ab with --shape $shape
    cp ab/base/*.py kernels/kda/
    tune_ab without --shape $shape
    cp ab/new/*.py kernels/kda/
  done
  tune_ab with --fwd-only --shape 8,4096,16,128
  cp ab/base/*.py kernels/kda/
  tune_ab without --fwd-only --shape 8,4096,16,128
  cp ab/new/*.py kernels/kda/
  ;;
s20e)
  # session 20: the GPU tests again with conftest's NaN-poisoned torch.empty as a new NaN tensor (no in-place fill
  # to trace), beside the serving CUDA tests; then _load_tril (ab/new) against without (ab/base) in the training
  # path at (16,2048,32,64), two more rounds; then issue 4's table with it
  kda_and_serve_tests
  for round in 1 2; do
    for side in new base; do
      cp ab/$side/*.py kernels/kda/
      timeout 60 python3 benchmarks/kda_tune.py --defaults --iters 5 --shape 16,2048,32,64 > "$OUT/t.log" 2>&1
      echo "$side rc=$?"; grep -E "^\| _wu|^\| _bwd_inter|^\| _bwd_intra|^\| total" "$OUT/t.log" | tr '\n' ' '; echo
    done
  done
  cp ab/new/*.py kernels/kda/
  timeout 240 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s22)
  # prepared in session 21 for the next session's first call: the intra kernel in K halves at K = 128 (an inference
  # forward with fp16 L: LAUNCH["intra"]["KSPLIT_FROM"] = 128, off until timed). First the KDA GPU tests with it on
  # beside the serving CUDA tests; then the inference forward with and without it at the three K = 128 shapes, twice,
  # and at K = 64 once (session 22 moved the table to s22b, a call of its own)
  K3_TEST_KDA_LAUNCH=intra.KSPLIT_FROM=128 kda_and_serve_tests
  wins=0
  for round in 1 2; do
    for shape in 8,4096,16,128 2,16384,16,128 1,65536,16,128; do
      a=$(tune21 whole --fwd-only --shape $shape | tee /dev/stderr | grep -o "total | [0-9]*" | tr -cd '0-9')
      b=$(tune21 halves --fwd-only --shape $shape --set intra.KSPLIT_FROM=128 | tee /dev/stderr \
        | grep -o "total | [0-9]*" | tr -cd '0-9')
      if [ $shape = 8,4096,16,128 ] && [ -n "$a" ] && [ -n "$b" ] && [ "$b" -lt "$a" ]; then wins=$((wins + 1)); fi
    done
  done
  echo "halves won at (8,4096,16,128) in $wins of 2 rounds"
  # the same at K = 64 (KSPLIT_FROM 64: halves of 32, ~157 registers at 1 warp (ptxas) against 248)
  tune21 whole --fwd-only --shape 16,2048,32,64
  tune21 halves --fwd-only --shape 16,2048,32,64 --set intra.KSPLIT_FROM=64
  ;;
s22c)
  # session 22's third call: the K split with Aqk's two partial sums added by the scan (not the solve), as the
  # default candidate: the KDA GPU tests with it on; then the inference forward whole / in halves / in halves at 2
  # warps (SMALL_K_WARPS: the halves' launch), twice at (8, 4096, 16, 128), once at the two long shapes
  K3_TEST_KDA_LAUNCH=intra.KSPLIT_FROM=128 kda_gpu_tests
  for round in 1 2; do
    tune21 whole --fwd-only --shape 8,4096,16,128
    tune21 halves --fwd-only --shape 8,4096,16,128 --set intra.KSPLIT_FROM=128
    tune21 halves-2w --fwd-only --shape 8,4096,16,128 --set intra.KSPLIT_FROM=128 --set intra.SMALL_K_WARPS=2
  done
  for shape in 2,16384,16,128 1,65536,16,128; do
    tune21 whole --fwd-only --shape $shape
    tune21 halves --fwd-only --shape $shape --set intra.KSPLIT_FROM=128
  done
  ;;
s22d)
  # session 22's fourth call: the K split (KSPLIT_FROM 128) and q's rows scaled by its rstd in the intra kernel
  # (Q_RSTD) as the tree's defaults: the KDA GPU tests beside the serving CUDA tests; then the inference forward
  # as shipped / without Q_RSTD / as session 21 shipped, twice at (8, 4096, 16, 128); Q_RSTD off / on at
  # (16, 2048, 32, 64) (no K split at K = 64); the two long shapes as shipped / as session 21 shipped
  kda_and_serve_tests
  old=(--set intra.KSPLIT_FROM=0 --set intra.Q_RSTD=False)
  for round in 1 2; do
    tune21 new --fwd-only --shape 8,4096,16,128
    tune21 no-qrstd --fwd-only --shape 8,4096,16,128 --set intra.Q_RSTD=False
    tune21 s21 --fwd-only --shape 8,4096,16,128 "${old[@]}"
  done
  tune21 new --fwd-only --shape 16,2048,32,64
  tune21 no-qrstd --fwd-only --shape 16,2048,32,64 --set intra.Q_RSTD=False
  for shape in 2,16384,16,128 1,65536,16,128; do
    tune21 new --fwd-only --shape $shape
    tune21 s21 --fwd-only --shape $shape "${old[@]}"
  done
  ;;
s22e)
  # session 22's sixth call: launch settings around the new defaults (K split, Q_RSTD) at (8, 4096, 16, 128),
  # inference forward, one run each, the defaults first and last
  tune21 new --fwd-only --shape 8,4096,16,128
  for flag in intra.num_stages=2 intra.maxnreg=168 intra.maxnreg=200 solve.num_warps=2 scan.num_stages=4 \
      scan.BV=32 scan.num_warps=8; do
    tune21 "$flag" --fwd-only --shape 8,4096,16,128 --set $flag
  done
  tune21 new --fwd-only --shape 8,4096,16,128
  ;;
s22f)
  # session 22's seventh call: Q_RSTD 2 (Aqk's and qg's rows scaled by q's rstd as stored: the rstd load waits behind
  # the walk) as the default: the forward's GPU tests of the q rows, the K halves and the intra kernel; Q_RSTD 2 / 1
  # / 0 twice at (8, 4096, 16, 128); then issue 4's table with the form that won both rounds. Ran on an uncommitted
  # tree: form 2 lost and was removed after it (Q_RSTD is a flag again), so its rows no longer mean what they did
  timeout -s INT -k 10 120 python3 -m pytest tests/kernels/test_kda_triton.py -k "scales_q_rows or k_halves or \
    intra_kernel_matches or chunk_matches or solve_kernel" -p no:cacheprovider -q -n 8 > "$OUT/ktests.log" 2>&1
  echo "tests rc=$?"; grep -E "^FAILED|^ERROR|passed|failed" "$OUT/ktests.log" | tail -8
  wins=0
  for round in 1 2; do
    a=$(tune21 q-rstd-2 --fwd-only --shape 8,4096,16,128 | tee /dev/stderr | grep -o "total | [0-9]*" | tr -cd '0-9')
    b=$(tune21 q-rstd-1 --fwd-only --shape 8,4096,16,128 --set intra.Q_RSTD=1 | tee /dev/stderr \
      | grep -o "total | [0-9]*" | tr -cd '0-9')
    tune21 q-rstd-0 --fwd-only --shape 8,4096,16,128 --set intra.Q_RSTD=0
    if [ -n "$a" ] && [ -n "$b" ] && [ "$a" -lt "$b" ]; then wins=$((wins + 1)); fi
  done
  sets=(); [ $wins -eq 2 ] || sets=(--set intra.Q_RSTD=1)
  echo "table with: ${sets[*]:-the defaults}"
  timeout 200 python3 benchmarks/kda.py "${sets[@]}" > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s23)
  # prepared in session 22 for the next session's first call: which inference forwards in K halves are right in
  # bf16 / fp16 / fp32 (benchmarks/kda_split_check.py --quick: each case in a process of its own, against float64;
  # session 22 saw a bf16 forward in halves of 32 off by 0.81): bf16 first (each case compiles its own kernels on a
  # fresh machine), then fp16 and fp32
  timeout 300 python3 benchmarks/kda_split_check.py --quick --dtypes bfloat16 > "$OUT/split_check_bf16.log" 2>&1
  echo "bf16 split check rc=$?"; cat "$OUT/split_check_bf16.log"
  timeout 250 python3 benchmarks/kda_split_check.py --quick --dtypes float16 float32 > "$OUT/split_check.log" 2>&1
  echo "fp16 / fp32 split check rc=$?"; cat "$OUT/split_check.log"
  ;;
s23b)
  # session 23's second call: with the w/u kernel's V block floor (wu.MIN_BV 64) and the K split on at K = 128, the
  # KDA GPU tests beside the CUDA serving tests, then the bf16 split check (every row should pass now)
  kda_and_serve_tests
  timeout 200 python3 benchmarks/kda_split_check.py --quick --dtypes bfloat16 > "$OUT/split_check_bf16.log" 2>&1
  echo "bf16 split check rc=$?"; cat "$OUT/split_check_bf16.log"
  ;;
s23c)
  # session 23's third call: the inference solve's blocks below the diagonal loaded before its walk (solve.EARLY,
  # the default) against after it, inference forward kernels at two shapes (two rounds at (8, 4096, 16, 128)), the
  # solve's GPU tests (both forms), then issue 4's table as shipped. Ran on an uncommitted tree: solve.EARLY was
  # removed after it (RESULTS.md session 23), so it no longer runs
  for round in 1 2; do
    for flags in "" "--set solve.EARLY=False"; do tune21 "r$round" --fwd-only --shape 8,4096,16,128 $flags; done
  done
  for flags in "" "--set solve.EARLY=False"; do tune21 r1 --fwd-only --shape 16,2048,32,64 $flags; done
  timeout 60 python3 -m pytest tests/kernels/test_kda_triton.py -k solve_kernel -p no:cacheprovider -q -n 4 \
    2>&1 | tail -2
  timeout 280 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s23d)
  # session 23's fourth call: the K-half pairs adding their partial sums themselves (intra.KSPLIT_MERGE, the
  # default) against their readers adding them: the split's GPU tests, then the inference forward kernels, two
  # rounds at (8, 4096, 16, 128), one at (2, 16384, 16, 128), then issue 4's table as shipped. Ran on an
  # uncommitted tree: intra.KSPLIT_MERGE was removed after it (RESULTS.md session 23), so it no longer runs
  timeout 120 python3 -m pytest tests/kernels/test_kda_triton.py -k "k_halves or inference_forward" \
    -p no:cacheprovider -q -n 8 -rf 2>&1 | tail -4
  for round in 1 2; do
    for flags in "" "--set intra.KSPLIT_MERGE=False"; do tune21 "r$round" --fwd-only --shape 8,4096,16,128 $flags; done
  done
  for flags in "" "--set intra.KSPLIT_MERGE=False"; do tune21 r1 --fwd-only --shape 2,16384,16,128 $flags; done
  timeout 280 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s23e)
  # session 23's last call, the tree as shipped (K split on at K = 128, its halves adjacent in the launch; the w/u
  # kernel's V block floor): issue 4's table, then the KDA GPU tests
  timeout 200 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  KDA_TEST_LIMIT=170 kda_gpu_tests
  ;;
s22b)
  # session 22's second call: issue 4's table, with the kda.py flags given after the mode (session 22 split s22 in
  # two after its cache of compiled kernels was lost: a cold compile made one call too long)
  shift
  echo "table with: ${*:-the defaults}"
  timeout 280 python3 benchmarks/kda.py "$@" > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s21a)
  # session 21: the KDA GPU tests with three forward changes on (the tree's defaults: the solve's diagonal blocks as
  # a product of powers on the tensor cores, POW; Aqk's blocks above the diagonal left unwritten, AQK_ZEROS off; L in
  # fp16 at inference, L_FP16), then each against the old form (kda_tune --set), inference forward and fwd+bwd.
  # Ran on an uncommitted tree: POW and AQK_ZEROS were removed after it (RESULTS.md session 21), so it no longer runs
  kda_gpu_tests
  old=(--set solve.POW=False --set intra.AQK_ZEROS=True --set intra.L_FP16=False)
  for shape in 16,2048,32,64 8,4096,16,128; do
    for round in 1 2; do
      tune21 old --fwd-only --shape $shape "${old[@]}"
      tune21 new --fwd-only --shape $shape
    done
    tune21 pow-only --fwd-only --shape $shape --set intra.AQK_ZEROS=True --set intra.L_FP16=False
    tune21 nozeros-only --fwd-only --shape $shape --set solve.POW=False --set intra.L_FP16=False
    tune21 fp16L-only --fwd-only --shape $shape --set solve.POW=False --set intra.AQK_ZEROS=True
    tune21 old-train --shape $shape "${old[@]}"
    tune21 new-train --shape $shape
  done
  ;;
s21b)
  # session 21, call 2: the KDA GPU tests at the tree's defaults (L in fp16 at inference, Aqk's upper blocks left
  # unwritten, Gamma summed by dots in the w/u kernel at K <= 64); each against the old form at (16,2048,32,64)
  # and (8,4096,16,128), inference forward; then issue 4's table. Ran on an uncommitted tree: AQK_ZEROS and
  # SMALL_K_GAMMA_BY_DOT were removed after it (RESULTS.md session 21), so it no longer runs
  kda_gpu_tests
  old=(--set intra.L_FP16=False --set intra.AQK_ZEROS=True --set wu.SMALL_K_GAMMA_BY_DOT=0)
  for round in 1 2; do
    tune21 old --fwd-only --shape 16,2048,32,64 "${old[@]}"
    tune21 new --fwd-only --shape 16,2048,32,64
  done
  tune21 no-by-dot --fwd-only --shape 16,2048,32,64 --set wu.SMALL_K_GAMMA_BY_DOT=0
  tune21 by-dot-bf16 --fwd-only --shape 16,2048,32,64 --set wu.SMALL_K_GAMMA_BY_DOT=bf16
  tune21 zeros --fwd-only --shape 16,2048,32,64 --set intra.AQK_ZEROS=True
  tune21 old --fwd-only --shape 8,4096,16,128 "${old[@]}"
  tune21 new --fwd-only --shape 8,4096,16,128
  tune21 zeros --fwd-only --shape 8,4096,16,128 --set intra.AQK_ZEROS=True
  timeout 200 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s21c)
  # session 21, call 3: the KDA GPU tests beside the serving CUDA tests at the code to ship (L in fp16 at inference
  # with the L2 norm, Aqk's blocks above the diagonal never written); the inference forward with and without fp16 L
  # at both short shapes; then issue 4's table
  kda_and_serve_tests
  for round in 1 2; do
    for shape in 16,2048,32,64 8,4096,16,128; do
      tune21 fp16-L --fwd-only --shape $shape
      tune21 fp32-L --fwd-only --shape $shape --set intra.L_FP16=False
    done
  done
  timeout 200 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s21d)
  # session 21, call 4: the KDA GPU tests beside the serving CUDA tests with the forward's chunk kernels chained by
  # programmatic dependent launch (LAUNCH["chain"]["PDL"]) and the w/u kernel loading v early at K <= 64
  # (LAUNCH["wu"]["EARLY_V"]); each off against on, inference forward at both short shapes; each kept for issue 4's
  # table when it lowers the sum of both totals by more than 5 us. Ran at 168cab0; both lost (RESULTS.md session 21)
  # and were removed with their flags, so it no longer runs
  kda_and_serve_tests
  total21() {  # $1 shape, rest: flags -> the inference forward's total us
    local shape=$1; shift
    timeout 60 python3 benchmarks/kda_tune.py --defaults --iters 5 --fwd-only --shape "$shape" "$@" > "$OUT/t.log" 2>&1
    grep -E "^\| _intra|^\| _solve|^\| _wu|^\| _scan|^\| total" "$OUT/t.log" | tr '\n' ' ' >&2; echo >&2
    grep "^| total" "$OUT/t.log" | tr -cd '0-9'
  }
  sets=()
  for flag in chain.PDL wu.EARLY_V; do
    on=$(( $(total21 16,2048,32,64) + $(total21 8,4096,16,128) ))
    off=$(( $(total21 16,2048,32,64 --set $flag=False) + $(total21 8,4096,16,128 --set $flag=False) ))
    echo "$flag: on $on us, off $off us (sum of both shapes)"
    [ $on -lt $((off - 5)) ] || sets+=(--set $flag=False)
  done
  echo "table with: ${sets[*]:-the defaults}"
  timeout 200 python3 benchmarks/kda.py "${sets[@]}" > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s20f)
  # session 20: the GPU tests with the chunk kernels taking their float scalars as fp32 at entry (_f32: inductor
  # passes fp64) and the compile tests on the real torch.empty, beside the serving CUDA tests; then issue 4's table
  # at the commit to ship (_load_tril in the w/u and backward inter kernels)
  kda_and_serve_tests
  timeout 240 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s20g)
  # session 20, last call: the forward kernels' num_warps x num_stages at (16,2048,32,64), inference forward (the
  # w/u kernel trails fla's there by 32 us: 294 against 262, call 2)
  timeout 200 python3 benchmarks/kda_tune.py --fwd-only --shape 16,2048,32,64 --warps 2,4,8 --stages 1,2,3 --bv 64 \
    --iters 5 > "$OUT/sweep.log" 2>&1
  echo "sweep rc=$?"; grep -E "^\||^#" "$OUT/sweep.log" | head -40
  ;;
s19)
  # prepared in session 18 for the next session's first call: the KDA GPU tests at the shipped code (session 18 ran
  # the chunk tests at 53616c4 and the recurrent ones at b3e1bab, not all at one commit), then issue 4's whole table
  # (four shapes and decode, k3 and fla in one process); then `stalls` (Nsight Compute's WarpStateStats of every
  # kernel of one fwd+bwd at (8, 4096, 16, 128)) for the forward goals
  kda_gpu_tests
  timeout 300 python3 benchmarks/kda.py > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep "^|\|^# [0-9]\|^(" "$OUT/kda.log"
  ;;
s16d)
  # session 16, the last call: the KDA GPU tests at the shipped code, then launch settings at the two fwd+bwd shapes
  # short of 1.5x, each kept when it lowers the sum of both kda_tune totals by more than 10 us; then issue 4's table
  # with the kept ones (which the code then ships: RESULTS.md session 16)
  kda_gpu_tests
  tune_total() {  # $1 shape, rest: flags -> total us
    local shape=$1; shift
    timeout 60 python3 benchmarks/kda_tune.py --defaults --iters 3 --shape "$shape" "$@" > "$OUT/t.log" 2>&1
    grep "^| total" "$OUT/t.log" | tr -cd '0-9'
  }
  keep=()
  b1=$(tune_total 8,4096,16,128); b4=$(tune_total 16,2048,32,64)
  echo "baseline: $b1 + $b4 us"
  for flag in bwd_intra.num_warps=4 solve.num_warps=2 wu.num_warps=8; do
    sets=(); for f in "${keep[@]}" "$flag"; do sets+=(--set "$f"); done
    t1=$(tune_total 8,4096,16,128 "${sets[@]}"); t4=$(tune_total 16,2048,32,64 "${sets[@]}")
    echo "$flag (with ${keep[*]:-none}): $t1 + $t4 us"
    if [ -n "$t1" ] && [ -n "$t4" ] && [ $((t1 + t4)) -lt $((b1 + b4 - 10)) ]; then
      keep+=("$flag"); b1=$t1; b4=$t4
    fi
  done
  sets=(); for f in "${keep[@]}"; do sets+=(--set "$f"); done
  echo "table with: ${keep[*]:-the defaults}"
  timeout 280 python3 benchmarks/kda.py "${sets[@]}" > "$OUT/kda.log" 2>&1
  echo "kda rc=$?"; grep -v "^$" "$OUT/kda.log"
  ;;
s16)
  # prepared in session 15 for the next session's second call (the first: s14e, the GPU tests and the table after
  # 0a3c5a9 restored bf16x3 on the backward intra kernel's diagonal blocks). (1) Where the backward inter kernel's warps wait at
  # (16,2048,32,64): 1,410 us there, ~14.7 us per program at one 8-warp program per multiprocessor and 41% of the
  # copy bandwidth by its bytes (RESULTS.md session 15); Nsight Compute's stall reasons and source counters of one
  # launch. (2) Launch settings not yet timed since the inter kernel stopped reading u and w: at K = 128 its V block
  # 128 (no V loop; the second K pass still recomputes dvb) and 2 stages (the V loop's loads ahead), the dg pass
  # at K block 128, the w/u kernel at 8 warps; at K = 64 the inter kernel's V block 32 and the dg pass at K block 32.
  # First, at both shapes, the defaults and the inter kernel issuing loads sooner (LAUNCH["bwd_inter"]
  # ["EARLY_LOADS"] 1 and 2, 0 until timed)
  timeout 180 ncu --clock-control none --profile-from-start off --kernel-name regex:_bwd_inter_kernel \
    --launch-count 1 --section SpeedOfLight --section Occupancy --section WarpStateStats --section SourceCounters \
    --section MemoryWorkloadAnalysis --page details --csv python3 benchmarks/kda_ncu.py --shape 16,2048,32,64 \
    --no-fla > "$OUT/ncu_inter.csv" 2> "$OUT/ncu_inter.err"
  echo "ncu inter rc=$?"; tail -3 "$OUT/ncu_inter.err"
  grep -i "stall\|duration\|throughput\|registers\|occupancy\|hit rate" "$OUT/ncu_inter.csv" | head -60
  SHAPES="8,4096,16,128 16,2048,32,64" long_shapes_tune "" "--set bwd_inter.EARLY_LOADS=1" \
    "--set bwd_inter.EARLY_LOADS=2"
  SHAPES="8,4096,16,128" long_shapes_tune "--set bwd_inter.BV=128" "--set bwd_inter.num_stages=2" \
    "--set bwd_dg.BK=128" "--set wu.num_warps=8"
  SHAPES="16,2048,32,64" long_shapes_tune "--set bwd_inter.BV=32" "--set bwd_dg.BK=32"
  ;;
*)
  modes="kernels|serve|spec|batch|anchor|table|table2|prec|ncu|tune|final|breakdown|stalls|wublock|table9"
  echo "usage: bash benchmarks/h200_session.sh MODE ($modes|cmd|fused|vfirst|s11b|s11c|s12|s12b|s13|s13b|s13c|s13d|s13e|s14|s14b|s14d|s14e|s14f|s15|s15d|s15e|s15g|s15h|s16|s16d|s17|s17c|s17d|s17e|s17f|s18|s18b|s18c|s18d|s18e|s18f|s18g|s19|s19c|s19d|s19e|s19f|s20|s20c|s20d|s20e|s20f|s20g|s21a|s21b|s21c|s21d|s22|s22b|s22c|s22d|s22e|s22f|s23)" >&2; exit 2
  ;;
esac
