#!/usr/bin/env bash
# Probes of where a decode step's time goes, on the GPU machine (bench/gpu/README.md).
#   bash bench/gpu/gpu_probe.sh env   : in-process decode (mlx-lm and pippin) under MLX's CUDA
#                                   graph settings (MLX_USE_CUDA_GRAPHS, MLX_MAX_OPS_PER_BUFFER)
#   bash bench/gpu/gpu_probe.sh loop  : a server under 256 streams (pippin bench, its clients in
#                                   several processes): CPU per token of each thread, steps/s,
#                                   requests running, and a py-spy profile of every thread
#                                   (NATIVE=1: with MLX's C++ frames)
#   bash bench/gpu/gpu_probe.sh steady: the same load in-process (EngineCore, closed loop, no
#                                   HTTP): what the server loses to the event loop and the GIL
#   bash bench/gpu/gpu_probe.sh spy-steady: steady alone under py-spy (NATIVE=1: --native, MLX's
#                                   C++ included; FLAGS: prefill_profile flags)
#   bash bench/gpu/gpu_probe.sh served: the closed loop as `steady`, then with the engine built as
#                                   the server builds it (--server-core), then also on its
#                                   own stream: what the served engine loses in-process
#   bash bench/gpu/gpu_probe.sh bucket: loop in an engine process without and with
#                                   PIPPIN_PREFILL_BUCKET=64, mx.async_eval timed per call
#   bash bench/gpu/gpu_probe.sh attn  : loop in an engine process with PIPPIN_PREFILL_ATTENTION=fused,
#                                   then the default (composed), mx.async_eval timed per call
#   bash bench/gpu/gpu_probe.sh single: single-stream decode in-process (bench/gpu/single_stream.py),
#                                   mx.async_eval's host time per call, then each engine under
#                                   py-spy --native (MLX's C++ frames, inclusive)
#   bash bench/gpu/gpu_probe.sh floor : a step's fixed host cost and its cost per layer and per
#                                   node (bench/gpu/step_floor.py)
#   bash bench/gpu/gpu_probe.sh kernels: device time per kernel kind of a decode step, pippin's
#                                   against MLX's ops (bench/gpu/kernel_time.py), launches
#                                   independent and then chained
#   bash bench/gpu/gpu_probe.sh ab    : kernels and single-stream decode for this checkout's src/
#                                   and for B_SRC (another branch's src/, carried), in turns
#   bash bench/gpu/gpu_probe.sh rows  : decode of BS (default 1 2 3 4 6 8) prompts together in-process,
#                                   mlx-lm and pippin with ENGINES' PIPPIN_FUSED_LAYER settings
#                                   (bench/gpu/single_stream.py --batch): which projections pay
#   bash bench/gpu/gpu_probe.sh mem   : gpu_bench.py (MODELS, default qwen3-0.6b; CONC, default
#                                   1,16,64,256) with every process's GPU memory sampled
#                                   by nvidia-smi every 3 s (mem.log): does the engine stay
#                                   within its pool, weights and buffer cache?
#   bash bench/gpu/gpu_probe.sh gil   : steady, then loop in one process, then loop with
#                                   --engine-process: is the 256-stream server GIL-bound?
#   (gil-a and gil-b are its two halves, each under one device call's 10 minutes)
# Results in $OUT. EXTRA: more `pippin serve` flags for `loop`; PARTS: prefill_profile parts for
# `steady` (default steady,job).
set -u
# PIPPIN_PROBE_EVAL=DIR: time every mx.async_eval (bench/gpu/probe_site/sitecustomize.py)
export PYTHONPATH=/tmp/site:$PWD/src${PIPPIN_PROBE_EVAL:+:$PWD/bench/gpu/probe_site} PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH
OUT=${OUT:-.tmp/gpu}
MODEL=${MODEL:-llama-3.2-1b}
mkdir -p "$OUT"
path=$(python3 -c "from pippin.bench.models import build_model; from pathlib import Path; print(build_model('$MODEL', Path('/tmp/pippin-gpu-models')))" | tail -1)
case $1 in
env)
  for e in ${ENVS:-"X=0" "MLX_USE_CUDA_GRAPHS=0" "MLX_MAX_OPS_PER_BUFFER=60" "MLX_MAX_OPS_PER_BUFFER=200"}; do
    echo "== $e" | tee -a "$OUT/env.log"
    env "$e" python3 bench/gpu/decode_profile.py --model "$path" --batches "${BATCHES:-1,256}" \
      --modes compiled --gen 128 --out "$OUT/env-${e//=/-}" 2>&1 |
      grep "tok/s" | tee -a "$OUT/env.log"
  done
  ;;
loop)
  timeout -s KILL 240 python3 bench/gpu/loop_cost.py --concurrency 256 --prompt-tokens 512 \
    --output-tokens 256 --window 10 --py-spy "$OUT/spy-server.txt" ${NATIVE:+--native} \
    "$path" -- --max-model-len 4096 ${EXTRA:-} 2>&1 | tail -3 | tee -a "$OUT/loop.log"
  ;;
steady)
  timeout -s KILL 240 python3 bench/gpu/prefill_profile.py --model "$path" --parts "${PARTS:-steady,job}" \
    --out "$OUT/steady" ${FLAGS:-} 2>&1 | grep "tok/s" | tee -a "$OUT/steady.log"
  ;;
spy-steady)
  # NATIVE=1: MLX's C++ frames too (slows the loop a lot); FLAGS: prefill_profile flags.
  tag=spy-steady${FLAGS:+$(echo "$FLAGS" | tr -d ' ')}
  timeout -s KILL 240 py-spy record ${NATIVE:+--native} --threads -r 100 -f raw -o "$OUT/$tag.txt" \
    -- python3 bench/gpu/prefill_profile.py --model "$path" --parts steady --out "$OUT/$tag" \
    ${FLAGS:-} 2>&1 | grep "tok/s" | tee -a "$OUT/steady.log"
  python3 bench/gpu/spy_summary.py "$OUT/$tag.txt" --threads 1 --top 30 >"$OUT/$tag-summary.txt"
  ;;
served)
  for flags in "" "--server-core" "--server-core --own-stream"; do
    echo "== steady $flags" | tee -a "$OUT/served.log"
    timeout -s KILL 150 python3 bench/gpu/prefill_profile.py --model "$path" --parts steady \
      --out "$OUT/served" $flags 2>&1 | grep "tok/s" | tee -a "$OUT/served.log"
  done
  ;;
bucket)
  # The server under 256 streams without and with PIPPIN_PREFILL_BUCKET=64, each call of
  # mx.async_eval timed (does padding prompt chunks remove the 50-140 ms stalls?).
  for b in 0 64; do
    echo "== PIPPIN_PREFILL_BUCKET=$b" | tee -a "$OUT/loop.log"
    mkdir -p "$OUT/bucket-$b"
    PIPPIN_PROBE_EVAL="$OUT/bucket-$b" PIPPIN_PREFILL_BUCKET=$b \
      EXTRA="--engine-process ${EXTRA:-}" bash "$0" loop
    mv "$OUT/spy-server.txt" "$OUT/bucket-$b/spy-server.txt"
  done
  ;;
attn)
  # The server under 256 streams with prefill attention fused (MLX's cuDNN path) and
  # composed (the CUDA default), each call of mx.async_eval timed: slow seconds left?
  for m in fused auto; do
    echo "== PIPPIN_PREFILL_ATTENTION=$m" | tee -a "$OUT/loop.log"
    mkdir -p "$OUT/attn-$m"
    PIPPIN_PROBE_EVAL="$OUT/attn-$m" PIPPIN_PREFILL_ATTENTION=$m \
      EXTRA="--engine-process ${EXTRA:-}" bash "$0" loop
    mv "$OUT/spy-server.txt" "$OUT/attn-$m/spy-server.txt"
    for f in "$OUT/attn-$m"/async-eval-*.txt; do
      head -4 "$f"  # calls per site; then per second: calls, ms in the calls, longest
      sed -n '/^second/,/^call site/p' "$f" | sed 1d | awk '{printf "%s |", $0} END {print ""}'
    done
  done
  ;;
single)
  python3 bench/gpu/single_stream.py "$path" --repeat "${REPEAT:-3}" 2>&1 | tee -a "$OUT/single.log"
  # The host's own time in each mx.async_eval call (the device drained before each).
  mkdir -p "$OUT/single-eval"
  PYTHONPATH=$PYTHONPATH:$PWD/bench/gpu/probe_site PIPPIN_PROBE_EVAL="$OUT/single-eval" \
    PIPPIN_PROBE_SYNC=1 python3 bench/gpu/single_stream.py "$path" --repeat 1 >/dev/null 2>&1
  head -20 "$OUT"/single-eval/async-eval-*.txt | grep -v "^ *[0-9]* *[0-9]* *[0-9.]* *[0-9.]*$"
  for e in ${ENGINES:-pippin mlx_lm}; do
    timeout -s KILL ${SPY_S:-300} py-spy record --native --threads -r ${RATE:-100} -f raw -o "$OUT/spy-single-$e.txt" \
      -- python3 bench/gpu/single_stream.py "$path" --engines "$e" --gen ${SPY_GEN:-800} --repeat 1 2>&1 | tail -1
    python3 bench/gpu/spy_summary.py "$OUT/spy-single-$e.txt" --threads 1 --top 40 --inclusive 60 \
      >"$OUT/spy-single-$e-summary.txt"
    cat "$OUT/spy-single-$e-summary.txt"
  done
  ;;
ab)
  for src in "$PWD/src" "${B_SRC:?B_SRC: another source tree}"; do
    echo "== $src" | tee -a "$OUT/ab.log"
    PIPPIN_SRC=$src timeout -s KILL 200 python3 bench/gpu/kernel_time.py --model "$path" \
      --rows "${ROWS:-1,8}" --context "${CONTEXT:-512,4096}" ${CHAIN:+--chain} 2>&1 | tee -a "$OUT/ab.log"
    PIPPIN_SRC=$src timeout -s KILL 150 python3 bench/gpu/single_stream.py "$path" --engines mlx_lm,pippin \
      --repeat 2 --gen 256 2>&1 | grep median | tee -a "$OUT/ab.log"
  done
  ;;
kernels)
  # Independent launches (throughput), then each after the previous (a step's latency).
  for mode in "" --chain; do
    timeout -s KILL 200 python3 bench/gpu/kernel_time.py --model "$path" --rows "${ROWS:-1,8}" \
      --context "${CONTEXT:-512,4096}" $mode --out "$OUT/kernels${mode/--/-}.json" 2>&1 |
      tee -a "$OUT/kernels.log"
  done
  ;;
rows)
  for b in ${BS:-1 2 3 4 6 8}; do
    echo "== $MODEL batch $b" | tee -a "$OUT/rows.log"
    timeout -s KILL 150 python3 bench/gpu/single_stream.py "$path" --batch "$b" --gen "${GEN:-128}" \
      --repeat 3 --engines "${ENGINES:-mlx_lm,pippin:PIPPIN_FUSED_LAYER=0,pippin,pippin:PIPPIN_FUSED_LAYER=down,pippin:PIPPIN_FUSED_LAYER=gate_up/down}" \
      2>&1 | grep -v regex | tee -a "$OUT/rows.log" | grep -E "median|/"
  done
  ;;
mem)
  (while true; do
    echo "== $(date +%T)"
    nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader 2>&1
    ps -eo pid,args | grep -E "pippin|mlx_lm|gpu_bench|spawn_main" | grep -v grep | cut -c1-120
    sleep 3
  done) >"$OUT/mem.log" 2>&1 &
  sampler=$!
  timeout -s KILL ${BENCH_S:-560} python3 bench/gpu/gpu_bench.py --models "${MODELS:-qwen3-0.6b}" \
    --servers pippin,mlx_lm --concurrency "${CONC:-1,16,64,256}" --batches "" \
    --requests-per-client 1 --out-dir "$OUT" 2>&1 | grep -v Warn | tee "$OUT/bench.log" |
    grep -E "^ +[0-9]+ +(pippin|mlx)|in-process"
  kill $sampler
  awk '/^==/{t=$2} /MiB/{split($0,a,", "); m=a[2]+0; if(m>mx[a[1]]){mx[a[1]]=m; at[a[1]]=t}}
    END{for(p in mx) print "pid", p, "peak", mx[p], "MiB at", at[p]}' "$OUT/mem.log"
  ;;
floor)
  timeout -s KILL 500 python3 bench/gpu/step_floor.py --model "$path" --widths "${WIDTHS:-2048,256}" 2>&1 | grep -v tokenizer |
    tee -a "$OUT/floor.log"
  ;;
gil)
  bash "$0" gil-a
  bash "$0" gil-b
  ;;
gil-a)
  bash "$0" steady
  bash "$0" spy-steady
  ;;
gil-b)
  echo "== one process" | tee -a "$OUT/loop.log"
  bash "$0" loop
  mv "$OUT/spy-server.txt" "$OUT/spy-one-process.txt"
  echo "== --engine-process" | tee -a "$OUT/loop.log"
  EXTRA="--engine-process ${EXTRA:-}" bash "$0" loop
  ;;
esac
