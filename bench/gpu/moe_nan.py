"""Where a tiny quantised MoE's forward first gives NaN or inf, module by module: the
models of `test_moe_model_takes_the_grouped_kernel_and_keeps_its_logits`
(tests/kernels/test_quant_matmul.py, `MOE_MODELS`), whose MLX bf16 forward (no pippin patch)
gave NaN on an H100 on 2026-12-07 and is finite on the CPU. For each model, dtype and
input shape of the test: the first modules whose output is not finite, in call order.

    python3 bench/gpu/moe_nan.py            # on the GPU machine, PYTHONPATH as the scripts set
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from pathlib import Path

import checkout  # src/ on the path, MLX settings
import mlx.core as mx
import mlx.nn as nn

REPO_ROOT = checkout.REPO_ROOT

sys.path.insert(0, str(REPO_ROOT / "tests"))
import support.tiny_models as tiny  # noqa: E402


def _test_module():  # type: ignore[no-untyped-def]
    path = REPO_ROOT / "tests" / "kernels" / "test_quant_matmul.py"
    spec = importlib.util.spec_from_file_location("test_quant_matmul", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def traced(model: nn.Module, log: list[tuple[str, str, int, int]]) -> list[tuple[type, object]]:
    """Each module class of `model` records (name, class, non-finite, size) per call."""
    names = {id(m): n for n, m in model.named_modules()}
    undo = []
    for cls in {type(m) for _, m in model.named_modules()}:
        original = cls.__call__

        def call(self, *args, __original=original, **kwargs):  # type: ignore[no-untyped-def]
            out = __original(self, *args, **kwargs)
            first = out[0] if isinstance(out, tuple) else out
            if isinstance(first, mx.array) and mx.issubdtype(first.dtype, mx.floating):
                bad = int((~mx.isfinite(first)).sum().item())
                log.append((names.get(id(self), "?"), type(self).__name__, bad, first.size))
            return out

        cls.__call__ = call
        undo.append((cls, original))
    return undo


def main() -> int:
    t = _test_module()
    tiny.set_cache_root(Path(tempfile.mkdtemp(prefix="moe-nan-")))
    print("device", mx.default_device())
    for arch in t.MOE_MODELS:
        model = t.quantised_moe(lambda a, **o: tiny.get_tiny_model(a, **o), arch)
        vocab = model.args.vocab_size
        for shape in ((5, 1), (1, 24)):
            tokens = mx.random.randint(3, vocab, shape, key=mx.random.key(2))
            for dtype in (mx.float32, mx.bfloat16):
                model.set_dtype(dtype)
                log: list[tuple[str, str, int, int]] = []
                undo = traced(model, log)
                try:
                    model(tokens)
                finally:
                    for cls, original in undo:
                        cls.__call__ = original
                bad = [row for row in log if row[2]]
                print(f"{arch} {shape} {dtype}: {len(bad)} of {len(log)} outputs not finite")
                for name, cls, n, size in bad[:6]:
                    print(f"    {name or '(model)'} {cls}: {n} of {size}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
