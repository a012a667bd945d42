"""Graph nodes of one single-stream decode step: mlx-lm with its own caches against
pippin's engine step, on any device (the CPU included).

A decode step on a GPU is bound by host time per op (each node a launch), so the node
count predicts where a change of the step's graph goes before a GPU measures it. pippin's
step is counted as it reaches `mx.async_eval` (logits and sampling), built op by op or
compiled (`--compiled`, `PIPPIN_COMPILE=1`), with its attention through the gather path
or (`--kernel`) through the paged kernel, one op standing in for the kernel where CUDA is
absent (what the kernel is: one custom op, two when split).

    python3 bench/gpu/step_nodes.py MODEL --kernel --compiled
"""

from __future__ import annotations

import argparse
import os
import random
import re
import sys
import tempfile
from pathlib import Path
from typing import Any

import checkout  # noqa: F401  (src/ on the path, pippin imported before MLX)


def nodes(arrays: list[Any]) -> int:
    """Operations in the graph that computes `arrays` (inputs and constants excluded)."""
    import mlx.core as mx

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *arrays)
        return len(re.findall(r"shape=rectangle", Path(f.name).read_text()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--context", type=int, default=300, help="prompt tokens before the step")
    ap.add_argument("--kernel", action="store_true", help="attention through the paged kernel")
    ap.add_argument("--compiled", action="store_true", help="the compiled decode step")
    args = ap.parse_args()
    if args.compiled:
        os.environ["PIPPIN_COMPILE"] = "1"

    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    import pippin.engine.core as core_module
    from pippin.bench.inproc import bare_core, drive, sampled
    from pippin.kernels import device, paged_attention
    from pippin.store.loader import load_model

    model = load_model(str(args.model)).model
    rng = random.Random(0)
    prompt = [rng.randrange(100, 1000) for _ in range(args.context)]
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([prompt]), cache=cache))
    print(f"mlx-lm: {nodes([model(mx.array([[5]]), cache=cache)])} nodes")

    if args.kernel and not device.on_cuda():
        paged_attention.force_reference = True
        paged_attention.reference_decode_attention = lambda q, *a, **k: q * 1.0
    core = bare_core(model, [prompt], 8)
    seen: list[int] = []
    launch = mx.async_eval

    def counted(*groups: Any) -> None:
        flat = [a for g in groups for a in (g if isinstance(g, list | tuple) else [g])]
        seen.append(nodes([a for a in flat if isinstance(a, mx.array)]))
        launch(*groups)

    core_module.mx.async_eval = counted
    drive(core, sampled([prompt], 6), untimed_prefill=True, keep=False)
    how = ("compiled" if args.compiled else "op by op") + (
        ", paged kernel" if core.runner.paged_kernel else ", gather path"
    )
    print(f"pippin ({how}): {seen[-1]} nodes (the last three steps: {seen[-3:]})")
    if args.kernel and not core.runner.paged_kernel:
        print("the kernel was not taken: see paged_attention.enabled_for", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
