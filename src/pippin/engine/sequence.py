"""One generated sequence (a request with n > 1 has n of them)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from pippin.engine.block_manager import BlockTable
from pippin.engine.types import FinishReason, SamplingParams, TokenLogprob
from pippin.vision.inputs import SeqMedia


class Think(enum.Enum):
    """Where a sequence with a reasoning budget is: the section may still open (it only
    opens at the start), is open, or is over (or never opened)."""

    BEFORE = "before"
    INSIDE = "inside"
    AFTER = "after"


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class ThinkState:
    """A reasoning budget's progress (for requests with `params.thinking`)."""

    phase: Think = Think.BEFORE
    count: int = 0  # tokens spent inside the section
    # The section's last tokens: it ends when they are its whole end marker (a marker of
    # several tokens ends only when all of them came, in order).
    tail: list[int] = field(default_factory=list)
    # Tokens the next steps must produce: the end marker, once the budget is spent.
    forced: list[int] = field(default_factory=list)


@dataclass
class Unsent:
    """Output recorded since the sequence's last `CompletionOutput`, not yet handed out."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    def take(self) -> tuple[list[int], list[TokenLogprob]]:
        out = self.token_ids, self.logprobs
        self.token_ids, self.logprobs = [], []
        return out


@dataclass(eq=False)
class Sequence:
    seq_id: int
    request_id: str
    index: int  # which of the request's n sequences
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    table: BlockTable = field(default_factory=BlockTable)
    # Tokens whose KV is in the pool (prompt first, then generated ones).
    num_computed: int = 0
    num_cached: int = 0  # prompt tokens served from the prefix cache at admission
    # A sibling (same request) whose prefill must finish before this one is admitted,
    # so this one finds the prompt's blocks in the prefix cache.
    wait_for: Sequence | None = None
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_preemptions: int = 0
    # Steps that raised while it ran (`EngineCore.recover`); at `STEP_ATTEMPTS` it fails.
    num_failed_steps: int = 0
    # Tokens sampled by steps still in flight: (that step's token array, row), oldest
    # first. The next step reads the newest lazily, so it can be built before the
    # previous one has finished.
    pending: list[tuple[Any, int]] = field(default_factory=list)
    # Per-feature state, one object each: output, reasoning budget, grammar, recurrent
    # layers, images.
    unsent: Unsent = field(default_factory=Unsent)
    # The output processor's own (detokenizer, stop-string matcher; `OutState`).
    out_state: Any = None
    think: ThinkState = field(default_factory=ThinkState)
    # Structured output: this sequence's grammar matcher (pippin.engine.grammar_masks).
    grammar: Any = None
    # Per-layer recurrent state for models whose layers keep more than KV (the runner's).
    recurrent: list[Any] | None = None
    # Its recurrent state at block boundaries, until stored as prefix-cache snapshots
    # (`pippin.engine.state_snapshots.Boundary`).
    boundaries: list[Any] = field(default_factory=list)
    # Images in the prompt (vision models): their keys and encoder outputs.
    media: SeqMedia | None = None
    # Its LoRA adapter's slot in the runner (0: none) and key (name and content digest,
    # which salts its blocks' keys: adapters never share KV).
    lora: int = 0
    lora_key: str | None = None
    # Prompt logprobs (`params.prompt_logprobs`, first sequence only): each prefill
    # chunk's scores, lazy (`pippin.engine.prompt_logprobs.Chunk`), until sent.
    prompt_chunks: list[Any] = field(default_factory=list)
    prompt_sent: bool = False

    @property
    def scores_prompt(self) -> bool:
        """Whether its prefill keeps every position's logprobs (and so skips the prefix
        cache: cached blocks have no logits)."""
        return self.params.prompt_logprobs is not None and self.index == 0 and not self.prompt_sent

    @property
    def all_ids(self) -> list[int]:
        """The tokens known on the host (in-flight ones are not)."""
        return self.prompt_ids + self.output_ids

    def ids(self, start: int, end: int) -> list[int]:
        """Known tokens in [start, end), without building the whole list as `all_ids` does."""
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        if start >= p:
            return self.output_ids[start - p : end - p]
        return self.prompt_ids[start:] + self.output_ids[: end - p]

    def keys(self, start: int, end: int) -> list[int]:
        """What block keys hash in [start, end): the tokens, with each image's positions
        as its content's key id, so different images never share KV."""
        if self.media is None:
            return self.ids(start, end)
        p = len(self.prompt_ids)
        if end <= p:
            return self.media.key_prompt[start:end]
        return self.media.key_prompt[start:] + self.ids(max(start, p), end)

    @property
    def all_keys(self) -> list[int]:
        return self.keys(0, self.num_known)

    @property
    def num_known(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + len(self.pending)

    @property
    def num_output(self) -> int:
        return len(self.output_ids) + len(self.pending)

    def exhausted(self, max_model_len: int) -> bool:
        """Whether the tokens in flight already end it (by length), so it needs no step."""
        return bool(self.pending) and (
            self.num_output >= self.params.max_tokens or self.num_tokens >= max_model_len
        )

    @property
    def is_prefilling(self) -> bool:
        # Everything but the last token is in the pool once prefill is done;
        # the last one is the input of the next decode step.
        return self.num_computed < self.num_tokens - 1

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
