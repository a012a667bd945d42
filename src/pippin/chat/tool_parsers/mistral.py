"""Mistral: `[TOOL_CALLS]` then calls, in one of two forms by tokenizer version.

Before v11 (Mistral 7B v0.3, Nemo, Small 3.1): a JSON list of call objects,
`[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`. From v11 (Small 3.2,
Devstral, Magistral): `[TOOL_CALLS]NAME[ARGS]{...}` once per call, some versions with
`[CALL_ID]ID` before `[ARGS]`. Which one follows is told by the first character.
"""

from __future__ import annotations

from pippin.chat.tool_parsers.base import skip_ws
from pippin.chat.tool_parsers.json_calls import CUT, ERROR, MORE, JsonCallReader
from pippin.chat.tool_parsers.named_json import (
    HEAD,
    NO,
    OK,
    TEXT,
    NamedJsonParser,
    object_start,
    read_until,
    valid_name,
)

_ARGS = "[ARGS]"
_CALL_ID = "[CALL_ID]"
_STOP = " \t\r\n\"'<>}"  # not `[` nor `{`: they start delimiters


class MistralParser(NamedJsonParser):
    name = "mistral"
    starts = ("[TOOL_CALLS]",)
    special_tokens = ("[TOOL_CALLS]", _ARGS, _CALL_ID)
    priority = 20

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        # Some repositories ship no template (mistral_common renders the prompt).
        return "[TOOL_CALLS]" in template or (not template and "[TOOL_CALLS]" in vocab)

    def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.reader: JsonCallReader | None = None

    def _step(self, final: bool) -> bool:
        if self.reader is not None:
            used, status = self.reader.step(self.buf, final)
            self.buf = self.buf[used:]
            if status == MORE:
                return False
            if status == CUT:
                self.drop_call(self.reader.cut_text(self.raw))
            elif status == ERROR:
                if self.reader.calls == 0:
                    self.text(self.raw)
                self.text(self.reader.raw)
            self.reader = None
            self.raw = ""
            self.state = TEXT
            return True
        if self.state == HEAD:
            j = skip_ws(self.buf)
            if j == len(self.buf) and not final:
                return False
            if j < len(self.buf) and self.buf[j] in "[{":  # the old form: JSON
                self.reader = JsonCallReader(self, many=True)
                return True
        return super()._step(final)

    def _head(self, s: str) -> tuple[str, str, str | None, int]:
        status, name, delim, i = read_until(s, 0, (_ARGS, _CALL_ID, "{"), 128, _STOP)
        if status != OK or not valid_name(name):
            return (status if status != OK else NO), "", None, 0
        call_id = None
        if delim == _CALL_ID:
            status, call_id, delim, i = read_until(s, i + len(delim), (_ARGS,), 64, _STOP)
            if status != OK or not call_id:
                return (status if status != OK else NO), "", None, 0
        if delim == _ARGS:
            i += len(_ARGS)
        # Without `[ARGS]`: decoded with special tokens skipped, the name runs into `{`.
        status, j = object_start(s, i)
        return status, name, call_id, j
