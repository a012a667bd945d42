#!/usr/bin/env bash
# One GPU-machine session after `bash .gpu/b/install.sh` (see ../shared/gpu/README.md):
# the kernel's tests, in-process before (gather path) and after (paged kernel), then HTTP.
# Usage: bash bench/gpu_session.sh [MODELS] [extra gpu_bench.py args for the HTTP part]
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-.tmp/gpu}
MODELS=${1:-llama-3.2-1b}
shift || true
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv >"$OUT/test.log" 2>&1
[ -z "${SKIP_TESTS:-}" ] && python3 -m pytest -q -p no:cacheprovider tests/test_paged_attention.py 2>&1 | tail -25 >>"$OUT/test.log"
cat "$OUT/test.log"
if [ -z "${SKIP_TESTS:-}" ] && grep -q "test_kernel_matches_gather_path.*FAILED\|FAILED.*test_kernel_matches" "$OUT/test.log"; then
  echo "kernel tests failed: measuring the gather path only"
  export PIPPIN_PAGED_KERNEL=0
fi
if [ -z "${SKIP_IN_PROCESS:-}" ]; then
  [ -z "${SKIP_BEFORE:-}" ] && PIPPIN_PAGED_KERNEL=0 python3 bench/gpu_bench.py --out-dir "$OUT/before" --models "$MODELS" \
    --skip-http 2>&1 | grep -v "^WARNING" | tee "$OUT/before.log"
  python3 bench/gpu_bench.py --out-dir "$OUT/after" --models "$MODELS" --skip-http \
    --batches 32,128,256 2>&1 | grep -v "^WARNING" | tee "$OUT/after.log"
fi
if [ -z "${SKIP_HTTP:-}" ]; then
  python3 bench/gpu_bench.py --out-dir "$OUT/http" --models "$MODELS" --skip-in-process "$@" \
    2>&1 | grep -v "^WARNING" | tee "$OUT/http.log"
fi
# $OUT brings back at most 8 files: keep the summaries, fold the server logs into one.
rm -f "$OUT"/http/http-*.md "$OUT"/http/http-*.json
for f in "$OUT"/http/logs-*/*.log; do
  [ -f "$f" ] && { echo "== $f"; tail -40 "$f"; } >>"$OUT/server-logs.txt"
done
rm -rf "$OUT"/http/logs-*
