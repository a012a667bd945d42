"""LoRA adapters per row: aggregate output tokens/s of N concurrent streams whose requests
are spread over 1, 4 and 16 adapters (one batch, each row its own adapter), against the
base model alone, in-process through `EngineCore`, on the default model (SmolLM2) or
`--model` (a folder, a GGUF file: no network needed).

The adapters are random, of `--rank`, on every attention and MLP projection of every
layer, written to a temporary folder in mlx-lm's format and loaded as `pippin serve
--lora-modules` loads them. The base model runs in an engine that never had an adapter
(on CUDA, adapters turn the fused attention kernels off); the adapter loads in another
engine on the same weights. Prompts are random token ids, distinct per stream (no prefix
cache hits); greedy, `--gen` tokens each. "decode" is timed from the first token after
every prompt's prefill, "with prefill" from the moment the requests are added. Run by
hand, never as a test:

    LD_PRELOAD=/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0 \\
        PYTHONPATH=src .venv/bin/python bench/lora.py --streams 16 --gen 64 --rank 16
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from dataclasses import replace
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from pippin.bench.inproc import drive, engine_model
from pippin.engine.config import EngineConfig
from pippin.engine.core import EngineCore
from pippin.engine.types import SamplingParams
from pippin.store import loader
from pippin.store.loaded import LoadedModel

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(model: nn.Module, dest: Path, rank: int, seed: int) -> Path:
    """A random mlx-lm adapter of `rank` on every projection of `TARGETS`."""
    rng = np.random.default_rng(seed)
    tensors: dict[str, mx.array] = {}
    for path, m in model.named_modules():
        if path.rpartition(".")[2] not in TARGETS or not isinstance(
            m, nn.Linear | nn.QuantizedLinear
        ):
            continue
        out, inp = m.weight.shape
        if isinstance(m, nn.QuantizedLinear):
            inp = inp * 32 // m.bits
        a = rng.normal(0, 1 / np.sqrt(inp), (inp, rank)).astype(np.float32)
        b = rng.normal(0, 0.01, (rank, out)).astype(np.float32)
        tensors[f"{path}.lora_a"], tensors[f"{path}.lora_b"] = mx.array(a), mx.array(b)
    dest.mkdir(parents=True)
    params = {"rank": rank, "scale": 2.0, "dropout": 0.0}
    config = {"fine_tune_type": "lora", "num_layers": -1, "lora_parameters": params}
    (dest / "adapter_config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(dest / "adapters.safetensors"), tensors)
    return dest


def engine(loaded: LoadedModel, streams: int, prompt: int, gen: int) -> EngineCore:
    blocks = streams * ((prompt + gen) // 16 + 2) + 64
    return EngineCore(
        loaded,
        EngineConfig(
            num_blocks=blocks,
            max_model_len=prompt + gen + 16,
            max_num_seqs=streams,
            max_num_batched_tokens=max(2048, streams * 16),
        ),
    )


def run(
    core: EngineCore, prompts: list[list[int]], gen: int, loras: list[str | None], tag: str
) -> tuple[float, float]:
    """(decode tok/s, tok/s with prefill) of one run of every prompt at once."""

    def requests(prefix: str) -> list[tuple[str, list[int], SamplingParams]]:
        return [
            (
                f"{prefix}{i}",
                p,
                SamplingParams(max_tokens=gen, temperature=0.0, ignore_eos=True, lora=loras[i]),
            )
            for i, p in enumerate(prompts)
        ]

    core.bm.clear_cache()
    decode = drive(core, requests(f"{tag}d"), untimed_prefill=True, keep=False).tok_s
    core.bm.clear_cache()
    whole = drive(core, requests(f"{tag}w"), keep=False).tok_s
    return decode, whole


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--model", help="a model folder or GGUF file (default: SmolLM2)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--streams", type=int, default=16, help="concurrent requests")
    ap.add_argument("--prompt", type=int, default=128, help="prompt tokens each")
    ap.add_argument("--gen", type=int, default=64, help="output tokens each")
    ap.add_argument("--adapters", default="1,4,16", help="adapter counts to spread over")
    ap.add_argument("--repeat", type=int, default=3, help="runs per row (median)")
    args = ap.parse_args()
    counts = [int(x) for x in args.adapters.split(",")]

    loaded = loader.load_model(args.model)
    vocab = loaded.vocab_size or 32000
    rng = random.Random(0)
    prompts = [[rng.randrange(100, vocab) for _ in range(args.prompt)] for _ in range(args.streams)]
    with tempfile.TemporaryDirectory() as tmp:
        # Written from the unpatched model, before an engine fuses its projections.
        paths = [
            write_adapter(loaded.model, Path(tmp) / f"a{i}", args.rank, i)
            for i in range(max(counts))
        ]
        # Two engines, one weights: the adapters' over a copy of the module tree, so the
        # base model's engine never sees a LoRA layer.
        lora_model = engine_model(loaded.model)
        base = engine(loaded, args.streams, args.prompt, args.gen)
        core = engine(replace(loaded, model=lora_model), args.streams, args.prompt, args.gen)
        for i, p in enumerate(paths):
            core.add_lora(f"a{i}", str(p))
        configs: list[tuple[str, EngineCore, list[str | None]]] = [
            ("base model alone", base, [None] * args.streams),
            ("base rows, adapters loaded", core, [None] * args.streams),
        ]
        for n in counts:
            loras: list[str | None] = [f"a{i % n}" for i in range(args.streams)]
            configs.append((f"{n} adapter{'s' if n > 1 else ''}", core, loras))
        for label, c, loras in configs:  # warm: every shape traced, buffers cached
            run(c, prompts, 4, loras, f"warm{label}")
        # In turns, so that a drift of the machine's speed touches every row alike.
        runs: dict[str, list[tuple[float, float]]] = {label: [] for label, _, _ in configs}
        for k in range(args.repeat):
            for label, c, loras in configs:
                runs[label].append(run(c, prompts, args.gen, loras, f"{label}{k}"))
        rows = [
            (label, statistics.median(r[0] for r in rs), statistics.median(r[1] for r in rs))
            for label, rs in runs.items()
        ]

    name = Path(args.model).name if args.model else "SmolLM2-135M-Instruct (default)"
    setup = f"{args.streams} streams, prompts {args.prompt} tokens, {args.gen} out"
    print(f"\n{name}, {setup}, rank {args.rank}, device {mx.default_device()}\n")
    print("| requests | decode tok/s | vs base | with prefill tok/s | vs base |")
    print("|---|---:|---:|---:|---:|")
    b_dec, b_all = rows[0][1], rows[0][2]
    for label, dec, whole in rows:
        print(f"| {label} | {dec:.0f} | {dec / b_dec:.2f} | {whole:.0f} | {whole / b_all:.2f} |")


if __name__ == "__main__":
    main()
