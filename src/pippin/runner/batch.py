"""What the model runner reads of a scheduled sequence: the engine's `ScheduledSeq` and
`Sequence` satisfy these; the runner imports nothing of the engine."""

from __future__ import annotations

from typing import Any, Protocol


class BlockTable(Protocol):
    block_ids: list[int]


class RunSequence(Protocol):
    table: BlockTable
    # Tokens the step in flight is still sampling: (array, row) each, not yet known.
    pending: list[tuple[Any, int]]

    @property
    def num_known(self) -> int:
        """Tokens known on the host (prompt and sampled)."""

    recurrent: list[Any] | None  # recurrent layers' state, per layer (None: none yet)
    # A vision model's images (pippin.vision.inputs.SeqMedia), read by the model's
    # `step_inputs`; None for text.
    media: Any
    # Its LoRA adapter's slot in the runner's `LoraSet` (0: the base model alone); read
    # only once an adapter is loaded.
    lora: int

    def ids(self, start: int, end: int) -> list[int]: ...


class RunItem(Protocol):
    """One row of a model call: `length` tokens of `seq` from position `start`."""

    seq: RunSequence
    start: int
    length: int
    # Proposed tokens after the sequence's known ones, the row's last `len(draft)`
    # inputs (speculative decoding): the row then returns logits at every position
    # from its last known token on, 1 + len(draft) of them.
    draft: list[int]

    @property
    def samples(self) -> bool:
        """Whether the row's last position is sampled."""


def equal_length_groups(items: list[Any]) -> list[list[Any]]:
    """Rows (with a `length`) in calls of one length each, in order of first appearance:
    for models whose recurrent layers would take a shorter row's padding into its state."""
    groups: dict[int, list[Any]] = {}
    for it in items:
        groups.setdefault(it.length, []).append(it)
    return list(groups.values())


def length_groups(items: list[Any]) -> list[list[Any]]:
    """Rows (with a `length`) batched into calls of similar length, longest first, so
    that padding to a call's longest row wastes at most a quarter of its tokens."""
    groups: list[list[Any]] = []
    for p in sorted(items, key=lambda p: -p.length):
        g = groups[-1] if groups else None
        if g is not None:
            total = sum(x.length for x in g) + p.length
            if g[0].length * (len(g) + 1) <= 1.25 * total:
                g.append(p)
                continue
        groups.append([p])
    return groups
