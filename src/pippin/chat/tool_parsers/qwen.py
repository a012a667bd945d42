"""vllm-mlx's `qwen` tool-call format: Qwen models write a call inside `<tool_call>` tags
either as hermes JSON or, as Qwen3-Coder and Qwen3.5 do, as `<function=NAME>` with
`<parameter=K>` tags. This parser reads both: at the first `<tool_call>` it looks at
what follows and from there on reads the output as that form.
"""

from __future__ import annotations

from typing import ClassVar

from pippin.chat.tool_parsers.tagged_json import _TEXT as _JSON_TEXT
from pippin.chat.tool_parsers.tagged_json import HermesParser, TaggedJsonParser
from pippin.chat.tool_parsers.xml_params import Qwen3CoderParser, XmlParamsParser

_OPEN = "<tool_call>"
_XML = "<function="


class QwenParser(HermesParser, Qwen3CoderParser):
    """Hermes JSON or Qwen3-Coder XML, whichever the model writes first."""

    name = "qwen"
    aliases = ("qwen3",)  # vllm-mlx registers its parser under both
    special_tokens: ClassVar[tuple[str, ...]] = tuple(
        dict.fromkeys(HermesParser.special_tokens + Qwen3CoderParser.special_tokens)
    )
    priority = -1  # never detected: chosen by name (the two forms are detected apart)

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        return False

    def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.form: str | None = None  # "json" or "xml", once known

    def _run(self, final: bool) -> None:
        if self.form is None:
            form = self._pick(final)
            if form == "wait":
                return
            self.form = form
            if self.form is None:
                # Not yet known: text before any `<tool_call>` is the same in both.
                TaggedJsonParser._run(self, final)
                if self.mode != _JSON_TEXT:
                    self.form = "json"  # a bare JSON call
                return
        if self.form == "xml":
            XmlParamsParser._run(self, final)
        else:
            TaggedJsonParser._run(self, final)

    def _pick(self, final: bool) -> str | None:
        """The form after the first `<tool_call>`; None: no marker yet; "wait": the
        marker has come but not enough after it."""
        i = self.buf.find(_OPEN)
        if i < 0:
            return None
        rest = self.buf[i + len(_OPEN) :].lstrip()
        if rest.startswith(_XML):
            return "xml"
        if not final and (not rest or _XML.startswith(rest)):
            # The text before the marker goes out now; the marker waits to be read.
            self.text(self.buf[:i])
            self.buf = self.buf[i:]
            return "wait"
        return "json"
