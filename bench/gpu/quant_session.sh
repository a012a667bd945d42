#!/usr/bin/env bash
# Quantised 8B-shape models on the GPU, in steps that fit a device call.
# Usage: bash bench/gpu/quant_session.sh STEP [STEP ...]
#   probe     the `cuda` test of kernels/dense_quant, the matmul probe (quant_matmul.py),
#             and the random-weight 8B models built (bf16, 4-bit, 8-bit, real tokenizer)
#   low-4bit  pippin bench at 1 and 64 streams: pippin bf16, pippin 4-bit with the dense
#             prompt-chunk path off (before) and on (after), mlx_lm.server 4-bit
#   low-8bit  the same for 8-bit
#   high      pippin bench at 256 streams: pippin bf16, 4-bit, 8-bit
# Results (tables, JSON, logs) in $OUT; server logs' tails in $OUT/server-logs.txt.
# Env: SECS (each bench's limit, default 280), ROWS (PIPPIN_DENSE_QUANT_ROWS; unset: the
# crossing `probe` measured, else the default).
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-.tmp/gpu}
ROOT=/tmp/pippin-gpu-models
mkdir -p "$OUT"
[ -n "${ROWS:-}" ] && export PIPPIN_DENSE_QUANT_ROWS=$ROWS
# Off by default until measured: the "after" runs turn it on (the "before" ones set 0).
export PIPPIN_DENSE_QUANT=${PIPPIN_DENSE_QUANT:-auto}
M8=random:llama-3.1-8b

source bench/gpu/bench_lib.sh

for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    probe)
      python3 -m pytest -q -p no:cacheprovider tests/kernels/test_dense_quant.py 2>&1 | tail -3
      python3 bench/gpu/quant_matmul.py --out "$OUT/quant_matmul.json" | tee /tmp/qmm.log
      # Unless ROWS is given, later steps take the 4-bit crossing measured here.
      r=$(grep -o 'CROSSING bits=4 rows=[0-9]*' /tmp/qmm.log | grep -o '[0-9]*$')
      [ -z "${ROWS:-}" ] && [ -n "$r" ] && export PIPPIN_DENSE_QUANT_ROWS=$r
      echo "PIPPIN_DENSE_QUANT_ROWS=${PIPPIN_DENSE_QUANT_ROWS:-default}"
      build llama-3.1-8b llama-3.1-8b-4bit llama-3.1-8b-8bit
      df -h /tmp | tail -1 ;;
    low-4bit | low-8bit)
      b=${step#low-}
      bench "$step" "1 64" 8000 "bf16=pippin:$M8" "PIPPIN_DENSE_QUANT=0 $b-before=pippin:$M8-$b" \
        "$b=pippin:$M8-$b" "mlx_lm-$b=mlx_lm:$M8-$b" ;;
    high)
      bench high 256 24000 "bf16=pippin:$M8" "4bit=pippin:$M8-4bit" "8bit=pippin:$M8-8bit" ;;
  esac
done
echo "=== done $(date -u +%T)"
