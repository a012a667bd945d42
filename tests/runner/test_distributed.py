"""Sharding for tensor parallelism (`runner/distributed.py`) in one process: which
models are refused, and what the kernel patches do to a sharded model."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx.nn.layers.distributed import AllToShardedLinear, ShardedToAllLinear

from pippin.kernels import patches
from pippin.kernels.config import KernelConfig
from pippin.runner.distributed import SHARDABLE, shard_model
from pippin.runner.model_runner import ModelRunner, UnsupportedModelError
from pippin.store.loader import load_model


def test_a_family_mlx_lm_cannot_shard_is_refused_by_name(
    tiny_models: Callable[..., Path],
) -> None:
    loaded = load_model(str(tiny_models("gemma3")), weights=False)
    with pytest.raises(UnsupportedModelError, match="'gemma3_text' cannot be.*llama.*qwen3"):
        shard_model(loaded.model, loaded.config, mx.distributed.init())
    assert "gemma3" not in SHARDABLE


def test_ranks_must_divide_the_heads(tiny_models: Callable[..., Path]) -> None:
    loaded = load_model(str(tiny_models("llama")), weights=False)  # 4 heads, 2 KV heads
    group = SimpleNamespace(size=lambda: 4)
    with pytest.raises(UnsupportedModelError, match="must divide the model's num_key_value"):
        shard_model(loaded.model, loaded.config, group)  # type: ignore[arg-type]


def test_sharded_layers_keep_mlx_lm_classes_and_the_kernels_leave_them(
    tiny_models: Callable[..., Path],
) -> None:
    """The fused projections (and the fused attention and layer kernels built on them)
    take exact `nn.Linear`s only: a sharded model keeps mlx-lm's sharded layers with
    their all-sums; the routed attention and the head rows read the sharded shapes."""
    loaded = load_model(str(tiny_models("llama")), weights=False)
    shard_model(loaded.model, loaded.config, mx.distributed.init())  # a group of one
    runner = ModelRunner(loaded.model, 16, kernels=KernelConfig())
    attn = loaded.model.model.layers[0].self_attn
    assert isinstance(attn.q_proj, AllToShardedLinear)
    assert isinstance(attn.o_proj, ShardedToAllLinear)
    assert patches.fuse_projections(loaded.model) == 0
    assert runner.specs[0].n_kv_heads == 2


def test_the_documented_list_is_mlx_lm_s() -> None:
    """`SHARDABLE` (which docs/deployment.md lists) is every model module of the
    installed mlx-lm whose Model has `shard()`."""
    import mlx_lm.models

    folder = Path(mlx_lm.models.__file__).parent
    found = {f.stem for f in folder.glob("*.py") if "def shard(" in f.read_text()}
    assert found == set(SHARDABLE)
