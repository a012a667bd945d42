#!/usr/bin/env bash
# Issue 29 in one device call: the models built side by side, the split paged kernel's CUDA
# tests, long-context single-stream decode (goal 3) and the MoE shape (goal 6). Everything
# lands in $OUT/issue29.tgz (a call returns at most 8 files). The quantised runs (goal 4)
# are `quant_session.sh low-4bit` in a second call.
# Env: TOTAL (seconds for everything, default 550).
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-.tmp/gpu}
R=$OUT/r
ROOT=/tmp/pippin-gpu-models
mkdir -p "$R" "$ROOT"
END=$((SECONDS + ${TOTAL:-550}))
left() { local l=$((END - SECONDS)); ((l < $1)) && echo $((l > 1 ? l : 1)) || echo "$1"; }
echo "=== build $(date -u +%T)"
for m in llama-3.1-8b llama-3.1-8b-4bit qwen3-30b-a3b-4bit; do
  timeout "$(left 240)" python3 -c "
import time
from pathlib import Path
from pippin.bench.models import build_model
t = time.perf_counter(); build_model('$m', Path('$ROOT'))
print('$m built in', round(time.perf_counter() - t), 's', flush=True)" >"$R/build-$m.log" 2>&1 &
done
wait
tail -n1 "$R"/build-*.log
echo "=== split tests $(date -u +%T)"
timeout "$(left 90)" python3 -m pytest -q -p no:cacheprovider -m cuda \
  tests/kernels/test_paged_attention.py -k split 2>&1 | tail -3 | tee "$R/split-tests.txt"
echo "=== long $(date -u +%T)"
OUT=$R ENGINES=${ENGINES:-mlx_lm,pippin} timeout "$(left 170)" bash bench/gpu/long_session.sh 16384 65536
echo "=== moe $(date -u +%T)"
OUT=$R TOTAL=$(left 260) bash bench/gpu/moe_session.sh qwen3-30b-a3b-4bit 2>&1 | tail -30
echo "=== done $(date -u +%T)"
tar czf "$OUT/issue29.tgz" -C "$R" . && rm -rf "$R"
