"""Gemma 4's native calls: `<|tool_call>call:NAME{key:<|"|>text<|"|>,n:5}<tool_call|>`.

Keys are bare (or, rarely, wrapped in `<|"|>`), strings are delimited by the `<|"|>`
token and hold raw text, other values are JSON-like (numbers, true/false/null, `{...}`,
`[...]`). Several calls may follow one another. The arguments are rewritten as JSON while
they arrive and streamed through `JsonPrefix`, which also closes them if the output stops
midway.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable

from pippin.chat.tool_parsers.base import ToolParser, find_marker, partial_marker
from pippin.chat.tool_parsers.json_prefix import JsonPrefix

CALL_START = "<|tool_call>"
CALL_END = "<tool_call|>"
QUOTE = '<|"|>'

_HEAD = re.compile(r"call:([\w.\-]+)\{")
_NAME_TAIL = re.compile(r"[\w.\-]*\Z")
_TOKEN_MAX = 256  # a call's head, a bare key or a bare value is never longer

MORE, DONE, ERROR, CUT = "more", "done", "error", "cut"

# States of the argument rewriter
_KEY_OR_END, _KEY, _BARE_KEY, _QUOTED_KEY, _COLON = range(5)
_VALUE, _VALUE_OR_END, _STRING, _SCALAR, _AFTER, _FINISHED = range(5, 11)

_KEY_STOP = set(':{}[],"') | {"<"}
_SCALAR_STOP = set(",}]<")


def _scalar_json(token: str) -> str:
    """A bare value as JSON: literals and numbers as such, anything else a string."""
    value: object
    try:
        value = json.loads(token)
    except ValueError:
        try:
            value = float(token)  # 1., .5, +3 and the like
        except ValueError:
            value = token
    if isinstance(value, float) and not math.isfinite(value):  # NaN, Infinity
        value = token
    return json.dumps(value, ensure_ascii=False)


class ArgsRewriter:
    """Turns the text after `call:NAME{` into the JSON of the arguments, incrementally."""

    def __init__(self, send: Callable[[str], None]) -> None:
        self.send = send
        self.jp = JsonPrefix()
        self.pending = ""  # JSON written but not yet safe to send
        self.written = self.sent = 0
        self.stack = ["{"]
        self.state = _KEY_OR_END
        self.token = ""  # a bare key or value being read
        self.comma = False  # a ',' read but not written: it waits for the next item
        self.ok = True
        self._write("{")

    def _write(self, s: str) -> None:
        if self.comma:
            s, self.comma = "," + s, False
        if self.jp.feed(s) != len(s):
            self.ok = False  # not reached with well-formed rewriting; stop sending
            return
        self.pending += s
        self.written += len(s)
        if self.jp.safe > self.sent:
            k = self.jp.safe - self.sent
            self.send(self.pending[:k])
            self.pending = self.pending[k:]
            self.sent = self.jp.safe

    def close(self) -> None:
        """The arguments stop here: send what is safe, then what makes it valid JSON."""
        if self.state == _FINISHED:
            return
        if self.state != _STRING:
            # A number or literal is only written once whole, but JsonPrefix holds it
            # back until something follows it: a space tells it the value ended.
            self.jp.feed(" ")
        safe = min(self.jp.safe, self.written)
        if safe > self.sent:
            self.send(self.pending[: safe - self.sent])
        self.send(self.jp.closers())
        self.state = _FINISHED

    def _open(self, ch: str) -> None:
        self._write(ch)
        self.stack.append(ch)
        self.state = _KEY_OR_END if ch == "{" else _VALUE_OR_END

    def _close(self, ch: str) -> bool:
        if self.stack[-1] != ("{" if ch == "}" else "["):
            return False
        self.stack.pop()
        self.comma = False  # a trailing comma is forgiven
        self._write(ch)
        self.state = _FINISHED if not self.stack else _AFTER
        return True

    def _key(self, key: str) -> None:
        self._write(json.dumps(key, ensure_ascii=False) + ":")
        self.state = _VALUE

    def step(self, text: str, final: bool) -> tuple[int, str]:  # noqa: C901 - a state machine
        """Read `text`; (characters used, MORE / DONE / ERROR / CUT at the end marker)."""
        i, n = 0, len(text)
        while i < n and self.ok:
            st = self.state
            if st in (_STRING, _QUOTED_KEY):
                hit = find_marker(text, (QUOTE, CALL_END), i)
                if hit is None:
                    cut = n if final else n - partial_marker(text[i:], (QUOTE, CALL_END))
                    self._chars(text[i:cut])
                    return cut, MORE
                j, m = hit
                self._chars(text[i:j])
                if m == CALL_END:
                    return j, CUT
                i = j + len(QUOTE)
                if st == _STRING:
                    self._write('"')
                    self.state = _AFTER
                else:
                    self.state = _COLON
                continue
            ch = text[i]
            if st == _BARE_KEY:
                if ch == ":":
                    self._key(self.token.strip())
                elif ch in _KEY_STOP or ch == "\n" or len(self.token) >= _TOKEN_MAX:
                    return i, ERROR
                else:
                    self.token += ch
                i += 1
                continue
            if st == _SCALAR:
                if ch in _SCALAR_STOP or ch.isspace():
                    self._write(_scalar_json(self.token))
                    self.state = _AFTER
                    continue
                if len(self.token) >= _TOKEN_MAX:
                    return i, ERROR
                self.token += ch
                i += 1
                continue
            if ch.isspace():
                i += 1
                continue
            if ch == "<":  # the string delimiter or the end of the call
                rest = text[i : i + len(CALL_END)]
                if rest == CALL_END:
                    return i, CUT
                if text.startswith(QUOTE, i) and st in (_KEY_OR_END, _KEY, _VALUE, _VALUE_OR_END):
                    i += len(QUOTE)
                    if st in (_KEY_OR_END, _KEY):
                        self.token = ""
                        self.state = _QUOTED_KEY
                    else:
                        self._write('"')
                        self.state = _STRING
                    continue
                if not final and partial_marker(rest, (CALL_END, QUOTE)) == len(rest):
                    return i, MORE
                return i, ERROR
            if st in (_KEY_OR_END, _KEY):
                if ch == "}" and (st == _KEY_OR_END or self.comma):
                    self._close(ch)
                elif ch in _KEY_STOP:
                    return i, ERROR
                else:
                    self.token = ch
                    self.state = _BARE_KEY
            elif st == _COLON:
                if ch != ":":
                    return i, ERROR
                self._key(self.token)
            elif st in (_VALUE, _VALUE_OR_END):
                if ch == "]" and (st == _VALUE_OR_END or (self.comma and self.stack[-1] == "[")):
                    self._close(ch)
                elif ch in "{[":
                    self._open(ch)
                elif ch in ",:}]":
                    return i, ERROR  # a missing value
                else:
                    self.token = ch
                    self.state = _SCALAR
            elif st == _AFTER:
                if ch == ",":
                    self.comma = True
                    self.state = _KEY if self.stack[-1] == "{" else _VALUE
                elif ch not in "}]" or not self._close(ch):
                    return i, ERROR
            i += 1
            if self.state == _FINISHED:
                return i, DONE
        return i, MORE if self.ok else ERROR

    def _chars(self, s: str) -> None:
        """Raw text inside a string or a quoted key."""
        if not s:
            return
        if self.state == _STRING:
            self._write(json.dumps(s, ensure_ascii=False)[1:-1])
        else:
            self.token += s


_TEXT, _HEAD_STATE, _ARGS, _CLOSE = range(4)


class Gemma4Parser(ToolParser):
    name = "gemma4"
    aliases = ("gemma_4",)
    special_tokens = (CALL_START, CALL_END, QUOTE)
    priority = 20  # before hermes, which matches any `<tool_call>`

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        return CALL_START in template and CALL_END in template

    def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.mode = _TEXT
        self.rewriter: ArgsRewriter | None = None
        self.call_at = 0  # where the current call's text starts (`taken_since`)

    def _run(self, final: bool) -> None:
        while True:
            if self.mode == _TEXT:
                if self.scan_text((CALL_START,), final) is None:
                    return
                self.call_at = self.at - len(CALL_START)
                self.mode = _HEAD_STATE
            if self.mode == _HEAD_STATE:
                m = _HEAD.match(self.buf)
                if m is None:
                    if not final and self._head_may_follow():
                        return
                    self.text(CALL_START)  # not a call: the rest is text
                    self.mode = _TEXT
                    continue
                if not self.known(m.group(1)):
                    self.text(CALL_START)
                    self.mode = _TEXT
                    continue
                self.start_call(m.group(1))
                self.rewriter = ArgsRewriter(self.args)
                self.buf = self.buf[m.end() :]
                self.mode = _ARGS
            if self.mode == _ARGS:
                assert self.rewriter is not None
                if final:
                    # The output ended inside the arguments (all that is left is what
                    # may start a marker): no call, and nothing more is sent of it.
                    self.drop_call(self.taken_since(self.call_at))
                    self.mode = _TEXT
                    return
                used, status = self.rewriter.step(self.buf, final)
                self.buf = self.buf[used:]
                if status == MORE:
                    return
                self.rewriter.close()
                self.end_call()
                # After an error the rest is text; a call cut short by its end marker is done.
                self.mode = _CLOSE if status in (DONE, CUT) else _TEXT
            if self.mode == _CLOSE:
                stripped = self.buf.lstrip()
                if stripped.startswith(CALL_END):
                    self.buf = stripped[len(CALL_END) :]
                elif not final and CALL_END.startswith(stripped):
                    return
                self.mode = _TEXT  # a missing end marker is forgiven

    def _head_may_follow(self) -> bool:
        """Whether the text after `<|tool_call>` may still become `call:NAME{`."""
        b = self.buf
        if len(b) <= len("call:"):
            return "call:".startswith(b)
        return b.startswith("call:") and len(b) < _TOKEN_MAX and bool(_NAME_TAIL.match(b, 5))
