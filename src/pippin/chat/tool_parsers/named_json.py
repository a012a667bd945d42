"""Formats that write a function name, then its arguments as a raw JSON object.

DeepSeek V3 / R1 and V3.1, Kimi K2 and Functionary write markers, a name (sometimes
with a call id), then `{...}`. `NamedJsonParser` is the state machine they share:
text, an optional section of calls, the head up to the arguments (read by each
format's `_head`), the arguments (streamed with `JsonPrefix` as they are written),
and the tail after them. Mistral's new format reuses it (mistral.py).

The helpers below read the little grammars of call heads without ever deciding on
less text than the decision needs: each answers OK, NO, or MORE (the text so far
could still become OK), and a token is searched for within a fixed window, so where
the output was split never changes an answer.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import ClassVar

from pippin.chat.tool_parsers.base import ToolParser, find_marker, skip_ws
from pippin.chat.tool_parsers.json_prefix import JsonPrefix

OK, NO, MORE = "ok", "no", "more"
SKIP = "skip"  # a head that is neither a call nor text to give back (functionary's `all`)

NAME_STOP = " \t\r\n\"'<>{}[]"  # characters a function name never contains


def valid_name(name: str) -> bool:
    return bool(name) and not any(c in NAME_STOP for c in name)


def read_until(
    s: str, i: int, delims: Sequence[str], window: int, stop: str = ""
) -> tuple[str, str, str, int]:
    """(status, text, delim, j): `s[i:j]` is the text before the earliest delimiter.

    The delimiter must start within `window` characters of `i`, and no character of
    `stop` may come before it (`stop` must not hold the first character of a
    delimiter longer than one character: its partial start would stop the search).
    """
    longest = max(len(d) for d in delims)
    hit = find_marker(s[: i + window + longest], delims, i)
    end = hit[0] if hit is not None and hit[0] - i <= window else -1
    limit = end if end >= 0 else min(len(s), i + window)
    if stop and any(c in stop for c in s[i:limit]):
        return NO, "", "", i
    if end >= 0:
        assert hit is not None
        return OK, s[i:end], hit[1], end
    if len(s) - i >= window + longest:
        return NO, "", "", i
    return MORE, "", "", i


def expect(s: str, i: int, literal: str) -> tuple[str, int]:
    """`literal` after optional whitespace: (status, index after it)."""
    j = skip_ws(s, i)
    if s.startswith(literal, j):
        return OK, j + len(literal)
    return (MORE if literal.startswith(s[j:]) else NO), i


def optional(s: str, i: int, literal: str) -> tuple[str, int]:
    """`literal` if it is there (no whitespace skipped): (status, index after it)."""
    if s.startswith(literal, i):
        return OK, i + len(literal)
    return (MORE if literal.startswith(s[i:]) else OK), i


def peek(s: str, literals: Sequence[str]) -> tuple[str, str]:
    """Which of `literals` comes next after optional whitespace (nothing is consumed)."""
    rest = s[skip_ws(s) :]
    for lit in literals:
        if rest.startswith(lit):
            return OK, lit
    if any(lit.startswith(rest) for lit in literals):
        return MORE, ""
    return NO, ""


def object_start(s: str, i: int) -> tuple[str, int]:
    """The `{` that opens the arguments, after optional whitespace: (status, its index)."""
    j = skip_ws(s, i)
    if j == len(s):
        return MORE, i
    return (OK, j) if s[j] == "{" else (NO, i)


TEXT, SECTION, HEAD, ARGS, TAIL = range(5)


class NamedJsonParser(ToolParser):
    """Text, then `starts` + [section of] head + `{arguments}` + tail.

    With `section`, a start marker opens a section holding calls that each begin with
    `call_begin`, up to one of `section_ends`; without, each start marker opens one
    call. Subclasses read the head with `_head` and the tail with `_tail`.
    """

    starts: ClassVar[tuple[str, ...]] = ()
    section: ClassVar[bool] = False
    call_begin: ClassVar[str] = ""
    section_ends: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.state = TEXT
        self.marker = ""
        self.raw = ""  # consumed text to give back if the call turns out malformed
        self.call_raw = ""  # the open call's text before its arguments
        self.jp = JsonPrefix()
        self.args_text = ""
        self.args_sent = 0

    # --- format hooks --------------------------------------------------------

    def _head(self, s: str) -> tuple[str, str, str | None, int]:
        """(status, name, call id or None, index of the arguments' `{`)."""
        raise NotImplementedError

    def _tail(self, s: str) -> tuple[str, int]:
        """After the arguments: (status, characters consumed)."""
        return OK, 0

    # --- the state machine ---------------------------------------------------

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        """Advance one state; False when more text is needed (or none is left)."""
        if self.state == TEXT:
            m = self.scan_text(self.starts, final)
            if m is None:
                return False
            self.marker = self.raw = m
            self.state = SECTION if self.section else HEAD
            return True
        if self.state == SECTION:
            return self._section(final)
        if self.state == HEAD:
            return self._read_head(final)
        if self.state == ARGS:
            return self._read_args(final)
        status, n = self._tail(self.buf)
        if status == MORE and not final:
            return False
        if status == OK:
            self.buf = self.buf[n:]
            self.state = SECTION if self.section else TEXT
        elif status == MORE:
            self.buf = ""  # the output ended inside the closing markers
            self.state = TEXT
        else:
            self.state = TEXT  # no closing marker: what follows is text
        return True

    def _section(self, final: bool) -> bool:
        status, lit = peek(self.buf, (self.call_begin, *self.section_ends))
        if status == OK:
            j = skip_ws(self.buf) + len(lit)
            self.raw += self.buf[:j]
            self.buf = self.buf[j:]
            if lit == self.call_begin:
                self.state = HEAD
            else:
                self.raw = ""  # an empty section is dropped
                self.state = TEXT
            return True
        if status == MORE and not final:
            return False
        if status == MORE and not self.raw:
            self.buf = ""  # ended inside the markers after a call
            return False
        self.text(self.raw)
        self.raw = ""
        self.state = TEXT
        return True

    def _read_head(self, final: bool) -> bool:
        status, name, call_id, n = self._head(self.buf)
        if status == MORE and not final:
            return False
        if status == SKIP:
            self.buf = self.buf[n:]
        elif status == OK and self.known(name):
            self.call_raw = self.raw + self.buf[:n]
            self.buf = self.buf[n:]
            self.start_call(name, call_id)
            self.jp = JsonPrefix()
            self.args_text = ""
            self.args_sent = 0
            self.raw = ""
            self.state = ARGS
            return True
        else:
            self.text(self.raw)
        self.raw = ""
        self.state = TEXT
        return True

    def _read_args(self, final: bool) -> bool:
        n = self.jp.feed(self.buf)
        self.args_text += self.buf[:n]
        self.buf = self.buf[n:]
        if self.jp.safe > self.args_sent:
            self.args(self.args_text[self.args_sent : self.jp.safe])
            self.args_sent = self.jp.safe
        if self.jp.done:
            self.end_call()
            self.state = TAIL
            return True
        if not self.jp.failed and not final:
            return False
        self.state = TEXT
        if not self.jp.failed:  # cut off
            self.drop_call(self.call_raw + self.args_text)
            return True
        # Gone wrong: close the arguments valid so far; the rest is text.
        self.args(self.jp.closers())
        self.end_call()
        return True


_SEP = "<｜tool▁sep｜>"
_DS_STARTS = ("<｜tool▁calls▁begin｜>",)
_DS_CALL = "<｜tool▁call▁begin｜>"
_DS_CALL_END = "<｜tool▁call▁end｜>"
_DS_ENDS = ("<｜tool▁calls▁end｜>",)
_DS_TOKENS = (*_DS_STARTS, _DS_CALL, _SEP, _DS_CALL_END, *_DS_ENDS)


class DeepSeekV3Parser(NamedJsonParser):
    """DeepSeek V3 / R1, calls in `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`, each
    `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>`.
    """

    name = "deepseek_v3"
    aliases = ("deepseek_r1", "deepseek")
    starts = _DS_STARTS
    section = True
    call_begin = _DS_CALL
    section_ends = _DS_ENDS
    special_tokens = _DS_TOKENS
    priority = 20

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        # V3 and R1 write the type (`function`) before the separator and fence the JSON.
        return _SEP in template and ("```json" in template or "function" + _SEP in template)

    def _head(self, s: str) -> tuple[str, str, str | None, int]:
        status, _, _, i = read_until(s, 0, (_SEP,), 32, '\n{}"')
        if status != OK:
            return status, "", None, 0
        status, name, _, i = read_until(s, i + len(_SEP), ("\n",), 128, '{}"<>')
        name = name.strip()
        if status != OK or not valid_name(name):
            return (status if status != OK else NO), "", None, 0
        i = skip_ws(s, i + 1)
        status, j = optional(s, i, "```")
        if status == OK and j > i:
            status, j = optional(s, j, "json")
        if status != OK:
            return status, "", None, 0
        status, j = object_start(s, j)
        return status, name, None, j

    def _tail(self, s: str) -> tuple[str, int]:
        i = skip_ws(s)
        status, i = optional(s, i, "```")
        if status != OK:
            return status, 0
        status, i = expect(s, i, _DS_CALL_END)
        return status, i


class DeepSeekV31Parser(NamedJsonParser):
    """DeepSeek V3.1: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`."""

    name = "deepseek_v31"
    starts = _DS_STARTS
    section = True
    call_begin = _DS_CALL
    section_ends = _DS_ENDS
    special_tokens = _DS_TOKENS
    priority = 19  # below V3, whose templates also write the separator

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        return _SEP in template and not DeepSeekV3Parser.matches(template, model_type, vocab)

    def _head(self, s: str) -> tuple[str, str, str | None, int]:
        status, name, _, i = read_until(s, 0, (_SEP,), 128, '\n{}"')
        name = name.strip()
        if status != OK or not valid_name(name):
            return (status if status != OK else NO), "", None, 0
        status, j = object_start(s, i + len(_SEP))
        return status, name, None, j

    def _tail(self, s: str) -> tuple[str, int]:
        return expect(s, 0, _DS_CALL_END)


_KIMI_ARG = "<|tool_call_argument_begin|>"
_KIMI_CALL_END = "<|tool_call_end|>"
_KIMI_ID = re.compile(r"(?:functions\.)?(.+?)(?::\d+)?")


class KimiK2Parser(NamedJsonParser):
    """Kimi K2, calls in `<|tool_calls_section_begin|>...<|tool_calls_section_end|>`,
    each `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>`.

    The `functions.NAME:IDX` string is the call's id: the template writes it back.
    """

    name = "kimi_k2"
    aliases = ("kimi", "moonshot")  # vllm-mlx's names
    # Some checkpoints write the section markers in the singular.
    starts = ("<|tool_calls_section_begin|>", "<|tool_call_section_begin|>")
    section = True
    call_begin = "<|tool_call_begin|>"
    section_ends = ("<|tool_calls_section_end|>", "<|tool_call_section_end|>")
    special_tokens = (*starts, call_begin, _KIMI_ARG, _KIMI_CALL_END, *section_ends)
    priority = 20

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        return "<|tool_calls_section_begin|>" in template or model_type == "kimi_k2"

    def _head(self, s: str) -> tuple[str, str, str | None, int]:
        status, ident, _, i = read_until(s, 0, (_KIMI_ARG,), 160, '{}"')
        ident = ident.strip()
        m = _KIMI_ID.fullmatch(ident)
        if status != OK or m is None or not valid_name(m.group(1)):
            return (status if status != OK else NO), "", None, 0
        status, j = object_start(s, i + len(_KIMI_ARG))
        return status, m.group(1), ident, j

    def _tail(self, s: str) -> tuple[str, int]:
        return expect(s, 0, _KIMI_CALL_END)


_FN_OPEN = "<function="
_FN_CLOSE = "</function>"
_RECIPIENT = ">>>"


class FunctionaryParser(NamedJsonParser):
    """Functionary v3: v3.1 `<function=NAME>{...}</function>`; v3.2 `>>>NAME\\n{...}`.

    In v3.2 every message part names its recipient: `>>>all\\n` for text to the user,
    `>>>NAME\\n` for a call. The generation prompt ends with `>>>`, so the output starts
    with a recipient; a start that reads as none is text.
    """

    name = "functionary"
    aliases = ("functionary_v3", "functionary_v3_1", "functionary_v3_2", "meetkai")
    starts = (_RECIPIENT, _FN_OPEN)
    special_tokens = (_FN_OPEN, _FN_CLOSE)
    priority = 20

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        v32 = ">>>all" in template
        # Qwen3-Coder's templates write `<function=` too, inside `<tool_call>`.
        v31 = _FN_OPEN in template and _FN_CLOSE in template and "<tool_call>" not in template
        return v32 or v31

    def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        # The prompt's `>>>` opened the first recipient; nothing to give back if it is text.
        self.state = HEAD
        self.marker = _RECIPIENT

    def _head(self, s: str) -> tuple[str, str, str | None, int]:
        if self.marker == _FN_OPEN:
            status, name, _, i = read_until(s, 0, (">",), 128, NAME_STOP)
            i += 1
        else:
            status, name, _, i = read_until(s, 0, ("\n",), 128, NAME_STOP)
            if status == OK and name == "all":
                return SKIP, "", None, i + 1
            i += 1
        if status != OK or not valid_name(name):
            return (status if status != OK else NO), "", None, 0
        status, j = object_start(s, i)
        return status, name, None, j

    def _tail(self, s: str) -> tuple[str, int]:
        return expect(s, 0, _FN_CLOSE) if self.marker == _FN_OPEN else (OK, 0)
