"""Formats that write a call as a function name and key/value parameters in XML-ish tags.

Qwen3-Coder / Qwen3.5, GLM 4.5 / 4.6 / 4.7 and MiniMax M2 write each parameter's value
as raw text, so its JSON type comes from the tool's schema: a string parameter stays
a string, anything else is read as JSON (or a Python literal), falling back to the
text. The arguments are streamed as JSON text: string values as they are written,
other values when their parameter ends.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any, ClassVar

from pippin.chat.tool_parsers.base import ToolParser, find_marker, partial_marker, skip_ws
from pippin.chat.tool_parsers.named_json import (
    MORE,
    NAME_STOP,
    NO,
    OK,
    expect,
    peek,
    read_until,
    valid_name,
)

_NAME_WINDOW = 128


def schema_types(schema: Any) -> set[str]:
    """The JSON types a parameter's schema allows (empty when it does not say)."""
    if not isinstance(schema, dict):
        return set()
    out: set[str] = set()
    t = schema.get("type")
    if isinstance(t, str):
        out.add(t)
    elif isinstance(t, list):
        out.update(x for x in t if isinstance(x, str))
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in schema.get(key) or ():
            out |= schema_types(sub)
    if not out and isinstance(schema.get("enum"), list):
        names = {str: "string", bool: "boolean", int: "integer", float: "number"}
        out.update(names.get(type(v), "other") for v in schema["enum"])
    return out


def _no_constant(name: str) -> Any:
    raise ValueError(name)


def convert_value(raw: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema asks for."""
    types = schema_types(schema)
    if types and types <= {"string"}:
        return raw
    text = raw.strip()
    try:
        value = json.loads(text, parse_constant=_no_constant)
    except ValueError:
        try:
            value = ast.literal_eval(text)  # Python literals: True, None, {'a': 1}
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
            return raw
    try:  # as JSON has it: no inf (1e999), tuples as lists, no sets or bytes
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return raw


def _tag(s: str, i: int, open_: str, close: str, stop: str) -> tuple[str, str, int]:
    """`open_ TEXT close` at `i`: (status, TEXT, index after `close`)."""
    if not s.startswith(open_, i):
        return (MORE if open_.startswith(s[i:]) else NO), "", i
    status, text, _, j = read_until(s, i + len(open_), (close,), _NAME_WINDOW, stop)
    return status, text, j + len(close)


def _unquote(s: str) -> str:
    s = s.strip()
    if len(s) >= 2 and s[0] == s[-1] and s[0] in "\"'":
        return s[1:-1]
    return s


_TEXT, _CALL, _PARAMS, _VALUE, _AFTER = range(5)


class XmlParamsParser(ToolParser):
    """A call block opened by one of `starts`; the call head is read by `_call_head`,
    each parameter head by `_param_head`, its value runs to `value_end`; `call_end`
    closes the call, `block_end` the block (none: `call_end` closed it). With `invoke`,
    a block holds several calls, each opening with it.
    """

    starts: ClassVar[tuple[str, ...]] = ()
    call_end: ClassVar[str] = ""
    block_end: ClassVar[str] = ""
    invoke: ClassVar[str] = ""
    param_open: ClassVar[str] = ""
    value_end: ClassVar[str] = ""
    trim_newline: ClassVar[bool] = True  # one newline around each value is layout

    def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.state = _TEXT
        self.raw = ""  # consumed text to give back if the call turns out malformed
        self.call_at = 0  # where the current call's text starts (`taken_since`)
        self.props: dict[str, Any] = {}
        self.args_open = False  # the arguments' `{` was sent
        self.key = ""
        self.streaming = False  # the current value is a string sent as it comes
        self.value_begun = False
        self.scan_from = 0
        ends = (self.value_end,)
        self.value_ends = ("\n" + self.value_end, *ends) if self.trim_newline else ends

    # --- format hooks --------------------------------------------------------

    def _call_head(self, s: str) -> tuple[str, str, int]:
        """(status, function name, characters consumed)."""
        raise NotImplementedError

    def _param_head(self, s: str) -> tuple[str, str, int]:
        """(status, parameter name, characters consumed up to its value)."""
        raise NotImplementedError

    # --- the state machine ---------------------------------------------------

    def _run(self, final: bool) -> None:
        while self._step(final):
            pass

    def _step(self, final: bool) -> bool:
        if self.state == _TEXT:
            m = self.scan_text(self.starts, final)
            if m is None:
                return False
            self.raw = m
            self.call_at = self.at - len(m)
            self.state = _CALL
            return True
        if self.state == _CALL:
            return self._read_call(final)
        if self.state == _PARAMS:
            return self._read_param(final)
        if self.state == _VALUE:
            return self._read_stream(final) if self.streaming else self._read_value(final)
        return self._read_after(final)

    def _read_call(self, final: bool) -> bool:
        status, name, n = self._call_head(self.buf)
        if status == MORE and not final:
            return False
        if status == OK and valid_name(name) and self.known(name):
            self.buf = self.buf[n:]
            self.raw = ""
            self.start_call(name)
            params = self.functions.get(name, {}).get("parameters")
            props = params.get("properties") if isinstance(params, dict) else None
            self.props = props if isinstance(props, dict) else {}
            self.args_open = False
            self.state = _PARAMS
            return True
        self.text(self.raw)
        self.raw = ""
        self.state = _TEXT
        return True

    def _read_param(self, final: bool) -> bool:
        status, lit = peek(self.buf, (self.call_end, self.param_open))
        if status == OK and lit == self.call_end:
            self.buf = self.buf[skip_ws(self.buf) + len(lit) :]
            self._close_call()
            self.state = _AFTER
            return True
        key = ""
        if status == OK:
            status, key, n = self._param_head(self.buf)
        if status == OK:
            self.buf = self.buf[n:]
            self._begin_value(key)
            return True
        if status == MORE and not final:
            return False
        if status == MORE:
            self._cut()
        else:
            self._close_call()
            self.state = _TEXT  # malformed: the rest is text
        return True

    def _is_string(self, key: str) -> bool:
        """Whether the parameter's value is a string, kept as written."""
        return schema_types(self.props.get(key)) == {"string"}

    def _begin_value(self, key: str) -> None:
        self.key = key
        self.streaming = self._is_string(key)
        self.value_begun = not self.trim_newline
        self.scan_from = 0
        if self.streaming:
            self._send_key('"')
        self.state = _VALUE

    def _send_key(self, value: str) -> None:
        head = ", " if self.args_open else "{"
        self.args(head + json.dumps(self.key, ensure_ascii=False) + ": " + value)
        self.args_open = True

    def _read_stream(self, final: bool) -> bool:
        """A string value, sent as it is written; the one newline around it is dropped."""
        if not self.value_begun:
            if not self.buf:
                if final:
                    self._cut()
                return False
            if self.buf[0] == "\n":
                self.buf = self.buf[1:]
            self.value_begun = True
        hit = find_marker(self.buf, self.value_ends)
        if hit is not None:
            self.args(_escape(self.buf[: hit[0]]) + '"')
            self.buf = self.buf[hit[0] + len(hit[1]) :]
            self.state = _PARAMS
            return True
        if final:  # what is left may be the start of the end marker: not sent
            self._cut()
            return False
        cut = len(self.buf) - partial_marker(self.buf, self.value_ends)
        self.args(_escape(self.buf[:cut]))
        self.buf = self.buf[cut:]
        return False

    def _read_value(self, final: bool) -> bool:
        """A value of another type: converted and sent when it ends."""
        i = self.buf.find(self.value_end, self.scan_from)
        if i < 0:
            if final:
                self._cut()
                return False
            self.scan_from = max(0, len(self.buf) - len(self.value_end) + 1)
            return False
        raw = self.buf[:i]
        self.buf = self.buf[i + len(self.value_end) :]
        if self.trim_newline:
            raw = raw.removeprefix("\n").removesuffix("\n")
        value = convert_value(raw, self.props.get(self.key))
        self._send_key(json.dumps(value, ensure_ascii=False))
        self.state = _PARAMS
        return True

    def _close_call(self) -> None:
        self.args("}" if self.args_open else "{}")
        self.end_call()

    def _cut(self) -> None:
        """The output ended before the call's end marker: it is not a call."""
        self.drop_call(self.taken_since(self.call_at))
        self.state = _TEXT

    def _read_after(self, final: bool) -> bool:
        """After a call: the block's closing marker, or (with `invoke`) another call."""
        if not self.block_end:
            self.state = _TEXT
            return True
        ends = (self.block_end, self.invoke) if self.invoke else (self.block_end,)
        status, lit = peek(self.buf, ends)
        if status == OK and lit == self.block_end:
            self.buf = self.buf[skip_ws(self.buf) + len(lit) :]
            self.state = _TEXT
        elif status == OK:
            self.call_at = self.at + skip_ws(self.buf)  # the next call of the block
            self.state = _CALL
        elif status == MORE and not final:
            return False
        else:
            if status == MORE:
                self.buf = ""  # the output ended inside the closing markers
            self.state = _TEXT  # no closing marker: what follows is text
        return True


def _escape(s: str) -> str:
    """`s` as the inside of a JSON string; piecewise, it adds up to the whole."""
    return json.dumps(s, ensure_ascii=False)[1:-1]


class Qwen3CoderParser(XmlParamsParser):
    """Qwen3-Coder, Qwen3.5: one call per block, `<tool_call>\\n<function=NAME>\\n`, then
    `<parameter=K>\\nV\\n</parameter>\\n` per parameter, then `</function>\\n</tool_call>`.
    """

    name = "qwen3_coder"
    aliases = ("qwen3_xml",)
    starts = ("<tool_call>",)
    block_end = "</tool_call>"
    call_end = "</function>"
    param_open = "<parameter="
    value_end = "</parameter>"
    special_tokens = ("<tool_call>", "</tool_call>", "<function=", "</function>")
    special_tokens += ("<parameter=", "</parameter>")
    priority = 20  # its templates also write hermes' <tool_call>

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        return "<tool_call>" in template and "<function=" in template

    def _call_head(self, s: str) -> tuple[str, str, int]:
        return _tag(s, skip_ws(s), "<function=", ">", NAME_STOP)

    def _param_head(self, s: str) -> tuple[str, str, int]:
        status, key, n = _tag(s, skip_ws(s), "<parameter=", ">", "\n<")
        return status, key.strip(), n


class Glm45Parser(XmlParamsParser):
    """GLM 4.5 / 4.6: `<tool_call>NAME\\n`, then per parameter
    `<arg_key>K</arg_key>\\n<arg_value>V</arg_value>\\n`, then `</tool_call>`;
    GLM 4.7 writes the same without the newlines.
    """

    name = "glm45"
    aliases = ("glm4_moe", "glm47", "glm4")
    starts = ("<tool_call>",)
    call_end = "</tool_call>"
    param_open = "<arg_key>"
    value_end = "</arg_value>"
    trim_newline = False
    special_tokens = ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>")
    special_tokens += ("<arg_value>", "</arg_value>")
    priority = 20  # its templates also write hermes' <tool_call>

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        return "<arg_key>" in template

    def _call_head(self, s: str) -> tuple[str, str, int]:
        # The name runs to the first parameter, or to the end of a call without any.
        status, name, _, i = read_until(s, 0, ("<arg_key>", "</tool_call>"), _NAME_WINDOW, '{}"')
        return status, name.strip(), i

    def _param_head(self, s: str) -> tuple[str, str, int]:
        status, key, i = _tag(s, skip_ws(s), "<arg_key>", "</arg_key>", "\n")
        if status != OK:
            return status, "", 0
        status, i = expect(s, i, "<arg_value>")
        return status, key.strip(), i


class MiniMaxM2Parser(XmlParamsParser):
    """MiniMax M2: several calls in `<minimax:tool_call>\\n...</minimax:tool_call>`, each
    `<invoke name="NAME">\\n`, then `<parameter name="K">V</parameter>\\n` per parameter,
    then `</invoke>\\n`.
    """

    name = "minimax_m2"
    aliases = ("minimax",)
    starts = ("<minimax:tool_call>",)
    block_end = "</minimax:tool_call>"
    invoke = "<invoke name="
    call_end = "</invoke>"
    param_open = "<parameter name="
    value_end = "</parameter>"
    special_tokens = ("<minimax:tool_call>", "</minimax:tool_call>")
    priority = 20

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        return "<minimax:tool_call>" in template

    def _call_head(self, s: str) -> tuple[str, str, int]:
        status, name, n = _tag(s, skip_ws(s), self.invoke, ">", "\n<")
        return status, _unquote(name), n

    def _param_head(self, s: str) -> tuple[str, str, int]:
        status, key, n = _tag(s, skip_ws(s), self.param_open, ">", "\n<")
        return status, _unquote(key), n


_DSML = "｜DSML｜"
_DSML_PARAM = re.compile(r'\s*"([^"]*)"(?:\s+string="(true|false)")?\s*')


class DeepSeekV32Parser(XmlParamsParser):
    """DeepSeek V3.2's DSML: several calls in
    `<｜DSML｜function_calls>...</｜DSML｜function_calls>`, each
    `<｜DSML｜invoke name="NAME">`, then per parameter
    `<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>`, then
    `</｜DSML｜invoke>`. `string` says whether V is a string or JSON.
    """

    name = "deepseek_v32"
    starts = (f"<{_DSML}function_calls>",)
    block_end = f"</{_DSML}function_calls>"
    invoke = f"<{_DSML}invoke name="
    call_end = f"</{_DSML}invoke>"
    param_open = f"<{_DSML}parameter name="
    value_end = f"</{_DSML}parameter>"
    trim_newline = False
    special_tokens = (*starts, block_end, call_end, value_end)
    priority = 20

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        return _DSML in template  # V3.2-Exp writes V3.1's format: deepseek_v31

    def __init__(self, *a, **kw) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*a, **kw)
        self.string_attr: str | None = None

    def _call_head(self, s: str) -> tuple[str, str, int]:
        status, name, n = _tag(s, skip_ws(s), self.invoke, ">", "\n<")
        return status, _unquote(name), n

    def _param_head(self, s: str) -> tuple[str, str, int]:
        status, attrs, n = _tag(s, skip_ws(s), self.param_open, ">", "\n<")
        m = _DSML_PARAM.fullmatch(attrs)
        if status != OK or m is None:
            return (status if status != OK else NO), "", 0
        self.string_attr = m.group(2)
        return status, m.group(1), n

    def _is_string(self, key: str) -> bool:
        if self.string_attr is None:
            return super()._is_string(key)
        return self.string_attr == "true"
