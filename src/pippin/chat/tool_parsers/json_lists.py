"""Formats that write a JSON list of call objects behind a marker.

Granite 3.x `<|tool_call|>[...]`, Phi-4-mini `functools[...]`, Llama-Nemotron
`<TOOLCALL>[...]</TOOLCALL>` and Salesforce xLAM (a bare list, or one in a fence or
behind a marker). All are `TaggedJsonParser` configurations.
"""

from __future__ import annotations

from pippin.chat.tool_parsers.json_calls import JsonCallReader
from pippin.chat.tool_parsers.tagged_json import _BODY, TaggedJsonParser


class GraniteParser(TaggedJsonParser):
    """Granite 3.x: `<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`.

    Granite 3.1 wrote the marker as the plain string `<tool_call>`; Granite 4 uses
    hermes `<tool_call>{...}</tool_call>` and its template has no `<|tool_call|>`.
    """

    name = "granite"
    aliases = ("granite3",)
    starts = ("<|tool_call|>", "<tool_call>")
    end = "</tool_call>"  # only ever after a hermes-style object; optional
    many = True
    special_tokens = ("<|tool_call|>",)
    priority = 20

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        return "<|tool_call|>" in template


class Phi4MiniParser(TaggedJsonParser):
    """Phi-4-mini-instruct: `functools[{"name": ..., "arguments": {...}}, ...]`, no closer."""

    name = "phi4_mini"
    aliases = ("phi4_mini_json",)
    starts = ("functools",)
    many = True
    list_optional = False  # a bare word "functools" in prose is text
    priority = 20

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        # The stock template passes tools in `<|tool|>...<|/tool|>`; vLLM's names the marker.
        return "functools" in template or ("<|tool|>" in template and "<|/tool|>" in template)


class NemotronParser(TaggedJsonParser):
    """Llama-Nemotron: `<TOOLCALL>[{"name": ..., "arguments": {...}}]</TOOLCALL>`."""

    name = "nemotron"
    aliases = ("nemotron_json", "llama_nemotron_json", "nemotron3")
    starts = ("<TOOLCALL>",)
    end = "</TOOLCALL>"
    many = True
    special_tokens = ("<TOOLCALL>", "</TOOLCALL>")
    priority = 20

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        return "<TOOLCALL>" in template


# xLAM's closing marker depends on the opening one; "" is the bare list at the start.
_TOOL_CALLS = "[TOOL_CALLS]"
_XLAM_ENDS = {"```json": "```", "```\n": "```", _TOOL_CALLS: "", "<tool_call>": "</tool_call>"}


class XlamParser(TaggedJsonParser):
    """Salesforce xLAM: `[{"name": ..., "arguments": {...}}, ...]` as the whole answer.

    The list may also come in a ```json fence, or behind `[TOOL_CALLS]` or `<tool_call>`
    (vLLM's xlam parser accepts the same). A bare list counts only at the start of the
    output: brackets later in prose are text.
    """

    name = "xlam"
    # "```" alone would match before "```json" could be seen; fences carry a tag or newline.
    starts = tuple(_XLAM_ENDS)
    closings = _XLAM_ENDS
    many = True
    priority = 20

    def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.at_start = True

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        # xLAM's templates name their team in the default system prompt.
        return "xLAM" in template

    def _run(self, final: bool) -> None:
        if self.at_start:
            head = self.buf.lstrip()
            if not final and (not head or _TOOL_CALLS.startswith(head)):
                return
            self.at_start = False
            if head.startswith("[") and not head.startswith(_TOOL_CALLS):
                self.marker = ""
                self.reader = JsonCallReader(self, many=True, list_optional=False)
                self.mode = _BODY
        super()._run(final)
