"""Reading tool calls written as JSON objects: `{"name": ..., "arguments": {...}}`.

Most families write calls this way, alone (hermes, llama 3), or as a list (mistral's
old format, granite, phi-4-mini, nemotron, xlam). The arguments are streamed as the
model writes them once the name is known; an object whose keys come in another order
is reported whole when it ends.
"""

from __future__ import annotations

import json
import re
from typing import Any

from pippin.chat.tool_parsers.base import ToolParser, skip_ws
from pippin.chat.tool_parsers.json_prefix import JsonPrefix

NAME_KEYS = ("name", "function", "tool_name")
ARG_KEYS = ("arguments", "parameters", "args", "input")
# The usual head of a call object; the arguments start where it ends.
_HEAD = re.compile(
    r'\s*\{\s*"(?:' + "|".join(NAME_KEYS) + r')"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,'
    # The call opens only once its arguments start as an object (or a JSON string).
    r'\s*"(?:' + "|".join(ARG_KEYS) + r')"\s*:(?=\s*[{"])'
)
_HEAD_MAX = 400  # the head is short; past this, wait for the whole object

MORE, DONE, ERROR = "more", "done", "error"
# The output ended inside a call's arguments: the call is still open, for the parser's
# `drop_call` with `cut_text`.
CUT = "cut"


def call_from_object(obj: Any) -> tuple[str, Any] | None:
    """(name, arguments) of a decoded call object, or None if it is not one."""
    if not isinstance(obj, dict):
        return None
    if isinstance(obj.get("function"), dict):  # OpenAI-style {"type": "function", ...}
        obj = obj["function"]
    name = next((obj[k] for k in NAME_KEYS if isinstance(obj.get(k), str)), None)
    args = next((obj[k] for k in ARG_KEYS if k in obj), {})
    if name is None:
        return None
    if isinstance(args, str):  # arguments written as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return name, args


class JsonCallReader:
    """Reads one call object, or a `[...]` list of them when `many`.

    Call `step(text, final)` with the text after the opening marker; it returns
    (consumed, status). On ERROR, `raw` holds the text to give back as content.
    """

    def __init__(self, parser: ToolParser, many: bool = False, list_optional: bool = True) -> None:
        self.p = parser
        self.many = many
        self.list_optional = list_optional
        self.in_list = False
        self.at_start = True
        # Text of the current object, until it is accounted for; pieces are kept in a
        # list, as appending to one long string would copy it at every piece.
        self._raw = _Text()
        self.calls = 0
        self._reset_object()

    @property
    def raw(self) -> str:
        return str(self._raw)

    def _reset_object(self) -> None:
        self.outer = JsonPrefix()
        self.obj = _Text()
        self.head = ""  # the object's first characters, where the name is
        self.args_jp: JsonPrefix | None = None
        self.args_buf = ""  # arguments read but not sent yet (a short tail, normally)
        self.args_sent = 0  # arguments characters accounted for (sent or skipped)
        self.args_any = False  # whether any argument text was sent
        self.args_string: bool | None = None  # arguments written as a JSON string
        self.expect_sep = False

    def step(self, text: str, final: bool) -> tuple[int, str]:
        i = 0
        while True:
            if self.at_start:
                j = skip_ws(text, i)
                if j == len(text):
                    if final:
                        self._raw.add(text[i:])
                        return j, ERROR
                    return i, MORE  # whitespace stays unread until something follows
                self.at_start = False
                if self.many and text[j] == "[":
                    self.in_list = True
                    self._raw.add(text[i : j + 1])
                    i = j + 1
                    continue
                if self.many and not self.list_optional:
                    self._raw.add(text[i:j])
                    return j, ERROR
                self._raw.add(text[i:j])
                i = j
            if self.expect_sep:  # between objects of a list
                j = skip_ws(text, i)
                if j == len(text):
                    return (i, DONE) if final else (i, MORE)
                if text[j] == ",":
                    self._reset_object()
                    self._raw = _Text(text[i : j + 1])
                    i = j + 1
                    continue
                if text[j] == "]":
                    return j + 1, DONE
                return i, DONE  # a missing ']' is forgiven; the rest is not ours
            n = self._feed_object(text[i:])
            i += n
            if final and not self.outer.failed and self._args_open():
                return i, CUT
            if self.outer.failed or (final and not self.outer.done):
                return i, self._fail()
            if not self.outer.done:
                return i, MORE
            if not self._close_object():
                return i, ERROR
            if not self.in_list:
                return i, DONE
            self.expect_sep = True

    def _feed_object(self, text: str) -> int:
        n = self.outer.feed(text)
        chunk = text[:n]
        self.obj.add(chunk)
        self._raw.add(chunk)
        if self.args_jp is None and len(self.head) <= _HEAD_MAX:
            self.head += chunk
            m = _HEAD.match(self.head)
            if m:
                name = json.loads(f'"{m.group(1)}"')
                if not self.p.known(name):
                    self.outer.error = True  # an unknown tool: the object is text
                    return n
                self.p.start_call(name)
                self.args_jp = JsonPrefix()
                chunk = self.head[m.end() :]
        if self.args_jp is not None and not self.args_jp.done:
            used = self.args_jp.feed(chunk)
            self.args_buf += chunk[:used]
            self._send_args()
        return n

    def _send_args(self) -> None:
        jp = self.args_jp
        assert jp is not None
        if not jp.started:
            return
        if self.args_string is None:
            # Leading whitespace is not part of the arguments.
            stripped = self.args_buf.lstrip()
            self.args_sent = jp.consumed - len(stripped)
            self.args_buf = stripped
            self.args_string = stripped.startswith('"')
        if self.args_string:
            # Arguments written as a JSON string: sent decoded, once whole.
            if jp.done and not self.args_any:
                self.p.args(_decoded_args(json.loads(self.args_buf)))
                self.args_any, self.args_buf = True, ""
            return
        k = jp.safe - self.args_sent
        if k > 0:
            self.p.args(self.args_buf[:k])
            self.args_buf = self.args_buf[k:]
            self.args_sent = jp.safe
            self.args_any = True

    def _args_open(self) -> bool:
        """Whether a call is open and its arguments are not complete yet."""
        return self.args_jp is not None and not self.args_jp.done

    def cut_text(self, marker: str) -> str:
        """The text of the call the output ended inside: the section's from its marker
        if it is the first call there, else the call object's own."""
        return marker + self.raw if self.calls == 0 else str(self.obj).lstrip()

    def _close_object(self) -> bool:
        """The object ended: finish its call. False if it was not a call after all."""
        if self.args_jp is not None:
            if not self.args_jp.done:  # e.g. `"arguments": "..."` strings end with the object
                self._finish_args()
            self.p.end_call()
        else:
            call = call_from_object(json.loads(str(self.obj)))
            if call is None or not self.p.known(call[0]):
                return False
            self.p.whole_call(*call)
        self.calls += 1
        self._raw = _Text()
        return True

    def _finish_args(self) -> None:
        assert self.args_jp is not None
        self.args_jp.finish()
        self._send_args()
        if not self.args_jp.started or not self.args_any:
            self.p.args("{}")
        elif not self.args_jp.done:
            self.p.args(self.args_jp.closers())

    def _fail(self) -> str:
        """The object went wrong: close an open call; else the text is content."""
        if self.args_jp is not None:
            self._finish_args()
            self.p.end_call()
            self.calls += 1
            self._raw = _Text()
        return ERROR


class _Text:
    """A string built piece by piece, joined only when read."""

    def __init__(self, s: str = "") -> None:
        self.parts = [s] if s else []

    def add(self, s: str) -> None:
        if s:
            self.parts.append(s)

    def __str__(self) -> str:
        joined = "".join(self.parts)
        self.parts = [joined] if joined else []
        return joined


def _decoded_args(s: str) -> str:
    try:
        obj = json.loads(s)
    except ValueError:
        return "{}"
    return json.dumps(obj) if isinstance(obj, dict) else "{}"
