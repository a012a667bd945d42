# Sourced by the GPU session scripts: `pippin bench` over random-weight models with the
# real tokenizers, its results and the servers' log tails kept in $OUT; the models built.
# Needs OUT and ROOT set. Env: SECS (each bench's limit, default 280), WORKLOAD
# (default real-tokenizer), OUTPUT_TOKENS (128), PER_CLIENT (requests per client, 1),
# MAX_LEN (pippin's --max-model-len, 4096), WARMUP (requests, 4), BENCH_ARGS (more
# `pippin bench` flags, e.g. "--api completions --tokenizer DIR").

bench() {  # NAME CONCURRENCY KV_MB SERVER_SPECS...
  local name=$1 conc=$2 kv=$3
  shift 3
  local args=() s
  for s in "$@"; do
    case $s in
      *mlx_lm:*) args+=(--serve "$s") ;;
      *) args+=(--serve "$s --max-model-len ${MAX_LEN:-4096} --cache-memory-mb $kv") ;;
    esac
  done
  # SIGINT: pippin bench stops its servers on the way out and reports finished windows.
  # shellcheck disable=SC2086  # BENCH_ARGS: words
  timeout -s INT "${SECS:-280}" python3 -m pippin.cli bench --model-root "$ROOT" \
    --workload "${WORKLOAD:-real-tokenizer}" --output-tokens "${OUTPUT_TOKENS:-128}" \
    --concurrency $conc --requests-per-client "${PER_CLIENT:-1}" --warmup "${WARMUP:-4}" \
    --blas none --no-progress ${BENCH_ARGS:-} \
    --json "$OUT/$name.json" --md "$OUT/$name.md" --log-dir "/tmp/logs-$name" \
    "${args[@]}" 2>&1 | grep -v "WARNING\|regex" | tee "$OUT/$name.log"
  for f in /tmp/logs-"$name"/*.log; do
    [ -f "$f" ] && { echo "== $f"; tail -6 "$f"; } >>"$OUT/server-logs.txt"
  done
}

build() {  # MODEL... (pippin.bench.models names), built side by side under $ROOT
  local m
  for m in "$@"; do
    python3 -c "
import time
from pathlib import Path
from pippin.bench.models import build_model
t = time.perf_counter(); build_model('$m', Path('$ROOT'))
print('$m built in', round(time.perf_counter() - t), 's', flush=True)" &
  done
  wait
}
