"""Tensor parallelism on MLX's own distributed layer (`mx.distributed`).

Every rank holds a shard of the model, cut the way mlx-lm cuts it (`model.shard(group)`:
attention heads and MLP columns split, an all-sum after the output and down
projections), and a KV pool of its own heads only: the runner's probe reads each
layer's head count off the sharded model, so the pools are split by heads with no code
of their own.

Rank 0 runs the whole engine (scheduler, block manager, sampler); its runner is a
`DistributedRunner`, which sends every model call's plan (positions, lengths, block
tables, which rows sample: plain host data) to the other ranks before running it. They
run the same call in `run_worker` with zeros for token ids: the first op of every call
is an all-sum of the ids (`share_inputs`), in which rank 0 alone contributes, so decode
inputs stay lazy on rank 0 (the step in flight is still sampling them) and the ranks
see the same tokens. Every rank then builds the same graph, so its collectives run in
the same order everywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from pippin.runner.model_runner import ModelRunner, UnsupportedModelError

# The model types of mlx-lm 0.32.2 whose Model class has `shard()`.
SHARDABLE = (
    "deepseek_v2",
    "deepseek_v3",
    "deepseek_v32",
    "deepseek_v41",
    "exaone_moe",
    "glm4_moe",
    "glm4_moe_lite",
    "gpt_oss",
    "iquestloopcoder",
    "kimi_k25",
    "kimi_k3",
    "llama",
    "longcat_flash",
    "longcat_flash_ngram",
    "minimax",
    "minimax_m3_vl",
    "ministral3",
    "mistral4",
    "muse_spark",
    "qwen2",
    "qwen3",
    "qwen3_5",
    "qwen3_moe",
    "step3p5",
)


class RankLost(Exception):
    """Another rank is gone or stopped answering: the group cannot go on."""


def shard_model(model: nn.Module, config: dict[str, Any], group: mx.distributed.Group) -> None:
    """Shard `model` (loaded lazily: only this rank's part is then read) over `group`
    as mlx-lm does; a clear error for a model that cannot be."""
    n = group.size()
    kind = config.get("model_type", type(model).__module__.rsplit(".", 1)[-1])
    if not callable(getattr(model, "shard", None)):
        raise UnsupportedModelError(
            f"tensor parallelism needs a model family that mlx-lm can shard; {kind!r} "
            f"cannot be (mlx-lm shards: {', '.join(SHARDABLE)})"
        )
    text = config.get("text_config", config)
    for key in ("num_attention_heads", "num_key_value_heads"):
        heads = text.get(key)
        if isinstance(heads, int) and heads % n:
            raise UnsupportedModelError(
                f"--tensor-parallel {n} must divide the model's {key} ({heads})"
            )
    model.shard(group)


@dataclass
class Row:
    """A worker's stand-in for one scheduled row (`runner.batch.RunItem`): only the
    positions and the block table; token ids come from rank 0 through the all-sum."""

    start: int
    length: int
    block_ids: list[int]
    samples: bool
    pending: list[tuple[Any, int]] = field(default_factory=list)
    recurrent: list[Any] | None = None
    # RunItem's other fields: speculation and vision models do not run with tensor
    # parallelism yet (the CLI refuses the first), so a worker's rows have neither.
    draft: list[int] = field(default_factory=list)
    media: Any = None

    @property
    def seq(self) -> Row:
        return self

    @property
    def table(self) -> Row:
        return self

    @property
    def num_known(self) -> int:
        return self.start + self.length

    def ids(self, start: int, end: int) -> list[int]:
        return [0] * (end - start)


Plan = list[tuple[int, int, list[int], bool]]  # (start, length, block ids, samples) a row


class DistributedRunner(ModelRunner):
    """Rank 0's runner: each call's plan goes to the other ranks (`send`) first."""

    def __init__(
        self,
        model: nn.Module,
        block_size: int,
        kv_bits: int | None = None,
        kv_group_size: int = 64,
        kernels: Any = None,
        *,
        group: mx.distributed.Group,
        send: Callable[[tuple[Any, ...]], None],
    ) -> None:
        self.group = group
        self.send = send
        super().__init__(model, block_size, kv_bits, kv_group_size, kernels)
        if self.has_state_layers:
            # Their per-sequence state would have to follow each sequence on every rank.
            raise UnsupportedModelError(
                "tensor parallelism does not run models with recurrent layers yet"
            )

    def share_inputs(self, inputs: mx.array) -> mx.array:
        return mx.distributed.all_sum(inputs, group=self.group)

    def allocate(self, num_blocks: int) -> None:
        self.send(("allocate", num_blocks))
        super().allocate(num_blocks)

    def forward(self, items: list[Any]) -> mx.array | None:
        plan: Plan = [
            (it.start, it.length, list(it.seq.table.block_ids), bool(it.samples)) for it in items
        ]
        self.send(("forward", plan))
        return super().forward(items)

    def reset_pools(self, num_blocks: int) -> None:
        # A failed step may have run some collectives on some ranks only: the group's
        # order of collectives is lost, so it cannot go on. The engine process ends and
        # is started again with every rank.
        raise RankLost("a tensor-parallel step failed; the ranks must start again")

    def read_blocks(self, block_ids: list[int]) -> list[mx.array]:
        raise RankLost("the SSD tier does not run with tensor parallelism yet")

    def write_blocks(self, block_ids: list[int], parts: list[mx.array]) -> None:
        raise RankLost("the SSD tier does not run with tensor parallelism yet")


class WorkerRunner(ModelRunner):
    """A worker rank's runner: token ids come from rank 0 through the all-sum."""

    def __init__(self, *args: Any, group: mx.distributed.Group, **kwargs: Any) -> None:
        self.group = group
        super().__init__(*args, **kwargs)

    def share_inputs(self, inputs: mx.array) -> mx.array:
        return mx.distributed.all_sum(mx.zeros_like(inputs), group=self.group)

    def run(self, plan: Plan) -> None:
        """Run one model call of rank 0's and wait for it (its collectives included)."""
        rows = [Row(s, n, ids, samples) for s, n, ids, samples in plan]
        logits = self.forward(rows)
        mx.eval([] if logits is None else logits, self.arrays_to_eval(rows))


def run_worker(
    runner: WorkerRunner, receive: Callable[[], tuple[Any, ...]], done: Callable[[], None]
) -> None:
    """A worker rank's loop: run what rank 0 sends until it says stop; `done` after each
    model call (rank 0's watchdog counts them)."""
    while True:
        msg = receive()
        kind = msg[0]
        if kind == "forward":
            runner.run(msg[1])
            done()
        elif kind == "allocate":
            runner.allocate(msg[1])
        elif kind == "stop":
            return
        else:
            raise ValueError(f"unknown message from rank 0: {kind!r}")
