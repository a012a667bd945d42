#!/usr/bin/env bash
# pippin's W4A16/W8A16 tensor-core kernel (kernels/quant_matmul.py) on the GPU, in steps
# that fit a device call. Usage: bash bench/gpu/w4_session.sh STEP [STEP ...]
#   tests   the fast set of the kernels' `cuda` tests (`cuda_fast`: the first, middle and
#           last case of each, 52 of 294; tests/conftest.py), verbose, each test's stack
#           dumped after 60 s (on 2026-12-06 a quiet `pytest -q ... | tail` here ran 560 s
#           with no output), in 8 processes: the CUDA tests wait on NVRTC, which builds each kernel template on
#           the host (one process ran 25 of them in 150 s, each a new template), not on
#           the GPU; MLX keeps the builds in /tmp/mlx/<version>/ptx for later processes
#   probe   quant_matmul.py on the 8B shape's fused q/k/v, down and fused gate/up: MLX's
#           quantised matmul, the kernel, dequantise + dense, bf16 (ms per product)
#   sweep   the kernel at every tiling (quant_matmul.py --sweep) over the five 8B
#           projections (fused q/k/v, o, fused gate/up, down, LM head), 4-bit at 1-256 rows
#           (`sweep8`: 8-bit at 1/16/64), to tune `quant_matmul.plan`
#   staged  x copied into shared memory a stage ahead (cp.async; `qmm(..., staged=True)`):
#           its `cuda` tests, then every NT 4 tiling staged and not at STAGED_ROWS
#           (16,64,128), 4-bit, over the five 8B projections: whether the 16/64-row products
#           wait on their activation loads (plan does not stage until this says so)
#   matvec  the 1-16 row form (quant_matvec.py) at every tiling (WK, U, CT) over the five 8B
#           projections, 4-bit at 1, 2, 4, 8 and 16 rows (`matvec8`: 8-bit at 1 and 4), beside
#           MLX's product, the matmul form and a plain read of the weights
#   cuda    every `cuda` test under tests/kernels (8 processes, as `tests`), the slowest
#           80 tests' times
#   moe     the Qwen3-30B-A3B shape, 4-bit: pippin with the grouped expert kernel against
#           mlx_lm.server at 1 and 64 streams, then in-process mlx-lm against pippin with
#           and without the kernel (moe_session.sh); `oss` the same for gpt-oss-20b with
#           MXFP4 experts (gpt-oss-20b-mxfp4)
#   spyoss  gpt-oss-20b-mxfp4's server at one stream under py-spy (loop_cost.py; py-spy
#           staged in .gpu/a, installed in /tmp/site/bin): on 2026-12-07 (H100) it streamed
#           at 56 ms a token over HTTP while its engine in-process took 13 ms a token
#   spyone  one stream in-process under py-spy --native (MLX's C++ frames), pippin then
#           mlx-lm, on SPY_MODEL (default gpt-oss-20b-mxfp4): where each engine's host time
#           a step goes (on 2026-12-07 pippin's gpt-oss step held the host 7.5 ms in async_eval)
#   moeprefill  gpt-oss-20b-mxfp4's prompt chunks of 512, 2,048 and 8,192 tokens through
#           MLX's gather_qmm and through the grouped kernel, with the logits compared,
#           then one MoE block at 5, 24 and 512 rows against its exact float32 output on the CPU
#           (moe_prefill.py; MOE_MODEL for another model, e.g. qwen3-30b-a3b-4bit)
#   moeblock  one MoE block of gpt-oss-20b (MXFP4) and of Qwen3-30B-A3B (4-bit) built in memory,
#           at 5, 24, 512 and 2,048 rows against its exact float32 output (moe_block.py): no
#           model build (on by default since its H100 run of 2026-12-08)
#   moenan  where the tiny MoE models of the grouped kernel's model test first give NaN
#           (bench/gpu/moe_nan.py; their MLX bf16 forward did on an H100, not on the CPU)
#   mxfp4   the CUDA tests of MXFP4 weights and of K ending mid-iteration (gpt-oss's 2,880):
#           dense and grouped products, the tiny MoE models through the grouped kernel
#   osspaged  the paged kernel's window and sink tests (`cuda`), then gpt-oss-20b-mxfp4 one
#           stream in-process at 1,024-token prompts: mlx-lm, pippin (windows and sinks
#           read in place by the paged kernel), pippin with its attention gathering the KV
#           each step (PIPPIN_PAGED_KERNEL=0): on 2026-12-07 (H100) 71.8 against 49.3 tok/s
#   build   the random-weight 8B models (bf16, 4-bit) with the real Llama 3 tokenizer
#   fused   the quantised fused layer's `cuda` tests (tests/kernels/test_fused_layer.py)
#   single  in-process single stream of the 4-bit model: mlx-lm, pippin, pippin with the
#           quantised fused layer (opt-in), pippin without the kernels (SINGLE_ENGINES);
#           `batch` the same at 64 rows; `rows16` 16 rows: the quantised fused layer to 16
#           rows, to 8, and not fused (the default); `single8` the 8-bit model (mlx-lm, pippin)
#           and the bf16 one (pippin): the 8-bit goal's ratio
#   where   one 4-bit stream in-process with the device drained after every step
#           (probe_site, PIPPIN_PROBE_SYNC=2): the host's time a step against the device's,
#           pippin and mlx-lm
#   kernel  pippin bench at 1 and 64 streams: the 4-bit model with the kernel and without
#   bf16    pippin bench at 1, 16 and 64 streams: bf16 against 4-bit (kernel, and dense
#           prompt chunks from 256 rows)
#   high    pippin bench at 256 streams: bf16 against 4-bit
# Results in $OUT (tables, JSON, logs), each step's output also in $OUT/<step>.txt.
set -u
export PYTHONPATH=/tmp/site:$PWD/src PYTHONUNBUFFERED=1
OUT=${OUT:-.tmp/gpu}
ROOT=${ROOT:-/tmp/pippin-gpu-models}
mkdir -p "$OUT"
M8=random:llama-3.1-8b
DENSE="PIPPIN_DENSE_QUANT=auto PIPPIN_DENSE_QUANT_ROWS=256"

source bench/gpu/bench_lib.sh
SHAPES=6144x4096,4096x4096,28672x4096,4096x14336,128256x4096

for step in "$@"; do
  echo "=== $step $(date -u +%T)"
  case $step in
    tests)
      timeout "${TESTS_SECS:-300}" python3 -m pytest -v -n 8 -p no:cacheprovider \
        -o faulthandler_timeout=60 --durations=20 \
        -m cuda_fast tests/kernels 2>&1 |
        grep --line-buffered -v WARNING | tee "$OUT/tests.txt" | tail -40 ;;
    fused)
      timeout "${TESTS_SECS:-300}" python3 -m pytest -q -n 8 -p no:cacheprovider -m cuda \
        -k "quantised" tests/kernels/test_fused_layer.py 2>&1 | grep -v WARNING |
        tee "$OUT/fused.txt" | tail -15 ;;
    probe)
      for nk in 6144,4096 4096,14336 28672,4096; do
        (cd bench/gpu && timeout 100 python3 quant_matmul.py --n "${nk%,*}" --k "${nk#*,}" \
          --reps 5 --rows 1,4,16,32,64,128,256,512 --out "$OUT/qmm-${nk/,/x}.json")
      done 2>&1 | grep --line-buffered -v WARNING | tee "$OUT/probe.txt" ;;
    sweep | sweep8)
      br=4:1,4,16,32,64,128,256
      [ "$step" = sweep8 ] && br=8:1,16,64
      (cd bench/gpu && timeout 400 python3 quant_matmul.py --sweep --shapes "$SHAPES" \
        --reps 3 --bits "${br%:*}" --rows "${br#*:}" --out "$OUT/$step.json") 2>&1 |
        grep --line-buffered "SWEEP\|Error\|error" | tee "$OUT/$step.txt" ;;
    staged)
      timeout 150 python3 -m pytest -q -n 8 -p no:cacheprovider -m cuda -k staged \
        tests/kernels/test_quant_matmul.py 2>&1 | grep -v WARNING | tail -4
      (cd bench/gpu && timeout 400 python3 quant_matmul.py --sweep --shapes "$SHAPES" \
        --reps 3 --bits 4 --nt 4 --staged 0,1 --rows "${STAGED_ROWS:-16,64,128}" \
        --out "$OUT/staged.json") 2>&1 | grep --line-buffered "SWEEP\|Error\|error" |
        tee "$OUT/staged.txt" ;;
    matvec | matvec8)
      br=4:1,2,4,8,16
      [ "$step" = matvec8 ] && br=8:1,4
      (cd bench/gpu && timeout 400 python3 quant_matmul.py --matvec --shapes "$SHAPES" \
        --reps 3 --bits "${br%:*}" --rows "${br#*:}" --out "$OUT/$step.json") 2>&1 |
        grep --line-buffered "MATVEC\|READ\|Error\|error" | tee "$OUT/$step.txt" ;;
    cuda)
      timeout 420 python3 -m pytest -v -n 8 -m cuda -p no:cacheprovider \
        -o faulthandler_timeout=60 --durations=80 tests/kernels >"$OUT/cuda.txt" 2>&1
      echo "rc $?"; grep -c PASSED "$OUT/cuda.txt"; grep "FAILED\|ERROR\|passed\|failed" \
        "$OUT/cuda.txt" | tail -15 ;;
    moe | oss)
      model=qwen3-30b-a3b-4bit
      [ "$step" = oss ] && model=gpt-oss-20b-mxfp4
      ENGINES="mlx_lm,pippin,pippin:PIPPIN_MOE_KERNEL=0" \
        KV_MB=12000 TOTAL=${MOE_TOTAL:-560} bash bench/gpu/moe_session.sh $model ;;
    spyoss)
      build gpt-oss-20b-mxfp4 2>&1 | grep built
      PATH=$PATH:/tmp/site/bin timeout 240 python3 bench/gpu/loop_cost.py --concurrency 1 \
        --window 15 --output-tokens 400 --py-spy "$OUT/spy-oss.txt" \
        "$ROOT/gpt-oss-20b-mxfp4" -- --max-model-len 4096 --cache-memory-mb 12000 2>&1 |
        grep -v "WARNING\|regex" | tail -12
      python3 bench/gpu/spy_summary.py "$OUT/spy-oss.txt" --threads 2 --top 25 |
        tee "$OUT/spy-oss-summary.txt" ;;
    spyone)
      m=${SPY_MODEL:-gpt-oss-20b-mxfp4}
      build $m 2>&1 | grep built
      for e in pippin mlx_lm; do
        PATH=$PATH:/tmp/site/bin timeout -s KILL "${SPY_S:-120}" py-spy record --native \
          --threads -r 100 -f raw -o "$OUT/spy1-$e.txt" -- python3 bench/gpu/single_stream.py \
          "$ROOT/$m" --engines $e --gen 400 --prompt 256 --repeat 1 2>&1 | grep "tok/s"
        python3 bench/gpu/spy_summary.py "$OUT/spy1-$e.txt" --threads 1 --top 40 \
          --inclusive 60 >"$OUT/spy1-$e-summary.txt"
        head -60 "$OUT/spy1-$e-summary.txt"
      done 2>&1 | tee "$OUT/spyone.txt" ;;
    moeprefill)
      m=${MOE_MODEL:-gpt-oss-20b-mxfp4}
      build $m 2>&1 | grep built
      (cd bench/gpu && timeout 300 python3 moe_prefill.py "$ROOT/$m") 2>&1 |
        grep --line-buffered -v "WARNING\|regex" | tee "$OUT/moeprefill-$m.txt" ;;
    moeblock)
      for m in gpt-oss-20b-mxfp4 qwen3-30b-a3b-4bit; do
        (cd bench/gpu && timeout 200 python3 moe_block.py $m)
      done 2>&1 | grep --line-buffered -v "WARNING\|regex" | tee "$OUT/moeblock.txt" ;;
    moenan)
      (cd bench/gpu && timeout 200 python3 moe_nan.py) 2>&1 | grep -v WARNING |
        tee "$OUT/moenan.txt" ;;
    mxfp4)
      timeout "${TESTS_SECS:-300}" python3 -m pytest -q -n 8 -p no:cacheprovider -m cuda \
        -k "mxfp4 or k_ending or gpt_oss or moe_model" tests/kernels/test_quant_matmul.py \
        2>&1 | grep -v WARNING | tee "$OUT/mxfp4.txt" | tail -15 ;;
    osspaged)
      timeout 200 python3 -m pytest -q -n 8 -p no:cacheprovider -m cuda -k "windowed" \
        tests/kernels/test_paged_attention.py 2>&1 | grep -v WARNING | tail -5
      build gpt-oss-20b-mxfp4 2>&1 | grep built
      timeout 300 python3 bench/gpu/single_stream.py "$ROOT/gpt-oss-20b-mxfp4" --repeat 2 \
        --gen 128 --prompt 1024 --engines "mlx_lm,pippin,pippin:PIPPIN_PAGED_KERNEL=0" 2>&1 |
        grep --line-buffered -v WARNING | tee "$OUT/osspaged.txt" | tail -8 ;;
    build)
      build llama-3.1-8b llama-3.1-8b-4bit 2>&1 | grep built
      df -h /tmp | tail -1 ;;
    single)
      timeout 240 python3 bench/gpu/single_stream.py "$ROOT/llama-3.1-8b-4bit" --repeat 2 \
        --gen 128 --prompt 256 --engines "${SINGLE_ENGINES:-mlx_lm,pippin,pippin:PIPPIN_FUSED_LAYER=all,pippin:PIPPIN_QUANT_KERNEL=0}" \
        2>&1 |
        grep --line-buffered -v WARNING | tee "$OUT/single.txt" | tail -8 ;;
    single8)  # goal: 8-bit one stream >= 1.6x bf16 (pippin's, same call)
      build llama-3.1-8b-8bit 2>&1 | grep built
      for m in llama-3.1-8b-8bit llama-3.1-8b; do
        echo "== $m"
        timeout 200 python3 bench/gpu/single_stream.py "$ROOT/$m" --repeat 2 --gen 128 \
          --prompt 256 --engines "$([ $m = llama-3.1-8b ] && echo pippin || echo mlx_lm,pippin)" \
          2>&1 | grep --line-buffered -v WARNING | tail -4
      done 2>&1 | tee "$OUT/single8.txt" ;;
    where)
      for e in pippin mlx_lm; do
        mkdir -p "$OUT/where-$e"
        PYTHONPATH=$PYTHONPATH:$PWD/bench/gpu/probe_site PIPPIN_PROBE_EVAL="$OUT/where-$e" \
          PIPPIN_PROBE_SYNC=2 timeout 150 python3 bench/gpu/single_stream.py \
          "$ROOT/llama-3.1-8b-4bit" --repeat 1 --gen 128 --prompt 256 --engines $e 2>&1 |
          grep --line-buffered "tok/s" | head -2
        for f in "$OUT/where-$e"/async-eval-*.txt; do head -8 "$f"; done
      done 2>&1 | tee "$OUT/where.txt" ;;
    rows16)
      timeout 200 python3 bench/gpu/single_stream.py "$ROOT/llama-3.1-8b-4bit" --repeat 2 \
        --gen 64 --prompt 256 --batch 16 --engines \
        "pippin:PIPPIN_FUSED_LAYER=all,pippin:PIPPIN_FUSED_LAYER=qkv:8/o:8/gate_up:8/down:8,pippin" \
        2>&1 | grep --line-buffered -v WARNING | tee "$OUT/rows16.txt" | tail -8 ;;
    batch)
      timeout 200 python3 bench/gpu/single_stream.py "$ROOT/llama-3.1-8b-4bit" --repeat 1 \
        --gen 64 --prompt 256 --batch 64 --engines "pippin,pippin:PIPPIN_QUANT_KERNEL=0,mlx_lm" \
        2>&1 | grep --line-buffered -v WARNING | tee "$OUT/batch.txt" | tail -8 ;;
    kernel)
      SECS=400 WARMUP=2 bench kernel "1 64" 8000 "4bit=pippin:$M8-4bit" \
        "PIPPIN_QUANT_KERNEL=0 4bit-off=pippin:$M8-4bit" >/dev/null 2>&1
      grep "^|" "$OUT/kernel.md" ;;
    bf16)
      SECS=220 WARMUP=2 bench bf16 "1 16 64" 8000 "bf16=pippin:$M8" \
        "$DENSE 4bit=pippin:$M8-4bit" >/dev/null 2>&1
      grep "^|" "$OUT/bf16.md" ;;
    high)
      SECS=400 WARMUP=2 bench high 256 24000 "bf16=pippin:$M8" "$DENSE 4bit=pippin:$M8-4bit" \
        >/dev/null 2>&1
      grep "^|" "$OUT/high.md" ;;
  esac
done
echo "=== done $(date -u +%T)"
