"""Fill-in-the-middle prompts: code before and after a hole, in the model's own FIM tokens.

Code models trained to fill a hole read `<prefix> before <suffix> after <middle>` and
write the middle. The families differ only in the tokens' spelling, so the format is
found by which spelling the tokenizer has. The prompt is built from token ids (each
special token by its id, each text encoded alone), so nothing depends on how a tokenizer
finds special tokens in a string (CodeLlama's sentencepiece spelling). No chat template:
FIM is a raw completion.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FimFormat:
    prefix: str
    suffix: str
    middle: str
    # Tokens that end the middle (besides the model's end of sequence), where they exist.
    stops: tuple[str, ...] = ()


FORMATS = (
    # Qwen2.5-Coder, Qwen3-Coder.
    FimFormat(
        "<|fim_prefix|>",
        "<|fim_suffix|>",
        "<|fim_middle|>",
        ("<|endoftext|>", "<|fim_pad|>", "<|file_sep|>", "<|repo_name|>", "<|im_end|>"),
    ),
    # StarCoder, StarCoder2, SantaCoder.
    FimFormat("<fim_prefix>", "<fim_suffix>", "<fim_middle>", ("<|endoftext|>", "<file_sep>")),
    # DeepSeek-Coder.
    FimFormat("<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>", ("<|EOT|>",)),
    # CodeLlama (its sentencepiece spelling).
    FimFormat("▁<PRE>", "▁<SUF>", "▁<MID>", ("▁<EOT>",)),
)


def _token_id(tokenizer: Any, token: str) -> int | None:
    lookup = getattr(tokenizer, "convert_tokens_to_ids", None)
    if lookup is None:  # not a Hugging Face tokenizer: no FIM tokens known
        return None
    tid = lookup(token)
    if isinstance(tid, int) and tid != getattr(tokenizer, "unk_token_id", None):
        return tid
    return None


def fim_format(tokenizer: Any) -> FimFormat | None:
    """The FIM format whose three tokens the tokenizer has, if any."""
    for fmt in FORMATS:
        if all(_token_id(tokenizer, t) is not None for t in (fmt.prefix, fmt.suffix, fmt.middle)):
            return fmt
    return None


@dataclass
class FimPrompt:
    ids: list[int]
    stop_token_ids: list[int]


def fim_prompt(
    tokenizer: Any, fmt: FimFormat, before: str, after: str, bos: bool = True
) -> FimPrompt:
    """The prompt (prefix-suffix-middle order, after the tokenizer's BOS if it adds one
    and `bos`) and the ids that end the middle."""

    def ids(token: str) -> int:
        tid = _token_id(tokenizer, token)
        assert tid is not None
        return tid

    def text(s: str) -> list[int]:
        return list(tokenizer.encode(s, add_special_tokens=False)) if s else []

    head = list(tokenizer.encode("", add_special_tokens=True)) if bos else []
    prompt = [
        *head,
        ids(fmt.prefix),
        *text(before),
        ids(fmt.suffix),
        *text(after),
        ids(fmt.middle),
    ]
    stops = [tid for t in fmt.stops if (tid := _token_id(tokenizer, t)) is not None]
    return FimPrompt(prompt, stops)
