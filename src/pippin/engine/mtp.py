"""Speculative decoding with the checkpoint's own multi-token-prediction (MTP) layers
(`--speculative-config '{"method": "mtp", ...}'`, vLLM's spelling; its older
`qwen3_next_mtp` and `deepseek_mtp` are taken too).

The MTP head (`pippin.runner.mtp_head`) proposes as a draft model does
(`pippin.engine.draft_model`, whose proposing, drawing, KV pool and bookkeeping it
shares), but its input at position t is the next token tok[t + 1] and the target's last
hidden state h[t]. Those exist only while the target computes t, so the target's runner
keeps each call's hidden states (`ModelRunner.keep_hidden`) and `saw` holds, per
sequence, those of the positions the head has not consumed yet (lazily: an array slice
per call). A verify call's positions past the kept proposals are cut by the verdict
(`settle`), never consumed.

So the head lags the target by one position: in a speculative step (every token known)
it catches up over the positions [its frontier, last token) from the held states, its
last position giving the first proposal (for the token after the last one), then feeds
each further proposal back with its own output hidden state as h, as vLLM does. The KV
of those fed positions is always dropped after the verdict (`keeps_fed`), kept or not:
they are computed again next step from the target's own hidden states, so the head's KV
always holds positions fed with the target's.

Its position i stands for the target's position `origin + i`. A sequence whose hidden
states were not all seen (a prefix-cache hit skips computing the cached positions; a
step above `disable_by_batch_size` drops what it would hold) starts its head over at the
first position seen next: RoPE attention depends only on relative positions, so the
head then attends over the positions from there, a shorter context but the same
computation. Exactness never depends on the head: the rejection sampler
(`pippin.engine.rejection`) keeps the output distribution exact with its q.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import mlx.core as mx

from pippin.engine.block_manager import BlockManager
from pippin.engine.config import SpeculativeConfig
from pippin.engine.draft_model import DraftModel, _DraftSeq, _Row
from pippin.runner import mtp_head
from pippin.runner.model_runner import ModelRunner
from pippin.store.loaded import LoadedModel, ModelLoadError
from pippin.store.loader import read_json, resolve_spec

if TYPE_CHECKING:
    from pippin.engine.sequence import Sequence


@dataclass(eq=False)
class _MtpSeq(_DraftSeq):
    """A sequence as the head runs it: its position i is the target's `origin + i` (its
    input the token after that); `held` the target's hidden states of the positions
    from `origin + computed` on, in order, not yet consumed."""

    origin: int = 0
    held: list[mx.array] = field(default_factory=list)

    @property
    def held_end(self) -> int:
        """The target position after the last one held (from a proposal to its verdict,
        `computed` counts the fed proposals too: `base` is the head's frontier)."""
        frontier = self.base if self.k else self.computed
        return self.origin + frontier + sum(h.shape[0] for h in self.held)


class MtpProposer(DraftModel):
    keeps_fed = False

    def __init__(
        self,
        config: SpeculativeConfig,
        target: LoadedModel,
        runner: ModelRunner,
        *,
        block_size: int,
        budget: int,
    ) -> None:
        """The head of `target`'s checkpoint, run beside `runner` (the target's, which
        is made to keep its hidden states). Its KV pool comes with `allocate`."""
        folder, _, _ = resolve_spec(target.source, None)
        if folder.suffix == ".gguf":
            raise ModelLoadError(
                "--speculative-config method 'mtp' needs the checkpoint's MTP layers; "
                "GGUF files do not carry them"
            )
        config_json = target.config or read_json(folder / "config.json")
        head = mtp_head.load(target.model, folder, config_json)
        runner.keep_hidden = True
        head_runner = ModelRunner(head, block_size, kernels=runner.kernels)
        head_runner.keep_hidden = True  # its own output feeds its next proposal
        self._setup(head_runner, target, block_size, budget)
        self.num_restarts = 0

    def _block_manager(self) -> BlockManager:
        # The head's KV depends on the target's hidden states, which a prefix hit does not
        # compute: no prefix cache.
        return BlockManager(self.num_blocks, self.block_size, False)

    def _get(self, seq_id: int) -> _MtpSeq | None:
        ms = self.seqs.get(seq_id)
        assert ms is None or isinstance(ms, _MtpSeq)
        return ms

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "spec_mtp_restarts": self.num_restarts}

    # -- the target's hidden states ------------------------------------------
    def saw(self, items: list[Any], hidden: mx.array) -> None:
        """A target call's rows (those that may speculate) and its final norm's output,
        [B, L, H]: each row's positions the head has not consumed are held."""
        for b, it in items:
            seq: Sequence = it.seq
            ms = self._get(seq.seq_id)
            if ms is None:
                ms = _MtpSeq(seq, origin=it.start, shift=it.start + 1)
                self.seqs[seq.seq_id] = ms
            end = ms.held_end
            if it.start > end:  # positions never seen: start over from here
                self._restart(ms, it.start)
                end = it.start
            skip = end - it.start  # positions seen before (a preempted sequence's)
            if skip < it.length:
                ms.held.append(hidden[b, skip : it.length])

    def drop(self, seqs: list[Sequence]) -> None:
        """Hold nothing for these sequences (too many running to speculate): their head
        starts over later."""
        for seq in seqs:
            if seq.seq_id in self.seqs:
                self.forget(seq.seq_id)
                self.num_restarts += 1

    def _restart(self, ms: _MtpSeq, origin: int) -> None:
        self.bm.free_table(ms.table)
        ms.origin, ms.shift, ms.computed, ms.held = origin, origin + 1, 0, []
        self.num_restarts += 1

    def settle(self, seq_id: int, kept: int) -> None:
        """As a draft's, and the hidden states of the verified positions past the kept
        proposals are cut."""
        super().settle(seq_id, kept)
        ms = self._get(seq_id)
        if ms is None:
            return
        excess = ms.held_end - ms.source.num_computed
        while excess > 0 and ms.held:
            n = ms.held[-1].shape[0]
            if n <= excess:
                ms.held.pop()
            else:
                ms.held[-1] = ms.held[-1][: n - excess]
            excess -= n

    # -- proposing (`DraftModel.propose`'s hooks) ----------------------------
    def _sequence(self, seq: Sequence) -> _DraftSeq | None:
        return self._get(seq.seq_id)  # None: no hidden states seen yet

    def _behind(self, ds: _DraftSeq) -> int:
        """Positions up to the one before the last token (whose hidden state the verify
        call computes), if every one of them is held."""
        assert isinstance(ds, _MtpSeq)
        last = ds.source.num_tokens - 1
        return last - ds.origin - ds.computed if ds.held_end == last else 0

    def _row(self, ds: _DraftSeq, length: int, samples: bool) -> _Row:
        assert isinstance(ds, _MtpSeq)
        held = ds.held[0] if len(ds.held) == 1 else mx.concatenate(ds.held)
        ds.held = [held[length:]] if held.shape[0] > length else []
        return _Row(ds, ds.computed, length, samples, hidden=held[:length])
