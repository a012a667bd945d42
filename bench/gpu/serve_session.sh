#!/usr/bin/env bash
# pippin against mlx_lm.server over HTTP with the real Llama 3 tokenizer, in steps that fit
# a device call. Usage: bash bench/gpu/serve_session.sh STEP [STEP ...]
#   tests  the split kernels' CUDA tests (paged and fused attention)
#   1b     Llama-3.2-1B shape, pippin and mlx_lm.server at 1 and 256 streams (512 prompt,
#          256 out); then its single stream in-process against mlx-lm
#   8b     Llama-3.1-8B shape, pippin and mlx_lm.server at 64 and 256 streams
#   ttft   8 concurrent 16k-token prompts on the 8B shape, pippin and mlx_lm.server
#   swing  the 1B shape at 64 streams, three repetitions of 128 requests, pippin as it is
#          against pippin with MLX_CUDA_GRAPH_CACHE_SIZE=4000 and with its decode step's
#          shapes traced before serving (PIPPIN_WARM_DECODE=1024): tests of two causes of the
#          2x swings seen there (MLX keeps 400 CUDA graphs by default; prompt chunks of
#          many lengths may evict the decode steps' graphs, which are then built again; and
#          the decode step traced for new shapes mid-serving: the table's `decode traces`
#          column gives how many in those windows and the seconds they took)
# Results (tables, JSON, logs) in $OUT; server logs' tails in $OUT/server-logs.txt.
# Env: as bench/gpu/bench_lib.sh (SECS, ...).
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-.tmp/gpu}
ROOT=/tmp/pippin-gpu-models
mkdir -p "$OUT"
source bench/gpu/bench_lib.sh
M1=random:llama-3.2-1b
M8=random:llama-3.1-8b

for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    tests)
      python3 -m pytest -q -p no:cacheprovider -m cuda tests/kernels/test_paged_attention.py \
        tests/kernels/test_fused_attention.py -k split 2>&1 | tail -5 | tee "$OUT/split-tests.txt" ;;
    1b)
      build llama-3.2-1b
      OUTPUT_TOKENS=256 bench http-1b "1 256" 16000 "pippin=pippin:$M1" "mlx_lm=mlx_lm:$M1"
      python3 bench/gpu/single_stream.py "$ROOT/llama-3.2-1b" --prompt 512 --gen 256 \
        --repeat 3 --engines mlx_lm,pippin 2>&1 | grep -v WARNING | tee "$OUT/single-1b.txt" ;;
    8b)
      build llama-3.1-8b
      # 20 GB of KV beside 16 GB of weights fits an H100 (40 GB ran it out of memory there).
      OUTPUT_TOKENS=256 SECS=${SECS:-400} bench http-8b "64 256" "${KV_8B:-20000}" "pippin=pippin:$M8" \
        "mlx_lm=mlx_lm:$M8" ;;
    ttft)
      build llama-3.1-8b
      WORKLOAD=long-context OUTPUT_TOKENS=32 MAX_LEN=20480 bench ttft-8b 8 24000 \
        "pippin=pippin:$M8" "mlx_lm=mlx_lm:$M8" ;;
    swing)
      build llama-3.2-1b
      OUTPUT_TOKENS=256 PER_CLIENT=2 BENCH_ARGS="--repetitions 3" SECS=${SECS:-450} \
        bench swing-1b 64 16000 "pippin=pippin:$M1" \
        "MLX_CUDA_GRAPH_CACHE_SIZE=4000 graphs4k=pippin:$M1" \
        "PIPPIN_WARM_DECODE=1024 warm=pippin:$M1" ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done $(date -u +%T)"
