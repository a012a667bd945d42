"""Calls written as Python call expressions: `[get_weather(city="Paris"), f(x=[1, 2])]`.

Llama 3.2 / 4 pythonic templates ask for a bare list at the start of the answer (Llama 4
may wrap it in `<|python_start|>`...`<|python_end|>`); LFM2 puts the list between
`<|tool_call_start|>` and `<|tool_call_end|>` anywhere in its answer; Olmo 3 writes one call
per line inside `<function_calls>`; Gemma 3 (Google's function-calling guide) writes calls in
```` ```tool_code ```` blocks. Arguments must be keyword literals.

A call is found by tracking brackets and string quotes a character at a time; when its
closing parenthesis arrives it is parsed with `ast` and reported whole, so arguments
stream per call.
"""

from __future__ import annotations

import ast
import json
import re
import string
from collections.abc import Callable
from typing import Any, ClassVar

from pippin.chat.tool_parsers.base import ToolParser

MORE, DONE, ERROR = "more", "done", "error"

_NAME_START = frozenset(string.ascii_letters + "_")
_NAME_CHARS = _NAME_START | frozenset(string.digits + ".")
_DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*\Z")
_NAME_MAX = 256  # past this, a run of name characters is not a call's name
_CLOSING = {"(": ")", "[": "]", "{": "}"}
# Templates render nested values as JSON, so models write these where Python has True etc.
_JSON_NAMES: dict[str, Any] = {"true": True, "false": False, "null": None}


class PyCallReader:
    """Reads one call expression `name(...)`, a piece of text at a time.

    `step(text, final)` reads from the start of `text` (what follows what it read before)
    and returns (characters used, status); `text` holds everything read. Each character
    is looked at once. `accept(name)` is asked once the name is complete.
    """

    def __init__(self, accept: Callable[[str], bool]) -> None:
        self.accept = accept
        self.parts: list[str] = []
        self.n = 0  # characters read
        self.name: str | None = None
        self.stack: list[str] = []
        self.quote = ""  # the open string's quote: one or three ' or "
        self.escape = False

    @property
    def text(self) -> str:
        return "".join(self.parts)

    def step(self, text: str, final: bool) -> tuple[int, str]:
        """MORE; DONE: `self.text` is the call; ERROR: text[used] cannot follow."""
        used, status = 0, DONE
        if self.name is None:
            used, status = self._name(text, final)
        if status == DONE:
            used, status = self._args(text, used, final)
        if used:
            self.parts.append(text[:used])
            self.n += used
        return used, status

    def _name(self, text: str, final: bool) -> tuple[int, str]:
        for i, ch in enumerate(text):
            k = self.n + i  # position in the call
            if ch == "(" and k > 0:
                name = self.text + text[:i]
                if not _DOTTED.match(name) or not self.accept(name):
                    return i, ERROR
                self.name = name
                self.stack.append("(")
                return i + 1, DONE
            if ch not in (_NAME_CHARS if k else _NAME_START) or k >= _NAME_MAX:
                return i, ERROR
        return len(text), ERROR if final else MORE

    def _args(self, text: str, i: int, final: bool) -> tuple[int, str]:  # noqa: C901
        n = len(text)
        while i < n:
            ch = text[i]
            if self.quote:
                if self.escape:
                    self.escape = False
                elif ch == "\\":
                    self.escape = True
                elif len(self.quote) == 1:
                    if ch == self.quote:
                        self.quote = ""
                    elif ch == "\n":  # a one-line string cannot span lines
                        return i, ERROR
                elif ch == self.quote[0]:
                    if text.startswith(self.quote, i):
                        self.quote = ""
                        i += 3
                        continue
                    if not final and self.quote.startswith(text[i:]):
                        return i, MORE  # the closing quotes may be arriving
                i += 1
                continue
            if ch in "\"'":
                if not final and n - i < 3 and text[i:] == ch * (n - i):
                    return i, MORE  # '' or ''': the next character tells
                self.quote = ch * 3 if text.startswith(ch * 3, i) else ch
                i += len(self.quote)
                continue
            if ch in _CLOSING:
                self.stack.append(ch)
            elif ch in ")]}":
                if _CLOSING[self.stack.pop()] != ch:
                    return i, ERROR
                if not self.stack:
                    return i + 1, DONE
            i += 1
        return n, ERROR if final else MORE


def _literal(node: ast.expr) -> Any:
    """A literal's value, reading JSON's true/false/null too."""
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict):
        if any(k is None for k in node.keys):  # {**spread}
            raise ValueError("not a literal")
        return {_literal(k): _literal(v) for k, v in zip(node.keys, node.values)}  # type: ignore[arg-type]
    return ast.literal_eval(node)


def parse_call(src: str) -> str | None:
    """JSON arguments of a call expression with literal keyword arguments, else None."""
    try:
        node = ast.parse(src, mode="eval").body
        if not isinstance(node, ast.Call) or node.args:
            return None
        args: dict[str, Any] = {}
        for kw in node.keywords:
            if kw.arg is None:  # **kwargs
                return None
            args[kw.arg] = _literal(kw.value)
        return json.dumps(args, ensure_ascii=False, allow_nan=False)
    except (SyntaxError, ValueError, TypeError, RecursionError):
        return None


_START, _TEXT, _OPEN, _CALL, _SEP, _CLOSE = range(6)


def skip_space(text: str, i: int = 0) -> int:
    """Index of the first character at or after `i` that is not whitespace (any kind)."""
    while i < len(text) and text[i].isspace():
        i += 1
    return i


class PythonicParser(ToolParser):
    """A `[f(a=1), g(b="x")]` list starting the output, or a marked section of calls."""

    name = "pythonic"
    aliases = ("llama4_pythonic", "lfm2")
    # Markers that open a section of calls anywhere in the output, and what closes each.
    sections: ClassVar[dict[str, str]] = {
        "<|tool_call_start|>": "<|tool_call_end|>",
        "<|python_start|>": "<|python_end|>",
    }
    # Whether a bare `[` at the start of the output opens a list of calls.
    bare_list: ClassVar[bool] = True
    special_tokens = (
        "<|tool_call_start|>",
        "<|tool_call_end|>",
        "<|python_start|>",
        "<|python_end|>",
    )
    priority = 5

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        # Llama 3.2 / 4 pythonic templates spell the format out; LFM2 marks tool lists and
        # calls with special tokens, which some conversions only have in the vocab.
        return (
            "[func_name1(" in template
            or "<|tool_call_start|>" in template
            or "<|tool_list_start|>" in template
            or ("<|tool_call_start|>" in vocab and "<|tool_call_end|>" in vocab)
        )

    def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.mode = _START if self.bare_list else _TEXT
        self.marker = ""  # what opened the current section, given back if it holds no call
        self.end = ""  # what closes it
        self.in_list = False
        self.raw = ""  # consumed text of the section not yet accounted for
        self.section_calls = 0
        self.reader = PyCallReader(self.known)

    def _open(self, marker: str, end: str) -> None:
        self.marker, self.end = marker, end
        self.raw = ""
        self.section_calls = 0

    def _next_call(self) -> None:
        self.reader = PyCallReader(self.known)
        self.mode = _CALL

    def _fail(self, read: str = "") -> None:
        """The section went wrong where `buf` starts: what is not a call is text."""
        if self.section_calls == 0:
            self.text(self.marker)
        self.text(self.raw + read)
        self.raw = ""
        self.mode = _TEXT

    def _run(self, final: bool) -> None:  # noqa: C901 - one branch per state
        while True:
            if self.mode == _START:
                j = skip_space(self.buf)
                if j == len(self.buf) and not final:
                    return
                if j < len(self.buf) and self.buf[j] == "[":
                    self._open("", "")
                    self.raw = self.buf[: j + 1]
                    self.buf = self.buf[j + 1 :]
                    self.in_list = True
                    self._next_call()
                else:
                    self.mode = _TEXT
            if self.mode == _TEXT:
                m = self.scan_text(tuple(self.sections), final)
                if m is None:
                    return
                self._open(m, self.sections[m])
                self.mode = _OPEN
            if self.mode == _OPEN:
                j = skip_space(self.buf)
                if j == len(self.buf):
                    if not final:
                        return
                    self.raw += self.buf
                    self.buf = ""
                    self._fail()
                    continue
                self.in_list = self.buf[j] == "["
                cut = j + 1 if self.in_list else j
                self.raw += self.buf[:cut]
                self.buf = self.buf[cut:]
                self._next_call()
            if self.mode == _CALL:
                if self.reader.n == 0:  # whitespace before a call is part of the section
                    j = skip_space(self.buf)
                    if j == len(self.buf) and not final:
                        return
                    self.raw += self.buf[:j]
                    self.buf = self.buf[j:]
                used, status = self.reader.step(self.buf, final)
                self.buf = self.buf[used:]
                if status == MORE:
                    return
                args = parse_call(self.reader.text) if status == DONE else None
                if args is None:
                    self._fail(self.reader.text)
                    continue
                assert self.reader.name is not None
                self.whole_call(self.reader.name, args)
                self.section_calls += 1
                self.raw = ""
                self.mode = _SEP
            if self.mode == _SEP:
                self._separator(final)
                if self.mode == _SEP:
                    return
                continue
            if self.mode == _CLOSE:
                j = skip_space(self.buf)
                rest = self.buf[j:]
                if self.end and rest.startswith(self.end):
                    self.buf = rest[len(self.end) :]
                elif self.end and not final and self.end.startswith(rest):
                    return
                self.mode = _TEXT  # a missing closing marker is forgiven

    def _separator(self, final: bool) -> None:
        """After a call: the next one, the end of the section, or text."""
        j = skip_space(self.buf)
        if j == len(self.buf):
            if final:
                self.buf = ""  # whitespace after the last call
                self.mode = _TEXT
            return
        ch, rest = self.buf[j], self.buf[j:]
        if self.in_list:
            if ch == ",":
                self.raw = self.buf[: j + 1]
                self.buf = self.buf[j + 1 :]
                self._next_call()
            elif ch == "]":
                self.buf = self.buf[j + 1 :]
                self.mode = _CLOSE
            else:
                self.mode = _TEXT
            return
        # One call per line (or `;`) until the closing marker.
        if self.end and rest.startswith(self.end):
            self.buf = rest[len(self.end) :]
            self.mode = _TEXT
        elif self.end and not final and self.end.startswith(rest):
            return
        elif ch == ";" or (j > 0 and ch in _NAME_START):
            cut = j + 1 if ch == ";" else j
            self.raw = self.buf[:cut]
            self.buf = self.buf[cut:]
            self._next_call()
        else:
            self.mode = _TEXT


class Olmo3Parser(PythonicParser):
    """Olmo 3: `<function_calls>` with one pythonic call per line, then `</function_calls>`."""

    name = "olmo3"
    aliases = ()
    sections = {"<function_calls>": "</function_calls>"}
    bare_list = False
    special_tokens = ("<function_calls>", "</function_calls>")
    priority = 6

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        return "<function_calls>" in template and (
            model_type.startswith("olmo") or "pythonic function call" in template
        )


class Gemma3Parser(PythonicParser):
    """Gemma 3 per Google's function-calling guide: calls in ```` ```tool_code ```` blocks.

    Gemma 3's own template has no tools section, so it is only chosen by name.
    """

    name = "gemma3"
    aliases = ("gemma_pythonic", "gemma")
    sections = {"```tool_code": "```"}
    bare_list = False
    special_tokens = ()
    priority = 0

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        return False
