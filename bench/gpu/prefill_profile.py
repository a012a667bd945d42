"""Prefill and whole-job throughput in-process: pippin's engine against mlx-lm.

A server under many streams spends much of its device time reading prompts: with
512-token prompts and 256 output tokens, two prompt tokens per output token. This times

- a prefill step: `--prefill-batch` fresh prompts of `--prompt` tokens in one step
  (pippin's `EngineCore`, one output token each), against mlx-lm's model called on the
  same batch with a fresh KV cache;
- a whole job: `--job` requests of `--prompt` + `--gen` tokens, all added at once and run
  to the end (prefill included), against mlx-lm's `BatchGenerator`;
- a steady closed loop of `--job` clients: a server's load without HTTP. `--server-core`
  builds that engine as `pippin serve` does (the model's tokenizer, so outputs are
  detokenized, and the server's pool and step sizes); `--shared-prefix N` starts every
  prompt with the same N tokens, as a chat template's system header does.

    python3 bench/gpu/prefill_profile.py --model /tmp/pippin-gpu-models/llama-3.2-1b --out $OUT
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import checkout  # noqa: F401  (src/ on the path, pippin imported before MLX)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=256)
    ap.add_argument("--prefill-batch", type=int, default=16)
    ap.add_argument("--job", type=int, default=256)
    ap.add_argument("--parts", default="prefill,job,steady", help="which measurements to run")
    ap.add_argument("--out", type=Path, default=Path(".tmp/prefill-profile"))
    ap.add_argument("--server-core", action="store_true", help="steady: the engine as served")
    ap.add_argument("--own-stream", action="store_true", help="steady: on a new stream, as served")
    ap.add_argument("--shared-prefix", type=int, default=0, help="steady: tokens all prompts share")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from pippin.bench.inproc import bare_core, decode_rate, drive, mlx_lm_batch_rate
    from pippin.engine.core import EngineCore
    from pippin.engine.types import SamplingParams

    model, _ = load(str(args.model))
    vocab = model.args.vocab_size
    rng = random.Random(0)
    res: dict = {"model": str(args.model), "device": str(mx.default_device()), "args": vars(args)}

    def prompts(n: int, shared: int = 0) -> list[list[int]]:
        head = [rng.randrange(vocab) for _ in range(shared)]
        return [
            head + [rng.randrange(vocab) for _ in range(args.prompt - shared)] for _ in range(n)
        ]

    def served_core() -> EngineCore:
        from pippin.engine.config import EngineConfig, default_batched_tokens
        from pippin.store.loader import load_model, materialize

        loaded = materialize(load_model(str(args.model)))  # as the server does
        cfg = EngineConfig(max_model_len=4096, max_num_batched_tokens=default_batched_tokens())
        return EngineCore(loaded, cfg)

    def mlx_prefill(batch: list[list[int]]) -> float:
        cache = make_prompt_cache(model)
        t0 = time.perf_counter()
        logits = model(mx.array(batch), cache=cache)
        mx.eval(logits[:, -1], [c.state for c in cache])
        return time.perf_counter() - t0

    def pippin_prefill(batch: list[list[int]]) -> float:
        params = SamplingParams(max_tokens=1, ignore_eos=True)
        run = drive(bare_core(model, batch, 1), [(str(i), p, params) for i, p in enumerate(batch)])
        res.setdefault("prefill_steps", run.steps)
        return run.seconds

    parts = args.parts.split(",")
    tokens = args.prefill_batch * args.prompt
    for name, fn in (("mlx_lm", mlx_prefill), ("pippin", pippin_prefill)) * ("prefill" in parts):
        fn(prompts(args.prefill_batch))  # warm-up: kernels
        best = min(fn(prompts(args.prefill_batch)) for _ in range(3))
        res[f"prefill_{name}_tok_s"] = tokens / best
        print(
            f"prefill {args.prefill_batch}x{args.prompt}: {name:7s} {best * 1e3:7.1f} ms "
            f"({tokens / best:,.0f} tok/s)",
            flush=True,
        )

    def pippin_job(batch: list[list[int]]) -> float:
        return decode_rate(model, batch, args.gen, with_prefill=True)

    def mlx_job(batch: list[list[int]]) -> float:
        t0 = time.perf_counter()
        mlx_lm_batch_rate(model, batch, args.gen)
        return len(batch) * args.gen / (time.perf_counter() - t0)

    for name, fn in (("mlx_lm", mlx_job), ("pippin", pippin_job)) * ("job" in parts):
        fn(prompts(min(args.job, 16)))  # warm-up
        tps = fn(prompts(args.job))
        res[f"job_{name}_tok_s"] = tps
        print(
            f"job {args.job} x ({args.prompt} + {args.gen}): {name:7s} {tps:,.0f} output tok/s",
            flush=True,
        )

    def pippin_steady(conc: int) -> tuple[float, float]:
        """Closed loop, as a server under `conc` clients: each finished request is replaced
        by a new one at once. Output tok/s over the second half, and steps per second."""
        total = conc * 3
        batch = prompts(total, args.shared_prefix)
        core = served_core() if args.server_core else bare_core(model, batch[: conc * 2], args.gen)
        params = SamplingParams(max_tokens=args.gen, temperature=1.0, ignore_eos=True)
        sent = 0
        for _ in range(conc):
            core.add_request(str(sent), batch[sent], params)
            sent += 1
        n, t0, steps0 = 0, 0.0, 0
        done = 0
        while core.has_work():
            for o in core.step():
                if done >= total // 2:
                    n += sum(len(c.token_ids) for c in o.outputs)
                if o.finished:
                    done += 1
                    if done == total // 2:
                        t0, steps0 = time.perf_counter(), core.steps
                    if sent < total:
                        core.add_request(str(sent), batch[sent], params)
                        sent += 1
            if sent == total and done >= total - conc // 2:
                break
        wall = time.perf_counter() - t0
        return n / wall, (core.steps - steps0) / wall

    if "steady" not in parts:
        (args.out / "prefill_profile.json").write_text(json.dumps(res, indent=2, default=str))
        return 0
    dec = decode_rate(model, prompts(args.job), args.gen)
    res["decode_pippin_tok_s"] = dec
    print(f"decode only, batch {args.job}: pippin {dec:,.0f} tok/s", flush=True)
    with mx.stream(
        mx.new_stream(mx.default_device())
        if args.own_stream
        else mx.default_stream(mx.default_device())
    ):
        pippin_steady(min(args.job, 16))  # warm-up
        tps, sps = pippin_steady(args.job)
    res["steady_pippin_tok_s"], res["steady_pippin_steps_s"] = tps, sps
    print(
        f"steady {args.job} clients x ({args.prompt} + {args.gen}): pippin {tps:,.0f} output "
        f"tok/s, {sps:.1f} steps/s",
        flush=True,
    )
    (args.out / "prefill_profile.json").write_text(json.dumps(res, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
