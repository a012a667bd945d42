"""The output processor alone, with a small byte-level BPE vocabulary: text deltas, stop
strings and tokens, finish reasons, special tokens and reasoning budgets."""

from __future__ import annotations

import copy

import pytest
from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer

from pippin.engine.output_processor import OutputProcessor
from pippin.engine.sequence import Sequence, Think
from pippin.engine.types import SamplingParams, ThinkingBudget, TokenLogprob

# Byte-level BPE spelling: "Ġ" is a space; "Ã" "©" are the two bytes of "é".
VOCAB = ["<eos>", "Hello", "Ġworld", "ĠST", "OP", "!", "Ġ", "Ã", "©", "<think>", "</think>"]
TOK = {t: i for i, t in enumerate(VOCAB)}
EOS, THINK, END_THINK = TOK["<eos>"], TOK["<think>"], TOK["</think>"]


class _Tokenizer:
    """What the processor reads of mlx-lm's `TokenizerWrapper`."""

    all_special_ids = [EOS, THINK, END_THINK]

    def __init__(self) -> None:
        self._detok = BPEStreamingDetokenizer(self)

    def __len__(self) -> int:
        return len(VOCAB)

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [VOCAB[i] for i in ids]

    @property
    def detokenizer(self) -> BPEStreamingDetokenizer:
        d = copy.copy(self._detok)  # one per sequence, as mlx-lm hands them out
        d.reset()
        return d


def _setup(max_model_len: int = 100, **params) -> tuple[OutputProcessor, Sequence]:
    proc = OutputProcessor(_Tokenizer(), {EOS}, max_model_len)
    params.setdefault("max_tokens", 50)
    seq = Sequence(0, "r", 0, [1, 2], SamplingParams(**params))
    proc.init(seq)
    return proc, seq


def _feed(proc: OutputProcessor, seq: Sequence, tokens: list[str]) -> list[str]:
    """Each token's text delta, taken after it as the engine does each step."""
    deltas = []
    for t in tokens:
        assert seq.finish_reason is None, "fed past the end"
        proc.append(seq, TOK[t], None)
        deltas.append(proc.take_text(seq))
    return deltas


def test_text_streams_token_by_token_keeping_a_leading_space() -> None:
    proc, seq = _setup()
    # mlx-lm drops a first token's leading space; a completion keeps it, as OpenAI's do.
    assert _feed(proc, seq, ["Ġworld", "!", "Ġworld"]) == [" world", "!", " world"]
    assert seq.finish_reason is None


def test_text_the_detokenizer_holds_is_flushed_at_the_end() -> None:
    proc, seq = _setup(max_tokens=2)
    # A lone space waits for the next token (which might merge with it); none comes.
    assert _feed(proc, seq, ["Hello", "Ġ"]) == ["Hello", " "]
    assert seq.finish_reason == "length"


def test_a_character_split_across_tokens_is_sent_whole() -> None:
    proc, seq = _setup()
    assert _feed(proc, seq, ["Hello", "Ã", "©", "!"]) == ["Hello", "", "é", "!"]


def test_a_stop_string_across_tokens_ends_the_text_before_it() -> None:
    proc, seq = _setup(stop=["STOP"])
    deltas = _feed(proc, seq, ["Hello", "ĠST", "OP"])
    # "Hello" could end in a stop string's start: at most len("STOP") - 1 chars wait.
    assert deltas == ["He", "llo", " "]
    assert "".join(deltas) == "Hello "
    assert (seq.finish_reason, seq.stop_reason) == ("stop", "STOP")
    assert seq.output_ids == [TOK["Hello"], TOK["ĠST"], TOK["OP"]]  # the tokens all count


def test_held_back_text_is_released_once_it_cannot_be_a_stop() -> None:
    proc, seq = _setup(stop=["STOP"], max_tokens=4)
    deltas = _feed(proc, seq, ["Hello", "ĠST", "!", "Ġworld"])
    assert "".join(deltas) == "Hello ST! world"
    assert seq.finish_reason == "length" and seq.stop_reason is None


def test_the_earliest_of_several_stop_strings_wins() -> None:
    proc, seq = _setup(stop=["orld", " wo"])
    deltas = _feed(proc, seq, ["Hello", "Ġworld"])  # both in "Hello world"
    assert "".join(deltas) == "Hello" and seq.stop_reason == " wo"


def test_stop_strings_wait_for_min_tokens() -> None:
    proc, seq = _setup(stop=["Hello"], min_tokens=2)
    _feed(proc, seq, ["Hello"])
    assert seq.finish_reason is None
    _feed(proc, seq, ["!"])
    assert seq.finish_reason == "stop"  # found again, once output may end


def test_a_stop_token_ends_without_its_text() -> None:
    proc, seq = _setup(stop_token_ids=[TOK["!"]])
    deltas = _feed(proc, seq, ["Hello", "!"])
    assert "".join(deltas) == "Hello"
    assert (seq.finish_reason, seq.stop_reason) == ("stop", TOK["!"])
    assert seq.unsent.token_ids == [TOK["Hello"], TOK["!"]]


def test_eos_ends_unless_ignored_or_too_early() -> None:
    proc, seq = _setup()
    assert _feed(proc, seq, ["Hello", "<eos>"]) == ["Hello", ""]
    assert (seq.finish_reason, seq.stop_reason) == ("stop", None)

    proc, seq = _setup(ignore_eos=True)
    _feed(proc, seq, ["<eos>", "<eos>"])
    assert seq.finish_reason is None

    proc, seq = _setup(min_tokens=2)
    _feed(proc, seq, ["<eos>"])
    assert seq.finish_reason is None
    _feed(proc, seq, ["<eos>"])
    assert seq.finish_reason == "stop"


def test_length_ends_at_max_tokens_or_the_context() -> None:
    proc, seq = _setup(max_tokens=2)
    _feed(proc, seq, ["Hello", "!"])
    assert seq.finish_reason == "length"
    proc, seq = _setup(max_model_len=4)  # the prompt has 2 tokens
    _feed(proc, seq, ["Hello"])
    assert seq.finish_reason is None
    _feed(proc, seq, ["!"])
    assert seq.finish_reason == "length"


def test_special_tokens_are_skipped_unless_kept_or_asked_for() -> None:
    proc, seq = _setup()
    assert "".join(_feed(proc, seq, ["<think>", "Hello"])) == "Hello"
    proc, seq = _setup(keep_special_ids=frozenset({THINK}))
    assert "".join(_feed(proc, seq, ["<think>", "Hello"])) == "<think>Hello"
    proc, seq = _setup(skip_special_tokens=False)
    assert "".join(_feed(proc, seq, ["</think>", "Hello"])) == "</think>Hello"


def test_unsent_tokens_and_logprobs_are_handed_out_once() -> None:
    proc, seq = _setup(logprobs=True)
    lps = [TokenLogprob(TOK["Hello"], -0.5), TokenLogprob(TOK["!"], -1.5)]
    proc.append(seq, TOK["Hello"], lps[0])
    proc.append(seq, TOK["!"], lps[1])
    assert seq.unsent.take() == ([TOK["Hello"], TOK["!"]], lps)
    assert seq.unsent.take() == ([], [])
    assert seq.output_ids == [TOK["Hello"], TOK["!"]]


# -- reasoning budgets ----------------------------------------------------------------
def _budget(budget: int, *, open: bool = False, end: tuple[int, ...] = (END_THINK,)):
    return ThinkingBudget(budget, end, start_id=THINK, open=open)


def test_a_spent_reasoning_budget_forces_the_end_marker() -> None:
    proc, seq = _setup(thinking=_budget(2))
    assert seq.think.phase is Think.BEFORE
    _feed(proc, seq, ["<think>"])
    assert seq.think.phase is Think.INSIDE and seq.think.forced == []
    _feed(proc, seq, ["Hello", "!"])
    assert seq.think.count == 2 and seq.think.forced == [END_THINK]
    _feed(proc, seq, ["</think>"])
    assert seq.think.phase is Think.AFTER and seq.think.forced == []


def test_the_model_may_end_its_reasoning_within_budget() -> None:
    proc, seq = _setup(thinking=_budget(5))
    _feed(proc, seq, ["<think>", "Hello", "</think>", "Hello", "!", "!", "!", "!"])
    assert seq.think.phase is Think.AFTER and seq.think.forced == []


def test_reasoning_opens_only_at_the_start() -> None:
    proc, seq = _setup(thinking=_budget(1))
    _feed(proc, seq, ["Hello", "<think>", "!", "!"])
    assert seq.think.phase is Think.AFTER and seq.think.forced == []


def test_an_open_prompt_or_zero_budget_is_inside_from_the_start() -> None:
    _, seq = _setup(thinking=_budget(3, open=True))
    assert seq.think.phase is Think.INSIDE and seq.think.forced == []
    _, seq = _setup(thinking=_budget(0, open=True))
    assert seq.think.forced == [END_THINK]


def test_an_end_marker_of_several_tokens_ends_only_when_whole() -> None:
    end = (TOK["OP"], END_THINK)
    proc, seq = _setup(thinking=_budget(2, open=True, end=end))
    _feed(proc, seq, ["Hello", "!"])
    assert seq.think.forced == list(end)
    _feed(proc, seq, ["OP"])
    assert seq.think.phase is Think.INSIDE and seq.think.forced == [END_THINK]
    _feed(proc, seq, ["</think>"])
    assert seq.think.phase is Think.AFTER


def test_a_marker_the_model_completes_itself_stops_the_forcing() -> None:
    end = (TOK["OP"], END_THINK)
    proc, seq = _setup(thinking=_budget(2, open=True, end=end))
    _feed(proc, seq, ["!", "OP"])  # the budget is spent as the model starts the marker
    assert seq.think.forced == list(end)
    _feed(proc, seq, ["</think>"])
    assert seq.think.phase is Think.AFTER and seq.think.forced == []


@pytest.mark.parametrize("tokens", [["</think>"], ["OP", "Hello", "</think>"]])
def test_a_partial_marker_does_not_end_reasoning(tokens: list[str]) -> None:
    proc, seq = _setup(thinking=_budget(9, open=True, end=(TOK["OP"], END_THINK)))
    _feed(proc, seq, tokens)
    assert seq.think.phase is Think.INSIDE
