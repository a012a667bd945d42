"""How many different shapes a server's prefill calls take, with and without
PIPPIN_PREFILL_BUCKET (CPU is fine: shapes do not depend on the device).

    python bench/gpu/prefill_shapes.py [--steps 1500] [--buckets 0,64]

A closed loop of 256 requests, as a server under 256 clients sees it: prompts of a
32-token shared header (a chat template's) and 468-498 more tokens, 200-299 output tokens
each, so requests end and new ones arrive at different steps. On CUDA every new shape of
a prefill call that reaches cuDNN costs host time (it builds an attention plan per shape);
the padding costs the extra tokens computed. On the H200 the bucket did not shorten the
server's stalls: they were cuDNN plan builds (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from pathlib import Path

from checkout import REPO_ROOT  # src on the path, pippin's MLX settings first

sys.path.insert(0, str(REPO_ROOT / "tests"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=1500)
    ap.add_argument("--buckets", default="0,64", help="0: no bucket")
    ap.add_argument("--model", type=Path, default=Path("/tmp/pippin-prefill-shapes-llama"))
    args = ap.parse_args()
    from tiny_models import build_tiny_model

    from pippin.engine import paged_cache
    from pippin.engine.config import EngineConfig
    from pippin.engine.core import EngineCore
    from pippin.engine.types import SamplingParams
    from pippin.store.loader import load_model

    if not (args.model / "config.json").exists():
        # One small layer: only the shapes matter here.
        build_tiny_model(
            "llama",
            args.model,
            num_hidden_layers=1,
            hidden_size=32,
            intermediate_size=64,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
        )
    seen: list[tuple[int, int, int]] = []
    real = paged_cache.BatchLayout.__post_init__

    def spy(self: paged_cache.BatchLayout) -> None:
        real(self)
        if max(self.lengths) > 1:
            seen.append((len(self.starts), self.pad_len, self.kv_width))

    paged_cache.BatchLayout.__post_init__ = spy  # type: ignore[method-assign]
    loaded = load_model(str(args.model))

    def run(bucket: str) -> str:
        rng = random.Random(0)
        header = [rng.randrange(700) for _ in range(32)]
        os.environ["PIPPIN_PREFILL_BUCKET"] = bucket
        cfg = EngineConfig(max_model_len=2048, max_num_batched_tokens=8192, num_blocks=40000)
        core = EngineCore(loaded, cfg)

        def add(i: int) -> None:
            p = SamplingParams(max_tokens=rng.randrange(200, 300), temperature=1.0, ignore_eos=True)
            prompt = header + [rng.randrange(700) for _ in range(rng.randrange(468, 499))]
            core.add_request(str(i), prompt, p)

        for n in range(256):
            add(n)
        n = 256
        seen.clear()
        for _ in range(args.steps):
            for o in core.step():
                if o.finished:
                    add(n)
                    n += 1
        return (
            f"bucket {bucket if bucket != '0' else 'none'}: {n - 256} arrivals, "
            f"{len(seen)} prefill calls, {len(set(seen))} distinct (rows, tokens, keys) "
            f"shapes, {len({(b, L) for b, L, _ in seen})} distinct query shapes, "
            f"{sum(b * L for b, L, _ in seen):,} tokens computed"
        )

    for bucket in args.buckets.split(","):
        print(run(bucket), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
