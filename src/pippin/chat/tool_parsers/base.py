"""What every tool-call parser shares: the output type, text scanning, call bookkeeping.

A parser is an incremental state machine over the model's output text (and the token
ids behind it, for formats defined on tokens). `feed` returns what became certain:
plain text, or the start of a tool call (index, id, name) and fragments of its JSON
arguments. Text that may still turn out to be the start of a tool-call marker is
held back, so no part of a marker ever reaches `content`. The result of a whole
output never depends on how it was split into pieces.

Malformed calls come back as text: a call is only opened once its name is known
(and is one of the request's tools, when the request lists any); if the arguments
go wrong after that, the call is closed with the arguments valid so far and the
rest of the output is text.

A call the output ends inside (cut off by `max_tokens`, a stop string or the end of
the turn before its arguments are complete) is not a call, and nothing is invented to
close it (`drop_call`). Answered whole (`whole=True`), a call's deltas are held until
it ends, so such a call comes back as its text; streamed, what was already sent of it
stays and nothing more is sent.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar


@dataclass
class CallDelta:
    index: int
    id: str | None = None  # set on the first delta of a call, with the name
    name: str | None = None
    arguments: str = ""  # a fragment of the arguments' JSON text


@dataclass
class ParsedDelta:
    content: str = ""
    reasoning: str = ""
    calls: list[CallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.calls)

    def add_args(self, index: int, fragment: str) -> None:
        if not fragment:
            return
        last = self.calls[-1] if self.calls else None
        if last is not None and last.index == index:
            last.arguments += fragment
        else:
            self.calls.append(CallDelta(index, arguments=fragment))

    def merge(self, other: ParsedDelta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        for c in other.calls:
            if c.name is None and self.calls and self.calls[-1].index == c.index:
                self.calls[-1].arguments += c.arguments
            else:
                self.calls.append(CallDelta(c.index, c.id, c.name, c.arguments))


@dataclass
class ToolCall:
    """A whole call, as `ParsedDelta`s add up to."""

    id: str
    name: str
    arguments: str


def collect_calls(deltas: Sequence[CallDelta]) -> list[ToolCall]:
    calls: dict[int, ToolCall] = {}
    for d in deltas:
        if d.name is not None:
            calls[d.index] = ToolCall(d.id or "", d.name, d.arguments)
        else:
            calls[d.index].arguments += d.arguments
    return [calls[i] for i in sorted(calls)]


def random_call_id() -> str:
    return "call_" + secrets.token_hex(12)


JSON_WS = " \t\r\n"


def skip_ws(text: str, i: int = 0) -> int:
    """Index of the first character at or after `i` that is not JSON whitespace."""
    while i < len(text) and text[i] in JSON_WS:
        i += 1
    return i


def partial_marker(text: str, markers: Sequence[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a marker."""
    best = 0
    for m in markers:
        for k in range(min(len(m) - 1, len(text)), best, -1):
            if text.endswith(m[:k]):
                best = k
                break
    return best


def find_marker(text: str, markers: Sequence[str], start: int = 0) -> tuple[int, str] | None:
    """The earliest marker in `text` (the longest one where two start together)."""
    best: tuple[int, str] | None = None
    for m in markers:
        i = text.find(m, start)
        if i >= 0 and (best is None or i < best[0] or (i == best[0] and len(m) > len(best[1]))):
            best = (i, m)
    return best


def tool_functions(tools: Sequence[dict[str, Any]] | None) -> dict[str, dict[str, Any]]:
    """Function definitions by name, from OpenAI-style tool dicts."""
    out: dict[str, dict[str, Any]] = {}
    for t in tools or []:
        fn = t.get("function", t)
        if isinstance(fn, dict) and isinstance(fn.get("name"), str):
            out[fn["name"]] = fn
    return out


class ToolParser:
    """Base class: subclasses implement `_run`, consuming `self.buf`."""

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()  # other names (vLLM's) for the same format
    # Special tokens whose text the parser must see; the engine would skip them otherwise.
    special_tokens: ClassVar[tuple[str, ...]] = ()
    # Detection order: formats that contain another's markers must come first.
    priority: ClassVar[int] = 0
    # A parser that also splits reasoning from the answer (gpt-oss harmony).
    handles_reasoning: ClassVar[bool] = False

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        """Whether a model with this chat template, model type and vocab writes this format."""
        return False

    @classmethod
    def prepare(cls) -> None:
        """Load what the parser needs once, at start-up rather than in a first request."""

    def __init__(
        self,
        tools: Sequence[dict[str, Any]] | None = None,
        new_id: Callable[[], str] = random_call_id,
        *,
        whole: bool = False,
    ) -> None:
        self.functions = tool_functions(tools)
        self.new_id = new_id
        # The output is answered whole, not streamed: a call is reported once it ends.
        self.whole = whole
        self.buf = ""
        self.n_calls = 0
        self.open_call: int | None = None
        self.cut = False  # the output ended inside a call (see `drop_call`)
        self._held: list[CallDelta] = []  # whole: the open call's deltas
        self._in: list[str] = []  # whole: the text taken in, for `taken_since`
        self.n_in = 0  # characters taken in
        self._out = ParsedDelta()
        self.finished = False

    # --- the interface -------------------------------------------------------

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        self.take_in(text)
        self._run(final=False)
        return self._take()

    def finish(self) -> ParsedDelta:
        """The output ended: settle everything held back."""
        self._run(final=True)
        self.finished = True
        if self.open_call is not None:
            self.end_call()
        if self.buf:
            self.text(self.buf)
            self.buf = ""
        return self._take()

    @property
    def called(self) -> bool:
        """Whether any tool call was produced (finish_reason "tool_calls")."""
        return self.n_calls > 0

    # --- for subclasses ------------------------------------------------------

    def _run(self, final: bool) -> None:
        raise NotImplementedError

    def known(self, name: str) -> bool:
        """Whether `name` may be called: any name when the request listed no tools."""
        return bool(name) and (not self.functions or name in self.functions)

    def text(self, s: str) -> None:
        self._out.content += s

    def take_in(self, text: str) -> None:
        """Append output text to `buf`."""
        self.buf += text
        self.n_in += len(text)
        if self.whole:
            self._in.append(text)

    @property
    def at(self) -> int:
        """Where `buf` starts in the text taken in (parsers only consume from its front)."""
        return self.n_in - len(self.buf)

    def taken_since(self, start: int) -> str:
        """The text taken in from `start` on; only kept when answering whole."""
        return "".join(self._in)[start:] if self.whole else ""

    def start_call(self, name: str, call_id: str | None = None) -> int:
        assert self.open_call is None
        index = self.n_calls
        self.n_calls += 1
        self.open_call = index
        delta = CallDelta(index, call_id or self.new_id(), name)
        (self._held if self.whole else self._out.calls).append(delta)
        return index

    def args(self, fragment: str) -> None:
        assert self.open_call is not None
        if self.whole:
            self._held[-1].arguments += fragment
        else:
            self._out.add_args(self.open_call, fragment)

    def end_call(self) -> None:
        self.open_call = None
        self._out.calls.extend(self._held)
        self._held = []

    def drop_call(self, text: str) -> None:
        """The output ended inside the open call (its arguments incomplete): it is not a
        call. Answered whole, `text` (what the model wrote of the call) is content;
        streamed, what was sent of it stays and nothing more is sent."""
        assert self.open_call is not None
        self.open_call = None
        self.n_calls -= 1
        self.cut = True
        self.buf = ""
        if self.whole:
            self._held = []
            self.text(text)

    def whole_call(self, name: str, arguments: Any, call_id: str | None = None) -> None:
        """A call known all at once (formats that are parsed when they end)."""
        self.start_call(name, call_id)
        self.args(arguments if isinstance(arguments, str) else json.dumps(arguments))
        self.end_call()

    def scan_text(self, markers: Sequence[str], final: bool) -> str | None:
        """Send text up to the first marker and consume it; None if there is none yet.

        Without a marker, everything but a tail that may start one is sent.
        """
        hit = find_marker(self.buf, markers)
        if hit is not None:
            i, m = hit
            self.text(self.buf[:i])
            self.buf = self.buf[i + len(m) :]
            return m
        keep = 0 if final else partial_marker(self.buf, markers)
        cut = len(self.buf) - keep
        self.text(self.buf[:cut])
        self.buf = self.buf[cut:]
        return None

    def _take(self) -> ParsedDelta:
        out, self._out = self._out, ParsedDelta()
        return out
