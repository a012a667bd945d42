"""Per-sequence output side: stop conditions, streaming detokenization, stop strings.

Stop strings are matched on the decoded text (so a stop split across tokens
still matches) and never reach the client: text that could be the start of a
stop string is held back until it is known not to be one. Work per token is
bounded by the longest stop string, not by the length of the output.
"""

from __future__ import annotations

from dataclasses import dataclass

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, StreamingDetokenizer

from pippin.engine.sequence import Sequence, Think
from pippin.engine.types import TokenLogprob


@dataclass
class OutState:
    detok: StreamingDetokenizer
    max_stop: int
    sent: int = 0  # characters of detok.text already handed out
    cut: int | None = None  # where a stop string starts, once found


def _keep(text: str) -> str:
    return text


class OutputProcessor:
    def __init__(self, tokenizer, eos_ids: set[int], max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.max_model_len = max_model_len
        self.special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])

    def init(self, seq: Sequence) -> None:
        stops = seq.params.stop
        longest = max((len(s) for s in stops), default=0)
        detok = self.tokenizer.detokenizer
        if isinstance(detok, BPEStreamingDetokenizer):
            # mlx-lm drops the first token's leading space; OpenAI keeps it
            # (a completion of "The capital of France is" starts with " Paris").
            detok._maybe_trim_space = _keep  # type: ignore[method-assign]
        seq.out_state = OutState(detok, longest)
        tb = seq.params.thinking
        if tb is not None and tb.open:
            self._enter_thinking(seq)

    @staticmethod
    def _enter_thinking(seq: Sequence) -> None:
        tb = seq.params.thinking
        assert tb is not None
        think = seq.think
        think.phase, think.count, think.tail = Think.INSIDE, 0, []
        if tb.budget <= 0:
            think.forced = list(tb.end_ids)

    def _track_thinking(self, seq: Sequence, token: int) -> None:
        tb = seq.params.thinking
        assert tb is not None
        think = seq.think
        if think.forced and token == think.forced[0]:
            think.forced.pop(0)
        if think.phase is Think.BEFORE:
            if token == tb.start_id:
                self._enter_thinking(seq)
            else:
                think.phase = Think.AFTER  # the section only opens at the start
        elif think.phase is Think.INSIDE:
            think.tail = (think.tail + [token])[-len(tb.end_ids) :]
            if tuple(think.tail) == tb.end_ids:
                think.phase, think.forced = Think.AFTER, []
                return
            think.count += 1
            if think.count >= tb.budget and not think.forced:
                think.forced = list(tb.end_ids)

    def append(self, seq: Sequence, token: int, logprob: TokenLogprob | None) -> None:
        """Record one sampled token and decide whether the sequence is done."""
        st: OutState = seq.out_state
        p = seq.params
        seq.output_ids.append(token)
        seq.unsent.token_ids.append(token)
        if p.thinking is not None and seq.think.phase is not Think.AFTER:
            self._track_thinking(seq, token)
        if logprob is not None:
            seq.unsent.logprobs.append(logprob)
        n_out = len(seq.output_ids)

        if token in p.stop_token_ids and n_out >= p.min_tokens:
            seq.finish_reason, seq.stop_reason = "stop", token
        elif token in self.eos_ids and not p.ignore_eos and n_out >= p.min_tokens:
            seq.finish_reason = "stop"
        else:
            if not (
                p.skip_special_tokens
                and token in self.special_ids
                and token not in p.keep_special_ids
            ):
                st.detok.add_token(token)
            if p.stop and n_out >= p.min_tokens and self._find_stop(seq, st):
                return
            if n_out >= p.max_tokens or seq.num_known >= self.max_model_len:
                seq.finish_reason = "length"

    def _find_stop(self, seq: Sequence, st: OutState) -> bool:
        text = st.detok.text
        # Only the tail can hold a new match: the rest was already checked.
        start = max(st.sent - st.max_stop, 0)
        best: tuple[int, str] | None = None
        for s in seq.params.stop:
            i = text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        st.cut = best[0]
        seq.finish_reason, seq.stop_reason = "stop", best[1]
        return True

    def take_text(self, seq: Sequence) -> str:
        """Text that is safe to send now."""
        st: OutState = seq.out_state
        if seq.finish_reason is not None and st.cut is None:
            st.detok.finalize()
        text = st.detok.text
        if st.cut is not None:
            end = st.cut
        elif seq.finish_reason is not None or not st.max_stop:
            end = len(text)
        else:
            end = len(text) - (st.max_stop - 1)
        if end <= st.sent:
            return ""
        out = text[st.sent : end]
        st.sent = end
        return out
