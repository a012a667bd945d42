#!/usr/bin/env bash
# Single-stream decode of the 8B shape at long contexts, in-process,
# mlx-lm's generate_step against pippin with the split paged kernel (flash-decoding) and
# without it (PIPPIN_PAGED_SPLIT=0: the gather path, as before), in turns in one process.
# Usage: bash bench/gpu/long_session.sh [CONTEXT ...]   (default: 16384 65536)
# Results in $OUT/long-CONTEXT.txt. Env: GEN (tokens per run, default 128), REPEAT (2),
# ENGINES (single_stream.py --engines).
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-.tmp/gpu}
ROOT=/tmp/pippin-gpu-models
mkdir -p "$OUT"
source bench/gpu/bench_lib.sh
build llama-3.1-8b
ctxs=("$@"); [ ${#ctxs[@]} -eq 0 ] && ctxs=(16384 65536)
for ctx in "${ctxs[@]}"; do
  python3 bench/gpu/single_stream.py "$ROOT/llama-3.1-8b" --prompt "$ctx" --gen "${GEN:-128}" \
    --repeat "${REPEAT:-2}" --engines "${ENGINES:-mlx_lm,pippin,pippin:PIPPIN_PAGED_SPLIT=0}" 2>&1 \
    | grep -v WARNING | tee "$OUT/long-$ctx.txt"
done
