"""Formats that wrap JSON call objects in markers: hermes / Qwen, and its relatives.

`TaggedJsonParser` is configured by class attributes: the markers that open a call
section, the marker that closes it (or none: the section runs to the end), and
whether the section holds a list of calls.
"""

from __future__ import annotations

from typing import ClassVar

from pippin.chat.tool_parsers.base import ToolParser, partial_marker
from pippin.chat.tool_parsers.json_calls import CUT, DONE, ERROR, MORE, JsonCallReader

_TEXT, _BODY, _END = 0, 1, 2


class TaggedJsonParser(ToolParser):
    starts: ClassVar[tuple[str, ...]] = ()
    end: ClassVar[str] = ""
    many: ClassVar[bool] = False  # the section holds a JSON list of calls
    list_optional: ClassVar[bool] = True  # ...or a single object
    # Calls may also come without markers when the output starts with one (and one bare
    # call may follow another): what small models often write.
    bare: ClassVar[bool] = False
    # Code fences such a bare call may come in at the start of the output.
    fences: ClassVar[tuple[str, ...]] = ()
    # Opening markers (of `starts` or `fences`) whose section another marker than `end`
    # closes ("": none, the section runs to the end).
    closings: ClassVar[dict[str, str]] = {}

    def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.mode = _TEXT
        self.marker = ""
        self.reader: JsonCallReader | None = None
        self.bare_ok = self.bare

    def _run(self, final: bool) -> None:
        while True:
            if self.mode == _TEXT and self.bare_ok:
                head = self.buf.lstrip()
                if not final and (not head or any(f.startswith(head) for f in self.fences)):
                    return
                self.bare_ok = False
                fence = next((f for f in self.fences if head.startswith(f)), "")
                if fence or head.startswith("[" if self.many else "{"):
                    # Not JSON, or not a call of a known tool: the reader hands it back.
                    self.buf = head[len(fence) :]
                    self.marker = fence
                    self.reader = JsonCallReader(self, self.many, self.list_optional)
                    self.mode = _BODY
            if self.mode == _TEXT:
                m = self.scan_text(self.starts, final)
                if m is None:
                    return
                self.marker = m
                self.reader = JsonCallReader(self, self.many, self.list_optional)
                self.mode = _BODY
            if self.mode == _BODY:
                assert self.reader is not None
                used, status = self.reader.step(self.buf, final)
                self.buf = self.buf[used:]
                if status == MORE:
                    return
                if status == CUT:
                    self.drop_call(self.reader.cut_text(self.marker))
                    return
                if status == ERROR:
                    if self.reader.calls == 0:
                        self.text(self.marker)
                    self.text(self.reader.raw)
                    self.mode = _TEXT
                    continue
                assert status == DONE
                if not self.marker:
                    self.bare_ok = True
                self.mode = _END if self.closing and self.marker else _TEXT
            if self.mode == _END:
                stripped = self.buf.lstrip()
                if stripped.startswith(self.closing):
                    self.buf = stripped[len(self.closing) :]
                    self.mode = _TEXT
                    self.bare_ok = self.marker in self.fences  # another may follow
                    continue
                if not final and (
                    not stripped or partial_marker(stripped, (self.closing,)) == len(stripped)
                ):
                    return
                self.mode = _TEXT  # no closing marker: what follows is text

    @property
    def closing(self) -> str:
        """The marker that closes the open section."""
        return self.closings.get(self.marker, self.end)


class HermesParser(TaggedJsonParser):
    """`<tool_call>{"name": ..., "arguments": ...}</tool_call>`: Hermes, Qwen 2.5 / 3."""

    name = "hermes"
    aliases = ("qwen2_5", "json_tools", "nous")  # "qwen" reads both Qwen forms (qwen.py)
    starts = ("<tool_call>",)
    bare = True  # Qwen2.5-Coder often leaves the tags out, or writes a ```json block
    fences = ("```json", "```\n")
    closings = dict.fromkeys(fences, "```")
    end = "</tool_call>"
    special_tokens = ("<tool_call>", "</tool_call>")
    priority = 10  # generic: other formats also use <tool_call>

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        return "<tool_call>" in template
