#!/usr/bin/env bash
# pippin's W4A16/W8A16 tensor-core kernel (kernels/quant_matmul.py) on the GPU, in steps
# that fit a device call. Usage: bash bench/gpu/w4_session.sh STEP [STEP ...]
#   tests   the kernel's `cuda` tests and the dense path's
#   probe   quant_matmul.py on each projection of the 8B shape (fused q/k/v, o, fused
#           gate/up, down): MLX's quantised matmul, the kernel, dequantise + dense, bf16
#   build   the random-weight 8B models (bf16, 4-bit, 8-bit) with the real Llama 3 tokenizer
#   single  in-process single stream, mlx-lm against pippin (4-bit, 8-bit, bf16)
#   low     pippin bench at 1, 16 and 64 streams: bf16, 4-bit with the kernel off (before)
#           and on (after), 8-bit on
#   high    pippin bench at 256 streams: bf16, 4-bit
# Results in $OUT (tables, JSON, logs).
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-.tmp/gpu}
ROOT=/tmp/pippin-gpu-models
mkdir -p "$OUT"
export PIPPIN_DENSE_QUANT=${PIPPIN_DENSE_QUANT:-auto}
M8=random:llama-3.1-8b

source bench/gpu/bench_lib.sh

for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    tests)
      python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_quant_matmul.py \
        tests/kernels/test_dense_quant.py 2>&1 | tail -15 ;;
    probe)
      for nk in 6144,4096 4096,4096 28672,4096 4096,14336; do
        python3 bench/gpu/quant_matmul.py --n "${nk%,*}" --k "${nk#*,}" --reps 10 \
          --rows 1,2,4,8,16,32,64,128,256,512 --out "$OUT/qmm-${nk/,/x}.json"
      done ;;
    build)
      build llama-3.1-8b llama-3.1-8b-4bit llama-3.1-8b-8bit
      df -h /tmp | tail -1 ;;
    single)
      for m in llama-3.1-8b-4bit llama-3.1-8b-8bit llama-3.1-8b; do
        python3 bench/gpu/single_stream.py "$ROOT/$m" --repeat 2 --gen 256 \
          --engines "mlx_lm,pippin,pippin:PIPPIN_QUANT_KERNEL=0" 2>&1 | tail -8
      done ;;
    low)
      bench low "1 16 64" 8000 "bf16=pippin:$M8" "PIPPIN_QUANT_KERNEL=0 4bit-before=pippin:$M8-4bit" \
        "4bit=pippin:$M8-4bit" "8bit=pippin:$M8-8bit" ;;
    high)
      bench high 256 24000 "bf16=pippin:$M8" "4bit=pippin:$M8-4bit" ;;
  esac
done
echo "=== done $(date -u +%T)"
