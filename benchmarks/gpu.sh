#!/usr/bin/env bash
# The GPU runs behind the H200 rows of benchmarks/RESULTS.md, one mode per device call (each mode fits 600 s):
#
#   bash benchmarks/gpu.sh MODE                MODE: kernels | kda | train | serve | quant | all
#
#   kernels  every GPU kernel test (KDA chunk, recurrent, K-block backward, saved intermediates, gate, fused output,
#            time segments; paged MLA decode; C2-GLU; router; the Triton path end to end) beside every CUDA test
#            outside tests/kernels (`-k cuda`: decode, verify and tail graphs, compiled decode and its bucket
#            routing, one-sync speculative steps, dtypes, the Muon step); every variant of the sm_90 compile checks
#            (`-m slow_compile`, which CI leaves out for time); then benchmarks/mla_decode.py (the paged
#            MLA table) and benchmarks/kda_tune.py --defaults (each KDA kernel's time at its own launch)
#   kda      the KDA table: benchmarks/kda.py (k3, fla and SDPA in one process per shape: forward and
#            forward+backward at the four shapes, then decode), then the model's call (raw gate, the gate in kernel
#            in both libraries) at the first shape; fla's autotuning results come back as $OUT/fla-autotune.tgz
#   train    benchmarks/model.py: the dense anchor against k3-small at --batch 4 --seq 4096 and 1 x 32768, then
#            benchmarks/model_breakdown.py --profile-step (one whole step with the optimizer, by kernel category);
#            TRAIN_PARTS=graph / compile: model.py with --cuda-graph / --compile; TRAIN_PARTS=ops: model.py
#            --profile-ops (device time by forward module, backward node, aten op); TRAIN_PARTS=tune: the glue
#            kernels' launch search (benchmarks/glue_tune.py); TRAIN_PARTS=pretrain: the
#            train.cuda_graph tests, then `k3 pretrain --preset small` for 30 steps eager and with train.cuda_graph;
#            TRAIN_PARTS=long: k3-small at 4K, 16K, 32K, 64K and 128K tokens per sequence (activation checkpointing
#            and the chunked loss where memory needs them), peak memory, the dense anchor beside it where it fits;
#            TRAIN_PARTS=fused: the fused training kernels' GPU tests, then attnres.py, kda_glue.py, moe_step.py and
#            mla_max_logit.py
#   serve    benchmarks/serve.py: the compiled k3-small server (random weights) at concurrency 1 and 32 through
#            HTTP, the Hugging Face anchors in the same run; then the trained k3-tiny (carry runs/tiny): the
#            2,048-token prefix hit and MTP speculative decoding at k = 2
#   quant    the quantized-checkpoint tests (the Triton int4 GEMMs in bf16 too), benchmarks/quant.py (the fused
#            int4 GEMMs against bf16 torch._grouped_mm / torch.matmul), benchmarks/serve.py on a random-weight
#            k3-small in bf16 and its w4a8 (routed experts) and all_linear w4a16 exports at concurrency 1 and 32;
#            with QUANT_PARTS=tiny (a second call) the trained k3-tiny and its w4a8 and w8a16 exports, one after
#            another (carry runs/tiny: its tokenizer serves the k3-small releases too); QUANT_PARTS=tune first runs
#            benchmarks/quant_tune.py, the launch search behind the kernels' table
#   all      every mode above in turn (about 40 minutes: more than one call)
#
# What to carry (the device tool's `carry`):
#   .whl        the wheels the GPU machine lacks, installed with --no-deps into /tmp/site: fla-core 0.6.0 and einops
#               (the anchor of the kda table and of hf_anchor's Qwen3-Next), transformers (the serving anchors), and
#               the serving stack: fastapi, starlette, pydantic, pydantic-core, annotated-types, typing-inspection,
#               opentelemetry-api, uvicorn, httptools, openai, distro, jiter, sniffio, httpx, httpcore, ...
#               (`pip download --no-deps --python-version 3.12 --only-binary=:all: -d .whl NAME==VERSION`)
#   runs/tiny   the README's k3-tiny (`k3 pretrain --out runs/tiny`), for serve's and quant's k3-tiny rows
#   .triton-cache-parts/*.tgz   optional: an earlier call's $OUT/fla-autotune.tgz (fla-core 0.6.0's results for the
#               four table shapes already ship as benchmarks/fla_autotune_h200.tgz)
#
# A refactor's serving figures beside an older commit's, in one call: K3_BASELINE=DIR (or `serve --baseline DIR`)
# runs the same serve benchmark from the checkout DIR first, with DIR installed as k3 (pip install -e DIR), then
# from this tree, and prints both tables. Make DIR here and carry it, e.g.
#   mkdir -p runs/base && git archive OLD_COMMIT | tar -x -C runs/base && echo OLD_COMMIT > runs/base/COMMIT
#   K3_BASELINE=runs/base bash benchmarks/gpu.sh serve          (carry runs: it holds runs/tiny too)
# K3_BASELINE may also name a commit when the tree has its .git. SERVE_PARTS picks the parts: "small" (the k3-small
# rows), "anchors" (the HF anchors, added to this tree's k3-small run only: they run no k3 code), "tiny" (the k3-tiny
# rows). Default "small anchors tiny"; with a baseline "small", so that both trees fit one call (SERVE_PARTS=tiny in
# a second call compares the k3-tiny rows). SERVE_PAIRS=N alternates N baseline / current pairs; SERVE_PROMPTS=N
# sends N requests per stream (serve.py's default, 2, is ~1.5 s of work at 32 streams: too short to separate a few
# percent; 8 is ~6 s).
#
# Environment: OUT (logs; default /tmp/k3out; on the device machine $OUT is what comes back), KDA_TEST_LIMIT
# (seconds for the kernel tests, default 300), K3_BASELINE, SERVE_PARTS, SERVE_PAIRS, SERVE_PROMPTS, SERVE_CONCURRENCY,
# TRAIN_PARTS, QUANT_PARTS, PRETRAIN_GRAPH (train.cuda_graph values of the pretrain part, default "false true"),
# LONG_ROWS (the long part's rows as T_checkpointing, e.g. "4096_none 131072_all"; default every row).
# Each step runs
# under its own `timeout`
# (rc 124: it ran past its limit) with its output in a log in $OUT; the step's table or test summary is printed after
# it, and a summary of every step (rc, seconds, log) comes last ($OUT/summary.txt).
set -o pipefail
cd "$(dirname "$0")/.." || exit 2
ROOT=$PWD
MODE=${1:-}
[ $# -gt 0 ] && shift
while [ $# -gt 0 ]; do
  case $1 in
    --baseline) K3_BASELINE=${2:?--baseline needs a directory or a commit}; shift 2 ;;
    --baseline=*) K3_BASELINE=${1#*=}; shift ;;
    *) echo "gpu.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
case $MODE in
  kernels | kda | train | serve | quant | all) ;;
  *) echo "usage: bash benchmarks/gpu.sh kernels|kda|train|serve|quant|all   (serve [--baseline DIR|COMMIT])" >&2
     exit 2 ;;
esac

export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/k3out}
mkdir -p "$OUT" && OUT=$(cd "$OUT" && pwd)
SUMMARY=$OUT/summary.txt
: > "$SUMMARY"
# Triton's cache in the repo: compiled kernels and, with fla's FLA_CACHE_RESULTS default, fla's autotuning results.
# benchmarks/fla_autotune_h200.tgz holds fla-core 0.6.0's results for kda.py's four shapes on the H200 (triton
# 3.6.0, torch 2.11); with them fla skips a ~5-minute first autotuning on a fresh machine. Their keys hash fla's
# kernel source and Triton's version: another version ignores them.
export TRITON_CACHE_DIR="$ROOT/.triton-cache"
mkdir -p "$TRITON_CACHE_DIR"
for f in benchmarks/fla_autotune_h200.tgz .triton-cache-parts/*.tgz; do
  [ -f "$f" ] && tar xzf "$f" -C "$TRITON_CACHE_DIR"
done
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
# install_tree DIR: k3 from the checkout DIR (editable; the serving benchmark's `k3 serve` subprocess imports it too)
install_tree() { python3 -m pip install -q --no-deps --no-build-isolation --no-index -e "$1" >/dev/null 2>&1; }
k3_from() { python3 -c "import os, k3.model as m; print(os.path.dirname(os.path.dirname(os.path.abspath(m.__file__))))"; }
commit_of() {  # DIR's commit: its own checkout's HEAD, or the COMMIT file of an unpacked `git archive`
  local c top
  top=$(git -C "$1" rev-parse --show-toplevel 2>/dev/null)
  if [ "$top" != "$(cd "$1" && pwd -P)" ]; then
    if [ -f "$1/COMMIT" ]; then cat "$1/COMMIT"; else echo "not a checkout (no COMMIT file)"; fi
    return
  fi
  c=$(git -C "$1" rev-parse --short HEAD)
  git -C "$1" status --porcelain 2>/dev/null | grep -q . && c="$c + uncommitted changes"
  echo "$c"
}
install_tree "$ROOT" || echo "pip install -e . failed"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader | tee "$OUT/gpu.txt"
echo "mode $MODE; this tree: $ROOT ($(commit_of "$ROOT")); k3 from $(k3_from)"

# step LABEL LIMIT LOG CMD...: CMD under `timeout LIMIT` (SIGINT first, so that pytest prints its summary and a
# benchmark stops its server; SIGKILL 10 s later), stdout and stderr in $OUT/LOG; one line in $SUMMARY
step() {
  local label=$1 limit=$2 log=$OUT/$3 t0=$SECONDS rc
  shift 3
  echo "== $label (limit $limit s, $(basename "$log"))"
  timeout -s INT -k 10 "$limit" "$@" > "$log" 2>&1
  rc=$?
  printf '%-44s rc=%-4s %4s s  %s\n' "$label" "$rc" $((SECONDS - t0)) "$(basename "$log")" >> "$SUMMARY"
  return $rc
}
has_part() { case " $1 " in *" $2 "*) return 0 ;; esac; return 1; }
tests_summary() { grep -E "^FAILED|^ERROR|passed|failed|no tests ran" "$1" | tail -12; }
# the tables and notes a benchmark prints: markdown rows, and serve.py's plain table (header, rule, numeric rows)
tables() { grep -E "^\||^#|^\(|^ conc |^---|^ +[0-9]+ +[0-9]+ " "$1"; }
clean_tail() { grep -v -i "warn" "$1" | tail -"${2:-30}"; }
existing() { for f in "$@"; do [ -e "$f" ] && echo "$f"; done; }
# a benchmark script by name, in benchmarks/ or benchmarks/repro/
bench() { for d in benchmarks benchmarks/repro; do [ -f "$d/$1" ] && { echo "$d/$1"; return; }; done; echo "benchmarks/$1"; }

# the training step's fused kernels (short conv, gated norm, AttnRes mixture) and the MoE / Muon CUDA checks
FUSED_TESTS=(tests/kernels/test_conv_triton.py tests/kernels/test_gated_norm_triton.py
  tests/kernels/test_conv_norm_kda_layer.py tests/kernels/test_attnres_triton.py tests/kernels/test_attnres_model.py
  tests/kernels/test_mla_max_logit.py tests/kernels/test_linear_ce_triton.py tests/kernels/test_linear_ce.py
  tests/kernels/test_glu_triton.py tests/kernels/test_moe_combine_triton.py tests/model/test_moe.py)
KERNEL_TESTS=(tests/kernels/test_kda_triton.py tests/kernels/test_kda_bwd_kblocks.py tests/kernels/test_kda_saved.py
  tests/kernels/test_kda_gate_triton.py tests/kernels/test_kda_fused_output.py
  tests/kernels/test_kda_recurrent_compile.py tests/kernels/test_kda_segments.py tests/kernels/test_mla_decode.py
  tests/kernels/test_glu_triton.py tests/kernels/test_router_triton.py tests/kernels/test_triton_end_to_end.py
  "${FUSED_TESTS[@]}")

mode_kernels() {
  # the CUDA tests outside tests/kernels (the serving ones need the serving wheels, test_server.py the openai
  # client), 3 processes, beside the kernel tests, 8 processes
  step "CUDA tests outside tests/kernels" 300 serve_tests.log env K3_KERNELS=triton python3 -m pytest tests/serve \
    tests/model tests/train -k cuda -p no:cacheprovider -rfs -n 3 &
  local others=$!
  # shellcheck disable=SC2046  # one word per test file
  step "GPU kernel tests" "${KDA_TEST_LIMIT:-300}" kernel_tests.log python3 -m pytest $(existing "${KERNEL_TESTS[@]}") \
    -p no:cacheprovider -rf -n 8
  tests_summary "$OUT/kernel_tests.log"
  wait "$others"
  echo "-- CUDA tests outside tests/kernels:"; tests_summary "$OUT/serve_tests.log"
  step "every sm_90 compile variant (-m slow_compile)" 200 slow_compile.log python3 -m pytest -m slow_compile \
    tests/kernels -p no:cacheprovider -rf -n 8
  tests_summary "$OUT/slow_compile.log"
  step "paged MLA decode (mla_decode.py)" 90 mla_decode.log python3 "$(bench mla_decode.py)"
  tables "$OUT/mla_decode.log"
  step "KDA kernels at their launch (kda_tune.py)" 90 kda_tune.log python3 "$(bench kda_tune.py)" --defaults --iters 3
  tables "$OUT/kda_tune.log"
}

mode_kda() {
  step "KDA table against fla (kda.py)" 300 kda.log python3 "$(bench kda.py)"
  tables "$OUT/kda.log"
  step "KDA, the model's call (gate in kernel)" 100 kda_gate.log python3 "$(bench kda.py)" --only 8,4096,16,128 \
    --no-decode --gate-in-kernel
  tables "$OUT/kda_gate.log"
  (cd "$TRITON_CACHE_DIR" && find . -name '*.autotune.json' | tar czf "$OUT/fla-autotune.tgz" -T -)
}

# train_long: k3-small fwd + bwd at 4K to 128K tokens per sequence, one process per row ("B T checkpointing anchor"),
# the head and CE in 8K-token chunks (a 128K x vocab fp32 logits tensor alone would not fit); the dense anchor beside
# it where it fits
train_long() {
  local spec b t ac an rc log
  # B T checkpointing anchor KDA-recompute (K3_KDA_RECOMPUTE: the KDA backward recomputes its chunk states)
  for spec in "4 4096 none anchor 0" "4 4096 all - 0" "1 16384 none anchor 0" "1 32768 none anchor 0" \
      "1 65536 all - 1" "1 131072 all - 1"; do
    read -r b t ac an rc <<< "$spec"
    [ -n "${LONG_ROWS:-}" ] && ! has_part "$LONG_ROWS" "${t}_$ac" && continue
    log=long_${t}_${ac}.log
    # shellcheck disable=SC2046  # --no-anchor or nothing
    step "k3-small B=$b T=$t checkpointing $ac" 150 "$log" env K3_KDA_RECOMPUTE="$rc" python3 benchmarks/model.py \
      --model k3-small --device cuda \
      --batch "$b" --seq "$t" --steps 2 --warmup 1 --activation-checkpointing "$ac" --loss-chunk 8192 \
      $([ "$an" = anchor ] || echo --no-anchor)
    grep -E "^fwd\+bwd|^dense anchor|^k3-small|OutOfMemory|out of memory" "$OUT/$log" | tail -4
  done
}

# train_pretrain: `k3 pretrain --preset small` (4 x 4096 x 2 accumulation, Muon, 30 steps, no evaluation or
# checkpoints until the end), eager then with train.cuda_graph=true, and the CUDA-graph tests first; the logged
# tokens/s of steps 11-20 and 21-30 (steps 1-10 hold the warm-up, and the graph's eager first step and capture)
train_pretrain() {
  local g
  step "train.cuda_graph tests" 120 cuda_graph_tests.log python3 -m pytest tests/train/test_cuda_graph.py \
    -p no:cacheprovider -rfs -W ignore::UserWarning
  tests_summary "$OUT/cuda_graph_tests.log"
  for g in ${PRETRAIN_GRAPH:-false true}; do
    rm -rf "/tmp/k3-small-$g"
    step "k3 pretrain --preset small, cuda_graph=$g" 150 "pretrain_small_$g.log" k3 pretrain --preset small \
      --out "/tmp/k3-small-$g" --set train.max_steps=30 --set train.eval_every=0 --set ckpt.every=0 \
      --set data.tokenizer_sample_bytes=5000000 --set train.cuda_graph=$g
    grep -E '"step": (10|20|30),' "/tmp/k3-small-$g/metrics.jsonl" | cut -c1-160
    grep -E "Error|done step" "$OUT/pretrain_small_$g.log" | tail -3
  done
}

# TRAIN_PARTS picks the parts: "step" (dense anchor vs k3-small at 4 x 4096 and 1 x 32768), "graph" (the same two
# with each model's whole step in one CUDA graph: the device's time without the host's launches), "compile" (the
# 4K step with both models under torch.compile), "breakdown" (the profiled step by kernel category), "ops" (the
# 4K step profiled by forward module, backward node and aten op with shapes: model.py --profile-ops), "tune" (the
# glue kernels' launch search, glue_tune.py), "fusedtests" (the fused kernels' GPU tests alone), "long"
# (train_long), "fused" (the fused kernels' tests and micro-benchmarks), "pretrain" (train_pretrain). Default
# "step breakdown".
mode_train() {
  local parts=${TRAIN_PARTS:-step breakdown}
  local flags tag
  for tag in step graph compile; do
    has_part "$parts" $tag || continue
    flags=$( [ $tag = graph ] && echo --cuda-graph; [ $tag = compile ] && echo --compile )
    # shellcheck disable=SC2086  # flags: zero or one word
    step "training step ($tag): dense anchor vs k3-small, 4K" 300 model_$tag.log python3 benchmarks/model.py \
      --model k3-small --device cuda --batch 4 --seq 4096 --steps 4 --warmup 2 $flags
    clean_tail "$OUT/model_$tag.log" 6
    [ $tag = compile ] && continue
    # shellcheck disable=SC2086
    step "training step ($tag): dense anchor vs k3-small, 32K" 200 model_${tag}_32k.log python3 benchmarks/model.py \
      --model k3-small --device cuda --batch 1 --seq 32768 --steps 2 --warmup 1 --loss-chunk 8192 $flags
    clean_tail "$OUT/model_${tag}_32k.log" 6
  done
  if has_part "$parts" ops; then
    step "training step by module and op" 200 ops.log python3 benchmarks/model.py --model k3-small --device cuda \
      --batch 4 --seq 4096 --steps 2 --warmup 2 --no-anchor --profile-ops 45
    clean_tail "$OUT/ops.log" 120
  fi
  if has_part "$parts" breakdown; then
    step "training step by kernel category" 200 breakdown.log python3 benchmarks/model_breakdown.py --model k3-small \
      --device cuda --batch 4 --seq 4096 --profile-step
    clean_tail "$OUT/breakdown.log" 45
  fi
  if has_part "$parts" fused; then
    # shellcheck disable=SC2046  # one word per test file
    step "fused training kernels' tests" 150 fused_tests.log env K3_KERNELS=triton python3 -m pytest \
      $(existing "${FUSED_TESTS[@]}" tests/model/test_moe.py tests/train/test_optim.py) -p no:cacheprovider -rfs -n 4
    tests_summary "$OUT/fused_tests.log"
    step "AttnRes mixture (attnres.py)" 90 attnres.log python3 benchmarks/attnres.py
    tables "$OUT/attnres.log"
    step "KDA glue (kda_glue.py)" 60 kda_glue.log python3 benchmarks/kda_glue.py --device cuda
    tables "$OUT/kda_glue.log"
    step "LatentMoE and Muon (moe_step.py)" 90 moe_step.log python3 benchmarks/moe_step.py --device cuda
    tables "$OUT/moe_step.log"
    step "QK-Clip's max logit (mla_max_logit.py)" 60 mla_max_logit.log python3 benchmarks/mla_max_logit.py
    clean_tail "$OUT/mla_max_logit.log" 5
  fi
  if has_part "$parts" tune; then
    step "glue kernels' launch search (glue_tune.py)" 300 glue_tune.log python3 benchmarks/glue_tune.py
    tables "$OUT/glue_tune.log"
  fi
  if has_part "$parts" fusedtests; then
    # shellcheck disable=SC2046  # one word per test file
    step "fused training kernels' tests" 150 fused_tests.log env K3_KERNELS=triton python3 -m pytest \
      $(existing "${FUSED_TESTS[@]}") -p no:cacheprovider -rfs -n 4
    tests_summary "$OUT/fused_tests.log"
  fi
  has_part "$parts" long && train_long
  has_part "$parts" pretrain && train_pretrain
  return 0
}

# serve_small TREE TAG LIMIT [serve.py flags]: the compiled k3-small server, from TREE's benchmarks/serve.py
# (SERVE_PROMPTS: requests per stream at each concurrency level, default serve.py's 2; SERVE_CONCURRENCY: the
# levels, default "1 32")
serve_small() {
  local tree=$1 tag=$2 limit=$3
  shift 3
  (cd "$tree" && step "serve k3-small ($tag)" "$limit" "serve_small_$tag.log" python3 benchmarks/serve.py \
    --model k3-small --subprocess --device cuda --dtype bfloat16 --compile-decode --cuda-graph-batches 1 32 \
    --concurrency ${SERVE_CONCURRENCY:-1 32} --input-len 128 --output-len 128 --prefix-len 0 \
    ${SERVE_PROMPTS:+--prompts-per-stream "$SERVE_PROMPTS"} "$@")
  echo "-- k3-small, $tag:"; clean_tail "$OUT/serve_small_$tag.log" 30
}

# serve_tiny TREE TAG LIMIT: the trained k3-tiny (prefix hit at 2,048 tokens, speculative k = 2); server logs kept
# A baseline tree may hold its own runs/tiny/final (the same weights, config.json in that commit's format: an older
# k3 refuses keys added since); the tree serves that copy, else this tree's.
serve_tiny() {
  local tree=$1 tag=$2 limit=$3 i=0 f ckpt=$ROOT/runs/tiny/final
  [ -f "$tree/runs/tiny/final/config.json" ] && ckpt=$(cd "$tree/runs/tiny/final" && pwd)
  if [ ! -f "$ckpt/config.json" ]; then
    echo "no runs/tiny/final here: carry runs/tiny for the k3-tiny rows"; return 1
  fi
  rm -f /tmp/*.k3serve.log
  (cd "$tree" && step "serve trained k3-tiny ($tag)" "$limit" "serve_tiny_$tag.log" python3 benchmarks/serve.py \
    --ckpt "$ckpt" --subprocess --device cuda --concurrency 1 --input-len 128 --output-len 128 \
    --prefix-len 2048 --speculative-tokens 2)
  echo "-- trained k3-tiny, $tag:"; clean_tail "$OUT/serve_tiny_$tag.log" 16
  for f in /tmp/*.k3serve.log; do [ -f "$f" ] && cp "$f" "$OUT/server_tiny_${tag}_$i.log"; i=$((i + 1)); done
}

# the baseline checkout's directory: K3_BASELINE itself, or that commit of this checkout unpacked into /tmp
baseline_tree() {
  local b=$K3_BASELINE dir=/tmp/k3-baseline
  if [ -d "$b" ]; then
    (cd "$b" && pwd)
  elif git -C "$ROOT" rev-parse -q --verify "$b^{commit}" >/dev/null 2>&1; then
    rm -rf "$dir" && mkdir -p "$dir" && git -C "$ROOT" archive "$b" | tar -x -C "$dir" \
      && git -C "$ROOT" rev-parse --short "$b" > "$dir/COMMIT" && echo "$dir"
  else
    echo "K3_BASELINE=$b: neither a directory nor a commit of this checkout" >&2
    return 1
  fi
}

mode_serve() {
  local parts base tag tree
  if [ -z "${K3_BASELINE:-}" ]; then
    parts=${SERVE_PARTS:-small anchors tiny}
    if has_part "$parts" anchors; then
      serve_small "$ROOT" current 380 --hf-anchor --hf-batch 1 32
    elif has_part "$parts" small; then
      serve_small "$ROOT" current 250
    fi
    has_part "$parts" tiny && serve_tiny "$ROOT" current 170
    return 0
  fi
  parts=${SERVE_PARTS:-small}
  base=$(baseline_tree) || return 1
  if [ ! -f "$base/benchmarks/serve.py" ]; then echo "$base has no benchmarks/serve.py" >&2; return 1; fi
  echo "baseline: $base ($(commit_of "$base")), then this tree ($(commit_of "$ROOT")); parts: $parts"
  # SERVE_PAIRS=N: N alternating baseline / current runs (baseline, current, baseline, ...), so that a drift of the
  # machine over the call lands on both trees; the k-th pair's logs are tagged baseline<k> / current<k> after the first
  local pairs=${SERVE_PAIRS:-1} k order=()
  for k in $(seq 1 "$pairs"); do
    if [ "$k" = 1 ]; then order+=(baseline current); else order+=("baseline$k" "current$k"); fi
  done
  for tag in "${order[@]}"; do
    if [ "${tag#baseline}" != "$tag" ]; then tree=$base; else tree=$ROOT; fi
    install_tree "$tree" || { echo "pip install -e $tree failed" >&2; install_tree "$ROOT"; return 1; }
    echo "== k3 from $(k3_from) ($tag)"
    # the anchors run no k3 code: with a baseline they run once, from this tree
    if has_part "$parts" small && has_part "$parts" anchors && [ "$tag" = current ]; then
      serve_small "$tree" "$tag" 380 --hf-anchor --hf-batch 1 32
    elif has_part "$parts" small; then
      serve_small "$tree" "$tag" 250
    fi
    has_part "$parts" tiny && serve_tiny "$tree" "$tag" 170
  done
  # output tok/s of this tree over the baseline's, per pair and concurrency (serve.py's rows: conc, req, out tok/s)
  echo; echo "== current / baseline output tok/s, per pair and concurrency"
  for k in $(seq 1 "$pairs"); do
    local sfx=""; [ "$k" = 1 ] || sfx=$k
    [ -f "$OUT/serve_small_baseline$sfx.log" ] && [ -f "$OUT/serve_small_current$sfx.log" ] || continue
    awk -v k="$k" '/^ +[0-9]+ +[0-9]+ +[0-9.]+ /{ if (FNR == NR) b[$1] = $3; else if ($1 in b)
      printf "pair %s, concurrency %s: %.1f / %.1f tok/s = %.3f\n", k, $1, $3, b[$1], $3 / b[$1] }' \
      "$OUT/serve_small_baseline$sfx.log" "$OUT/serve_small_current$sfx.log"
  done
  echo; echo "== serving tables, baseline ($(commit_of "$base")) then this tree ($(commit_of "$ROOT"))"
  for f in serve_small serve_tiny; do
    for tag in "${order[@]}"; do
      [ -f "$OUT/${f}_$tag.log" ] && { echo "-- ${f#serve_}, $tag:"; tables "$OUT/${f}_$tag.log"; }
    done
  done
}

mode_quant() {
  local q=/tmp/k3-quant ck tag parts=${QUANT_PARTS:-kernels small}
  if [ ! -f runs/tiny/final/config.json ]; then echo "no runs/tiny/final here: carry runs/tiny for the rows"; return 1; fi
  rm -rf "$q"
  if [[ " $parts " == *" tune "* ]]; then
    step "int4 GEMM launch search (quant_tune.py)" 330 quant_tune.log python3 "$(bench quant_tune.py)"
    grep -E "^#|^\|" "$OUT/quant_tune.log"
  fi
  if [[ " $parts " == *" kernels "* ]]; then
    # shellcheck disable=SC2046  # one word per test file
    step "quantized checkpoint tests" 120 quant_tests.log env K3_KERNELS=triton python3 -m pytest \
      $(existing tests/kernels/test_quant.py tests/kernels/test_quant_triton.py tests/kernels/test_quant_fake.py \
        tests/model/test_quant_checkpoint.py tests/model/test_qat.py tests/serve/test_quantized_serve.py) \
      -p no:cacheprovider -rfs -n 4
    tests_summary "$OUT/quant_tests.log"
    step "int4 GEMMs (quant.py)" 150 quant_bench.log python3 "$(bench quant.py)"
    tables "$OUT/quant_bench.log"
  fi
  if [[ " $parts " == *" small "* ]]; then
    step "k3-small releases: bf16, w4a8, all_linear w4a16" 90 quant_export.log python3 "$(bench quant.py)" \
      --export "$q/small" --tokenizer runs/tiny/final --preset k3-small
    cat "$OUT/quant_export.log"
    for ck in "$q/small/bf16" "$q/small/w4a8" "$q/small/w4a16-all"; do
      [ -d "$ck" ] || continue
      tag=small-$(basename "$ck")
      step "serve $tag" 100 "serve_quant_$tag.log" python3 benchmarks/serve.py --ckpt "$ck" --subprocess \
        --device cuda --concurrency 1 32 --input-len 128 --output-len 128 --prefix-len 0
      echo "-- $tag:"; clean_tail "$OUT/serve_quant_$tag.log" 12
    done
  fi
  [[ " $parts " == *" tiny "* ]] || return 0
  step "quantize k3-tiny (w4a8, w8a16)" 60 quantize.log python3 -c "from k3.train.quantize import quantize_release
for fmt in ('w4a8', 'w8a16'):
    print(quantize_release('runs/tiny/final', '$q/tiny-' + fmt, fmt=fmt, group_size=32))"
  cat "$OUT/quantize.log"
  for ck in runs/tiny/final "$q/tiny-w4a8" "$q/tiny-w8a16"; do
    [ -d "$ck" ] || continue
    tag=$(basename "$ck"); [ "$tag" = final ] && tag=tiny
    step "serve $tag" 120 "serve_quant_$tag.log" python3 benchmarks/serve.py --ckpt "$ck" --subprocess \
      --device cuda --concurrency 1 8 --input-len 128 --output-len 128 --prefix-len 0
    echo "-- $tag:"; clean_tail "$OUT/serve_quant_$tag.log" 12
  done
}

case $MODE in
  all) for m in kernels kda train serve quant; do echo "=== mode $m"; "mode_$m"; done ;;
  *) "mode_$MODE" ;;
esac
echo
echo "== summary: mode $MODE, tree $(commit_of "$ROOT"), logs in $OUT"
cat "$SUMMARY"
