"""An incremental JSON validator for one value, fed a few characters at a time.

Tool-call arguments are streamed to clients as the model writes them, so the
parser must know, character by character, whether the text so far can still be
the start of valid JSON, which part of it is safe to send (never a half-written
number, literal or escape, never a comma that may turn out to be trailing), and
how to close it if the model stops or goes wrong midway. Work is O(1) per
character.
"""

from __future__ import annotations

import re

_WS = " \t\r\n"
_NUMBER = re.compile(r"-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][+-]?[0-9]+)?\Z")
_LITERALS = ("true", "false", "null")
_HEX = set("0123456789abcdefABCDEF")

# States
_VALUE = 0  # a value is expected
_KEY_OR_END = 1  # right after '{'
_KEY = 2  # after ',' in an object
_COLON = 3  # after a key
_AFTER = 4  # after a value inside a container: ',' or the closer
_STRING = 5
_KEY_STRING = 6
_SCALAR = 7  # inside a number or a literal
_VALUE_OR_END = 8  # right after '['
DONE = 9


class JsonPrefix:
    """Feed text with `feed`; `state` becomes DONE after one complete value."""

    def __init__(self) -> None:
        self.state = _VALUE
        self.error = False  # the text stopped being a JSON prefix; `state` is from before
        self.stack: list[str] = []
        self.consumed = 0  # characters accepted so far (not counting the one that failed)
        self._escape = 0  # 0: none; 1: after '\\'; 2..5: hex digits of \\u left + 1
        self._scalar = ""
        self._scalar_ctx = _VALUE
        self._hold: int | None = None  # start of text not yet safe to send
        self._started = False

    @property
    def done(self) -> bool:
        return self.state == DONE

    @property
    def failed(self) -> bool:
        return self.error

    @property
    def started(self) -> bool:
        """Whether the value itself (not just leading whitespace) has begun."""
        return self._started

    @property
    def safe(self) -> int:
        """How many of the consumed characters may be sent on."""
        return self.consumed if self._hold is None else self._hold

    def feed(self, text: str) -> int:
        """Consume characters until the value is complete or invalid; return how many."""
        n = 0
        for ch in text:
            if self.state == DONE or self.error:
                break
            if not self._step(ch):
                # Unless a scalar just ended at a character that is not its own.
                self.error = self.state != DONE
                break
            n += 1
            self.consumed += 1
        return n

    def finish(self) -> bool:
        """The input ended: a top-level number is complete now. True if the value is."""
        if self.state == _SCALAR and not self.stack and self._end_scalar():
            self.state = DONE
        return self.state == DONE

    def closers(self) -> str:
        """Text that, appended to the safe prefix, makes it one valid JSON value."""
        state = self._scalar_ctx if self.state == _SCALAR else self.state
        if state == DONE:
            return ""
        tail = ""
        if state == _STRING:
            tail = '"'
        elif state == _KEY_STRING:
            tail = '": null'
        elif state == _COLON:
            tail = ": null"
        elif state == _VALUE:
            if not self.stack:
                return "null" if not self._started else ""
            if self.stack[-1] == "{":
                tail = "null"
        return tail + "".join("}" if c == "{" else "]" for c in reversed(self.stack))

    # --- the state machine ---------------------------------------------------

    def _open_value(self, ch: str) -> bool:
        scalar = ch == "-" or ch.isdigit() or ch in "tfn"
        if not scalar and ch not in '"{[':
            return False
        self._started = True
        if not scalar:
            self._hold = None  # a comma before this value is not trailing after all
        if ch == '"':
            self.state = _STRING
        elif ch == "{":
            self.stack.append("{")
            self.state = _KEY_OR_END
        elif ch == "[":
            self.stack.append("[")
            self.state = _VALUE_OR_END
        elif scalar:
            self._scalar_ctx = self.state
            self.state = _SCALAR
            self._scalar = ch
            if self._hold is None:  # a held comma stays held until the scalar is whole
                self._hold = self.consumed
        return True

    def _after_value(self) -> None:
        self.state = _AFTER if self.stack else DONE

    def _end_scalar(self) -> bool:
        s = self._scalar
        ok = s in _LITERALS if s[0] in "tfn" else bool(_NUMBER.match(s))
        if ok:
            self._hold = None
        return ok

    def _step(self, ch: str) -> bool:  # noqa: C901 - one branch per state
        st = self.state
        if st in (_STRING, _KEY_STRING):
            if self._escape == 1:
                if ch == "u":
                    self._escape = 5
                    return True
                if ch not in '"\\/bfnrt':
                    return False
                self._escape = 0
                self._hold = None
                return True
            if self._escape > 1:
                if ch not in _HEX:
                    return False
                self._escape -= 1
                if self._escape == 1:
                    self._escape = 0
                    self._hold = None
                return True
            if ch == "\\":
                self._escape = 1
                self._hold = self.consumed
                return True
            if ch == '"':
                if st == _KEY_STRING:
                    self.state = _COLON
                else:
                    self._after_value()
                return True
            return ch >= " "  # control characters must be escaped
        if st == _SCALAR:
            if self._scalar[0] in "tfn":
                cand = self._scalar + ch
                if any(lit.startswith(cand) for lit in _LITERALS):
                    self._scalar = cand
                    return True
            elif ch in "0123456789+-.eE":
                self._scalar += ch
                return True
            if not self._end_scalar():
                return False
            self._after_value()
            if self.state == DONE:
                return False  # the scalar ended; `ch` belongs to what follows
            return self._step(ch)
        if ch in _WS:
            return True  # whitespace after a held comma stays held with it
        if st in (_VALUE, _VALUE_OR_END):
            if st == _VALUE_OR_END and ch == "]":
                self.stack.pop()
                self._after_value()
                return True
            return self._open_value(ch)
        if st in (_KEY_OR_END, _KEY):
            if st == _KEY_OR_END and ch == "}":
                self.stack.pop()
                self._after_value()
                return True
            if ch != '"':
                return False
            self._hold = None
            self.state = _KEY_STRING
            return True
        if st == _COLON:
            if ch != ":":
                return False
            self.state = _VALUE
            return True
        if st == _AFTER:
            top = self.stack[-1]
            if ch == ",":
                self.state = _KEY if top == "{" else _VALUE
                self._hold = self.consumed
                return True
            if (ch == "}" and top == "{") or (ch == "]" and top == "["):
                self.stack.pop()
                self._after_value()
                return True
            return False
        return False
