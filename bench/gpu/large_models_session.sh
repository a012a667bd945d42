#!/usr/bin/env bash
# The large shapes in one device call: the 8B (bf16 and 4-bit) and the Qwen3-30B-A3B
# mixture-of-experts models built side by side, the split paged kernel's CUDA tests,
# long-context single-stream decode (long_session.sh) and the mixture-of-experts shape
# against mlx_lm.server (moe_session.sh). Everything lands in $OUT/large-models.tgz (a call
# returns at most 8 files). The quantised runs are `quant_session.sh low-4bit` in a second
# call. Env: TOTAL (seconds for everything, default 550).
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-.tmp/gpu}
R=$OUT/r
ROOT=/tmp/pippin-gpu-models
mkdir -p "$R" "$ROOT"
END=$((SECONDS + ${TOTAL:-550}))
left() { local l=$((END - SECONDS)); ((l < $1)) && echo $((l > 1 ? l : 1)) || echo "$1"; }
echo "=== build $(date -u +%T)"
ROOT=$ROOT timeout "$(left 240)" bash -c 'source bench/gpu/bench_lib.sh && build "$@"' _ \
  llama-3.1-8b llama-3.1-8b-4bit qwen3-30b-a3b-4bit 2>&1 | grep "built in" | tee "$R/build.log"
echo "=== split tests $(date -u +%T)"
timeout "$(left 90)" python3 -m pytest -q -p no:cacheprovider -m cuda \
  tests/kernels/test_paged_attention.py -k split 2>&1 | tail -3 | tee "$R/split-tests.txt"
echo "=== long $(date -u +%T)"
OUT=$R ENGINES=${ENGINES:-mlx_lm,pippin} timeout "$(left 170)" bash bench/gpu/long_session.sh 16384 65536
echo "=== moe $(date -u +%T)"
OUT=$R TOTAL=$(left 260) bash bench/gpu/moe_session.sh qwen3-30b-a3b-4bit 2>&1 | tail -30
echo "=== done $(date -u +%T)"
tar czf "$OUT/large-models.tgz" -C "$R" . && rm -rf "$R"
