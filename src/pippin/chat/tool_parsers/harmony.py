"""gpt-oss's harmony format: one output holds several messages, each on a channel.

The prompt ends with `<|start|>assistant`, so the output opens with a header (one
line in the output, broken here):

    <|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant
    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}
    <|call|>

or, answering, `...<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>`.
The `analysis` channel is reasoning; a message to `functions.NAME` (on any channel, as
gpt-oss sometimes addresses tools from `analysis`) is a tool call whose body is the JSON
arguments; every other message (`final`, `commentary` preambles) is answer text.

Harmony is defined on tokens: given token ids, openai-harmony's `StreamableParser`
reads them. Its o200k vocabulary may be unavailable offline (tiktoken downloads it;
set `TIKTOKEN_ENCODINGS_BASE` to a folder holding `o200k_base.tiktoken`), so the same
structure is also read from the text, which carries the special tokens because this
parser lists them. Token input the library rejects is read from its decoded text.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pippin.chat.tool_parsers.base import ParsedDelta, ToolParser, find_marker, partial_marker
from pippin.chat.tool_parsers.json_prefix import JsonPrefix

if TYPE_CHECKING:
    from openai_harmony import HarmonyEncoding, StreamableParser

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
STOPS = (END, CALL, RETURN)  # end a message body
# What may open the first header, the prompt having written `<|start|>assistant`.
_OPENERS = (CHANNEL, MESSAGE, CONSTRAIN, " to=")
_HEADER_MAX = 256  # characters; a longer "header" is text that never reached <|message|>
_HEADER_MAX_TOKENS = 64
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(r"<\|channel\|>\s*([^\s<]+)")

_OUT, _HEAD, _BODY = 0, 1, 2  # between messages, in a header, in a body
# How a message body is used.
_REASONING, _CONTENT, _CALL = "reasoning", "content", "call"
# Where a call's body stands.
_WAIT, _ARGS, _AFTER, _TEXT = 0, 1, 2, 3


@functools.cache
def harmony_encoding() -> HarmonyEncoding | None:
    """The gpt-oss encoding, or None where its vocab file cannot be had."""
    try:
        from openai_harmony import HarmonyEncodingName, load_harmony_encoding

        return load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)
    except Exception:  # offline without a local vocab file, or the library is missing
        return None


@functools.cache
def _marker_ids() -> dict[int, str]:
    enc = harmony_encoding()
    assert enc is not None
    return {enc.encode(m, allowed_special="all")[0]: m for m in MARKERS}


class HarmonyParser(ToolParser):
    name = "gpt_oss"
    aliases = ("openai", "harmony", "gpt-oss")
    special_tokens = MARKERS
    priority = 50
    handles_reasoning = True

    @classmethod
    def matches(cls, template: str, model_type: str, vocab: set[str] | dict[str, int]) -> bool:
        return model_type == "gpt_oss" or CHANNEL in template

    @classmethod
    def prepare(cls) -> None:
        # The library may try to download its vocab file: better at start-up than mid-request.
        harmony_encoding()

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.mode: str | None = None  # "tokens" or "text", fixed by the first input
        self.enc: HarmonyEncoding | None = None
        self.tokens: StreamableParser | None = None
        self.decoding = False  # token ids are decoded and read as text from here on
        self.undecoded: list[int] = []
        self.state = _HEAD  # the prompt opened the first header
        self.fresh = True  # nothing of the first header seen yet
        self.header = ""
        self.header_ids: list[int] = []
        self.n_msgs = 0
        self.kind = _CONTENT
        self.call_name = ""
        self.call_state = _TEXT
        self.held = ""  # whitespace in a call body whose fate is not known yet
        self.args_jp = JsonPrefix()
        self.args_text = ""
        self.args_sent = 0

    # --- input ---------------------------------------------------------------

    def feed(self, text: str, token_ids: Sequence[int] = ()) -> ParsedDelta:
        if self.mode is None and (text or len(token_ids)):
            enc = harmony_encoding() if len(token_ids) else None
            if enc is not None:
                from openai_harmony import Role, StreamableParser

                self.enc = enc
                self.tokens = StreamableParser(enc, role=Role.ASSISTANT)
                self.mode = "tokens"
            else:
                self.mode = "text"
        if self.mode == "tokens":
            for t in token_ids:  # `text` is the same output, already in the ids
                self._token(t)
        elif self.mode == "text":
            self.take_in(text)
            self._run(final=False)
        return self._take()

    def finish(self) -> ParsedDelta:
        if self.mode == "tokens" and not self.decoding and self.state == _HEAD:
            self._decode_from(self.header_ids)  # a header cut short is read as text
        if self.undecoded:
            assert self.enc is not None
            self.take_in(self.enc.decode(self.undecoded))
            self.undecoded = []
        if self.mode == "text" or self.decoding:
            self._run(final=True)
        if self.state == _BODY:
            if self.kind == _CALL and self.call_state == _ARGS:
                # The output ended inside the arguments: the body is all there is of it.
                self.drop_call(self.args_text)
                self.kind, self.call_state = _CONTENT, _TEXT
            else:
                self._end_message()
        self.finished = True
        return self._take()

    # --- tokens --------------------------------------------------------------

    def _token(self, t: int) -> None:
        if self.decoding:
            self._decode(t)
            return
        assert self.enc is not None and self.tokens is not None
        marker = _marker_ids().get(t)
        if self.fresh:
            self.fresh = False
            if marker not in _OPENERS and not " to=".startswith(self.enc.decode([t])[:4]):
                self._decode_from([t])  # plain text, or a header the library misreads
                return
        if self.state == _HEAD and marker in (*STOPS, START):
            self._decode_from([*self.header_ids, t])  # not a header: text, as below
            return
        before = self.state
        try:
            self.tokens.process(t)
        except Exception:  # the library rejects the sequence: read it as text from here
            self._decode_from([*self.header_ids, t])
            return
        if before == _OUT:  # only <|start|> gets here
            self.state, self.header_ids = _HEAD, [t]
        elif before == _HEAD:
            if marker == MESSAGE:
                self.state, self.header_ids = _BODY, []
                self._begin(self.tokens.current_channel, self.tokens.current_recipient)
            else:
                self.header_ids.append(t)
                if len(self.header_ids) > _HEADER_MAX_TOKENS:
                    self._decode_from(self.header_ids)
        elif marker in STOPS:
            self._end_message()
            self.state = _OUT
        elif marker is None and not self.enc.is_special_token(t):
            self._body(self.tokens.last_content_delta or "")
        # Other special tokens in a body (misplaced markers, <|endoftext|>) are dropped.

    def _decode_from(self, ids: list[int]) -> None:
        """Leave the library: read the unfinished header and all that follows as text."""
        self.fresh = (
            self.state == _HEAD
            and self.n_msgs == 0
            and not (self.header_ids and _marker_ids().get(self.header_ids[0]) == START)
        )
        self.decoding = True
        self.state, self.header = (_HEAD if self.fresh else _OUT), ""
        for t in ids:
            self._decode(t)

    def _decode(self, t: int) -> None:
        enc = self.enc
        assert enc is not None
        if enc.is_special_token(t) and t not in _marker_ids():
            return  # e.g. <|endoftext|>: the engine leaves these out of the text too
        self.undecoded.append(t)
        try:
            text = enc.decode_utf8(self.undecoded)
        except Exception:  # a character split across tokens
            if len(self.undecoded) < 4:
                return
            text = enc.decode(self.undecoded)
        self.undecoded = []
        self.take_in(text)
        self._run(final=False)

    # --- text ----------------------------------------------------------------

    def _run(self, final: bool) -> None:
        while True:
            if self.fresh:  # the first header has no marker of its own
                if not final and any(
                    len(self.buf) < len(o) and o.startswith(self.buf) for o in _OPENERS
                ):
                    return
                self.fresh = False
                if self.buf.startswith(_OPENERS):
                    self.state, self.header = _HEAD, ""
                else:
                    self.state = _OUT
            if self.state == _OUT:
                m = self.scan_text(MARKERS, final)
                if m is None:
                    return
                if m in (START, CHANNEL):
                    self.state, self.header = _HEAD, (m if m == CHANNEL else "")
                continue  # other markers between messages are dropped
            if self.state == _HEAD:
                hit = find_marker(self.buf, (MESSAGE, *STOPS, START))
                if hit is None:
                    if not final and len(self.header) + len(self.buf) <= _HEADER_MAX:
                        return
                    self._bad_header(len(self.buf))
                    continue
                i, m = hit
                if m != MESSAGE or len(self.header) + i > _HEADER_MAX:
                    self._bad_header(i)
                    continue
                header = self.header + self.buf[:i]
                self.buf = self.buf[i + len(m) :]
                self.state = _BODY
                ch, to = _CHANNEL.search(header), _RECIPIENT.search(header)
                self._begin(ch.group(1) if ch else None, to.group(1) if to else None)
            hit = find_marker(self.buf, MARKERS)
            if hit is None:
                keep = 0 if final else partial_marker(self.buf, MARKERS)
                cut = len(self.buf) - keep
                self._body(self.buf[:cut])
                self.buf = self.buf[cut:]
                return
            i, m = hit
            self._body(self.buf[:i])
            self.buf = self.buf[i + len(m) :]
            if m in STOPS:
                self._end_message()
                self.state = _OUT
            # other markers inside a body are dropped, as on the token path

    def _bad_header(self, n: int) -> None:
        """Not a header after all: its words are text, its markers dropped."""
        words = self.header + self.buf[:n]
        for m in MARKERS:
            words = words.replace(m, "")
        self.text(words)
        self.buf = self.buf[n:]
        self.header = ""
        self.state = _OUT

    # --- messages ------------------------------------------------------------

    def _begin(self, channel: str | None, recipient: str | None) -> None:
        self.n_msgs += 1
        if recipient and recipient.startswith("functions."):
            self.kind = _CALL
            self.call_name = recipient[len("functions.") :]
            self.call_state = _WAIT if self.known(self.call_name) else _TEXT
            self.held = ""
        else:
            self.kind = _REASONING if channel == "analysis" else _CONTENT

    def _body(self, s: str) -> None:
        if not s:
            return
        if self.kind == _REASONING:
            self._out.reasoning += s
        elif self.kind == _CONTENT:
            self.text(s)
        else:
            self._call_body(s)

    def _call_body(self, s: str) -> None:
        if self.call_state in (_WAIT, _AFTER):
            self.held += s
            if not self.held.strip():
                return
            s, self.held = self.held, ""
            if self.call_state == _WAIT and s.lstrip().startswith("{"):
                s = s.lstrip()
                self.start_call(self.call_name)
                self.args_jp, self.args_text, self.args_sent = JsonPrefix(), "", 0
                self.call_state = _ARGS
            else:  # a body that is no JSON object, or text after the arguments
                self.call_state = _TEXT
        if self.call_state == _ARGS:
            n = self.args_jp.feed(s)
            self.args_text += s[:n]
            self._send_args()
            if self.args_jp.done:
                self.end_call()
                self.call_state = _AFTER
                self._call_body(s[n:])
                return
            if not self.args_jp.failed:
                return
            self._close_args()
            self.call_state = _TEXT
            s = s[n:]
        if self.call_state == _TEXT:
            self.text(s)

    def _send_args(self) -> None:
        safe = self.args_jp.safe
        if safe > self.args_sent:
            self.args(self.args_text[self.args_sent : safe])
            self.args_sent = safe

    def _close_args(self) -> None:
        """Close the call with the arguments valid so far."""
        self.args_jp.finish()
        self._send_args()
        if not self.args_jp.done:
            self.args(self.args_jp.closers())
        self.end_call()

    def _end_message(self) -> None:
        if self.kind == _CALL:
            if self.call_state == _WAIT:  # an empty body: a call without arguments
                self.whole_call(self.call_name, "{}")
            elif self.call_state == _ARGS:
                self._close_args()
        self.kind, self.call_state, self.held = _CONTENT, _TEXT, ""
