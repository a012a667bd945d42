#!/usr/bin/env bash
# One model's GPU measurement (bench/gpu/README.md):
# a smoke test of the compiled decode step, then bench/gpu/gpu_bench.py (in-process single
# stream against mlx-lm, HTTP against mlx_lm.server). Results and server-log tails in $OUT.
# Usage: bash bench/gpu/gpu_session.sh MODEL [extra gpu_bench.py args]
#   MODEL: llama-3.2-1b or qwen3-0.6b
# Env: SMOKE=0 skips the test; BATCHES=32,128,256 adds in-process batch runs (default none).
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-.tmp/gpu}
MODEL=$1
shift
mkdir -p "$OUT"
if [ "${SMOKE:-1}" = 1 ]; then
  python3 -m pytest -q -p no:cacheprovider tests/runner/test_decode_graph.py -k "llama-config0" 2>&1 |
    tail -3 | tee "$OUT/smoke-$MODEL.log"
fi
python3 bench/gpu/gpu_bench.py --out-dir "$OUT/$MODEL" --models "$MODEL" --batches "${BATCHES:-}" "$@" \
  2>&1 | grep -v "WARNING\|regex" | tee "$OUT/$MODEL.log" | grep -v "^rep \|^c=" | tail -30
# $OUT brings back a few files: keep the summaries, fold the server logs into one.
for f in "$OUT/$MODEL"/logs-*/*.log; do
  [ -f "$f" ] && { echo "== $f"; tail -8 "$f"; } >>"$OUT/server-logs-$MODEL.txt"
done
rm -rf "$OUT/$MODEL"/logs-*
