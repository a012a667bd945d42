"""All of pippin's changes to mlx-lm's model code go through `kernels.patches`: one switch
turns them all off, and `undo` takes them all back."""

from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
from support.engine_runs import engine_config, loaded_model, random_prompts, run_to_end

from pippin.engine.core import EngineCore
from pippin.engine.types import SamplingParams
from pippin.kernels import fused_proj, patches
from pippin.kernels.config import KernelConfig


def _changes(model) -> list[str]:  # type: ignore[no-untyped-def]
    """Every trace of a patch on `model` and on its mlx-lm modules."""
    found = []
    for name, m in model.named_modules():
        if hasattr(type(m), "_pippin_base"):
            found.append(f"{name}: class {type(m).__name__}")
        if isinstance(m, fused_proj.Part) or any(g in m for g, _ in fused_proj.GROUPS):
            found.append(f"{name}: fused projection")
    for mod in {type(m).__module__ for _, m in model.named_modules()}:
        fn = getattr(sys.modules[mod], "scaled_dot_product_attention", None)
        if hasattr(fn, "_pippin_original"):
            found.append(f"{mod}: routed attention")
    return found


def _greedy(loaded, kernels: KernelConfig) -> dict:  # type: ignore[no-untyped-def]
    core = EngineCore(loaded, engine_config(kernels=kernels))
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(random_prompts(loaded.model.args.vocab_size, 3, seed=2)):
        core.add_request(str(i), p, params)
    return {rid: r["ids"][0] for rid, r in run_to_end(core).items()}


def test_switch_off_leaves_mlx_lm_untouched_and_decodes_the_same(tiny_models) -> None:
    loaded = loaded_model(tiny_models("qwen3"))
    # Off, nothing is changed, and what an earlier engine in this process changed (mlx-lm's
    # modules are shared) is taken back.
    patches.route_attention(loaded.model, "composed")
    off = _greedy(loaded, KernelConfig(enabled=False))
    assert _changes(loaded.model) == []
    # Composed prefill attention routes attention on any device: every patch but the CUDA
    # kernels' own is made.
    on = _greedy(loaded, KernelConfig(prefill_attention="composed"))
    made = _changes(loaded.model)
    assert any("fused projection" in c for c in made), made
    assert any("routed attention" in c for c in made), made
    assert any("class" in c for c in made), made  # the final norm's head rows
    assert on == off
    patches.undo(loaded.model)
    assert _changes(loaded.model) == []


def test_undo_gives_back_the_same_logits(tiny_models) -> None:
    loaded = loaded_model(tiny_models("llama"))
    model = loaded.model
    tokens = mx.array([random_prompts(model.args.vocab_size, 1, seed=9)[0][:12]])
    before = np.array(model(tokens))
    kernels = KernelConfig(prefill_attention="composed")
    patched = patches.apply(model, kernels, {}, {}, None)
    assert patched.head is not None and _changes(model)
    patches.undo(model)
    assert _changes(model) == []
    assert np.allclose(np.array(model(tokens)), before, atol=1e-5)
