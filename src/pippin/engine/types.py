"""Plain data passed between the HTTP front, the engine and its parts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from pippin.engine.constraint import Constraint
    from pippin.vision.inputs import MultiModal

FinishReason = Literal["stop", "length", "abort", "error"]


class EngineError(Exception):
    """A request the engine cannot take (e.g. its prompt does not fit)."""


@dataclass
class SamplingParams:
    """Per-request generation settings, already validated by the front."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 means off
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0  # how many alternatives per token, when logprobs is on
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    n: int = 1
    skip_special_tokens: bool = True
    # Special tokens that still reach the text: the markers the output parsers read.
    keep_special_ids: frozenset[int] = frozenset()
    thinking: ThinkingBudget | None = None
    # Structured output: a grammar the output must follow (token masks while sampling).
    constraint: Constraint | None = None
    # Requests with different salts never share KV (vLLM's cache_salt).
    cache_salt: str | None = None
    # A vision model's images in the prompt (their spans, pixels, content keys).
    mm: MultiModal | None = None
    # The LoRA adapter the request runs with, by the name it was loaded under
    # (`EngineClient.add_lora`); None: the base model alone.
    lora: str | None = None
    # Under --scheduling-policy priority: lower values are served first (vLLM's meaning).
    priority: int = 0
    # vLLM's prompt_logprobs: each prompt token's logprob and the top k alternatives
    # (the prompt is then computed whole, never served from the prefix cache).
    prompt_logprobs: int | None = None
    # vLLM's allowed_token_ids: only these may be sampled (empty: any).
    allowed_token_ids: frozenset[int] = frozenset()
    # vLLM's bad_words, tokenized: a sequence's last token is banned where the output
    # ends with the ones before it.
    bad_words_ids: list[list[int]] = field(default_factory=list)
    # An output without tokens when the request is first scheduled, carrying its prompt's
    # cached tokens before its prefill runs (the Anthropic API's `message_start`).
    announce: bool = False


@dataclass(frozen=True)
class ThinkingBudget:
    """Stop a reasoning section after `budget` tokens by writing its end marker."""

    budget: int
    end_ids: tuple[int, ...]  # forced once the budget is spent; the last one ends it
    start_id: int | None = None  # opens the section when generated first
    open: bool = False  # the prompt already opened the section


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)
    rank: int | None = None  # 1 + how many tokens were likelier (prompt logprobs)


@dataclass
class CompletionOutput:
    """What one of the `n` sequences of a request produced since the last output."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None
    # The stop string or stop token id that ended the sequence, if any.
    stop_reason: str | int | None = None


@dataclass
class RequestOutput:
    request_id: str
    outputs: list[CompletionOutput]
    prompt_tokens: int
    cached_tokens: int
    finished: bool  # every sequence of the request has finished
    error: str | None = None  # set when the engine failed this request
    # Why, when the front ended it rather than the engine: "timeout" (--request-timeout)
    # or "slow_reader" (its client left too much output unread).
    error_kind: str | None = None
    # With `SamplingParams.prompt_logprobs`, on the request's first output: one per
    # prompt token, None for the first (nothing precedes it).
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def then(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by `later`, as one delta (for a reader that fell behind)."""
        by_index = {c.index: c for c in self.outputs}
        for c in later.outputs:
            prev = by_index.get(c.index)
            if prev is None:
                by_index[c.index] = c
                continue
            logprobs = None
            if prev.logprobs is not None or c.logprobs is not None:
                logprobs = (prev.logprobs or []) + (c.logprobs or [])
            by_index[c.index] = CompletionOutput(
                c.index,
                prev.token_ids + c.token_ids,
                prev.text + c.text,
                logprobs,
                c.finish_reason or prev.finish_reason,
                c.stop_reason if c.finish_reason else prev.stop_reason,
            )
        return RequestOutput(
            self.request_id,
            [by_index[i] for i in sorted(by_index)],
            later.prompt_tokens,
            later.cached_tokens,
            later.finished,
            later.error or self.error,
            later.error_kind or self.error_kind,
            self.prompt_logprobs or later.prompt_logprobs,
        )
