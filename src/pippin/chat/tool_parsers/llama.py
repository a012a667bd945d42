"""Llama 3.1 / 3.2 / 3.3 (and Llama 4's official template): JSON calls opening the answer.

The answer begins (after whitespace) with `{"name": ..., "parameters": {...}}`
("arguments" too), several calls separated by `;` (or only by whitespace), or with
`<|python_tag|>` and the same JSON. After `<|python_tag|>` Llama 3.1 also calls its
built-in tools in Python, as `brave_search.call(query="...")`: that is a call of
`brave_search` only when the request lists a tool of that name. JSON later in the answer
is prose, not a call; `<|python_tag|>` is a special token, so it opens calls wherever it
appears.
"""

from __future__ import annotations

from pippin.chat.tool_parsers.base import ToolParser
from pippin.chat.tool_parsers.json_calls import CUT, DONE, ERROR, MORE, JsonCallReader
from pippin.chat.tool_parsers.pythonic import PyCallReader, parse_call, skip_space

PYTHON_TAG = "<|python_tag|>"
_BUILTIN_SUFFIX = ".call"

_START, _TEXT, _TAG, _JSON, _SEP, _BUILTIN = range(6)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    aliases = ("llama3", "llama", "llama4_json", "llama4")
    special_tokens = (PYTHON_TAG,)
    priority = 4

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        # The official templates name the JSON format (Llama 4's too) and the built-in
        # tools' tag; model_type "llama" alone says nothing (SmolLM2 is ChatML).
        return PYTHON_TAG in template or '"parameters": dictionary of argument name' in template

    def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.mode = _START
        self.marker = ""  # "" or the tag; given back as text if no call follows
        self.sep = ""  # the `;` before the current object, text if it is not a call
        self.section_calls = 0
        self.reader = JsonCallReader(self)
        self.builtin = PyCallReader(self._builtin)

    def _builtin(self, name: str) -> bool:
        base = name.removesuffix(_BUILTIN_SUFFIX)
        return name.endswith(_BUILTIN_SUFFIX) and base in self.functions

    def _json(self, marker: str) -> None:
        self.marker, self.sep = marker, ""
        self.section_calls = 0
        self.reader = JsonCallReader(self)
        self.mode = _JSON

    def _run(self, final: bool) -> None:  # noqa: C901 - one branch per state
        while True:
            if self.mode == _START:
                j = skip_space(self.buf)
                if j == len(self.buf) and not final:
                    return
                if self.buf[j : j + 1] == "{":
                    self._json("")
                else:
                    self.mode = _TEXT
            if self.mode == _TEXT:
                if self.scan_text((PYTHON_TAG,), final) is None:
                    return
                self.mode = _TAG
            if self.mode == _TAG:
                j = skip_space(self.buf)
                if j == len(self.buf) and not final:
                    return
                head = self.buf[j : j + 1]
                if head == "{":
                    self._json(PYTHON_TAG)
                elif head.isidentifier():
                    self.marker = PYTHON_TAG + self.buf[:j]
                    self.buf = self.buf[j:]
                    self.builtin = PyCallReader(self._builtin)
                    self.mode = _BUILTIN
                else:
                    self.text(PYTHON_TAG)
                    self.mode = _TEXT
                    continue
            if self.mode == _JSON:
                used, status = self.reader.step(self.buf, final)
                self.buf = self.buf[used:]
                if status == MORE:
                    return
                if status == CUT:
                    marker = self.marker if self.section_calls == 0 else ""
                    self.drop_call(marker + self.sep + self.reader.raw)
                    return
                if status == ERROR:
                    blank = not (self.reader.raw + self.buf).strip()
                    if final and blank and self.section_calls and self.reader.calls == 0:
                        self.buf = ""  # a `;` after the last call
                        self.mode = _TEXT
                        continue
                    if self.reader.calls == 0:  # not a call: give the text back
                        if self.section_calls == 0:
                            self.text(self.marker)
                        self.text(self.sep)
                    self.text(self.reader.raw)
                    self.mode = _TEXT
                    continue
                assert status == DONE
                self.section_calls += 1
                self.mode = _SEP
            if self.mode == _SEP:
                j = skip_space(self.buf)
                if j == len(self.buf):
                    if not final:
                        return
                    self.buf = ""  # whitespace after the last call
                    self.mode = _TEXT
                elif self.buf[j] in ";{":  # `;` between calls; some write one per line
                    cut = j + 1 if self.buf[j] == ";" else j
                    self.sep = self.buf[:cut]
                    self.buf = self.buf[cut:]
                    self.reader = JsonCallReader(self)
                    self.mode = _JSON
                else:
                    self.mode = _TEXT  # what follows the calls is text
                continue
            if self.mode == _BUILTIN:
                used, status = self.builtin.step(self.buf, final)
                self.buf = self.buf[used:]
                if status == MORE:
                    return
                args = parse_call(self.builtin.text) if status == DONE else None
                if args is None:
                    self.text(self.marker + self.builtin.text)
                else:
                    assert self.builtin.name is not None
                    self.whole_call(self.builtin.name.removesuffix(_BUILTIN_SUFFIX), args)
                self.mode = _TEXT
