"""What the server may serve: one `ModelSpec` per chat model, from `--model` (repeated) or
`--models FILE` (YAML), and the parsing of those inputs (sizes, alias patterns).

A `--models` file is a list of models, or a mapping with a ``models`` list::

    models:
      - model: ~/models/Qwen2.5-Coder-0.5B-Instruct-Q4_K_M.gguf   # path, GGUF or Hub id
        name: coder                  # served name (default: the model's own name)
        aliases: [qwen-coder]
        tool_call_parser: hermes     # default: the server's --tool-call-parser
        reasoning_parser: none
        chat_template: ./coder.jinja # a file, or the template text itself
        sampling: {temperature: 0.2} # defaults above the model's generation_config.json
        max_model_len: 8192
        pinned: true                 # loaded at start-up, never unloaded
        idle_ttl: 600                # seconds idle before unloading (on-demand models)
        default: true                # what the name "default" means (default: the first)
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# Request fields a model's `sampling` may give defaults for (SamplingParams names).
SAMPLING_KEYS = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "max_tokens",
    }
)
_KEYS = frozenset(
    {
        "model",
        "name",
        "names",
        "aliases",
        "tool_call_parser",
        "reasoning_parser",
        "chat_template",
        "sampling",
        "max_model_len",
        "pinned",
        "idle_ttl",
        "default",
    }
)
_UNITS = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)b?\s*$", re.IGNORECASE)


class SpecError(ValueError):
    """A bad --models file or flag value; the message is one line."""


@dataclass
class ModelSpec:
    """One chat model the server may serve.

    ``model`` is the path, GGUF file or Hub id exactly as given (None: the bundled default
    model); ``names`` the served names (empty: the model's own name); ``aliases`` more
    names. None in ``tool_call_parser`` / ``reasoning_parser`` means the server's flag.
    ``pinned`` models load at start-up and are never unloaded or evicted; the others load
    on their first request and unload after ``idle_ttl`` seconds idle (None: never).
    ``preload`` (the one model of `pippin serve MODEL`, the first of several ``--model``)
    loads at start-up too but is otherwise on demand: a request's ``keep_alive`` 0
    unloads it, and the next request loads it again."""

    model: str | None = None
    names: list[str] = field(default_factory=list)
    aliases: list[str] = field(default_factory=list)
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    sampling: dict[str, Any] = field(default_factory=dict)
    max_model_len: int | None = None
    pinned: bool = False
    idle_ttl: float | None = None
    default: bool = False
    preload: bool = False
    # Ollama's SYSTEM and MESSAGE (library models, `pippin.serving.library_models`): the
    # system prompt of a request that brings none, and a conversation put before its own.
    system: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)


def parse_size(text: str) -> int:
    """Bytes from ``16GB``, ``512MiB``, ``1.5G`` or a plain number."""
    m = _SIZE.match(str(text))
    if not m:
        raise SpecError(f"not a size: {text!r} (use e.g. 16GB, 512MiB or a number of bytes)")
    number, unit, binary = m.groups()
    scale = _UNITS[unit.lower()]
    if binary and unit:
        scale = 1024 ** "kmgt".index(unit.lower()) * 1024
    return int(float(number) * scale)


def parse_alias(text: str) -> tuple[str, str]:
    """``PATTERN=MODEL`` (``claude-*=coder``): request names matching the shell-style
    pattern go to the model served as MODEL."""
    pattern, sep, target = text.partition("=")
    if not sep or not pattern.strip() or not target.strip():
        raise SpecError(f"not PATTERN=MODEL: {text!r}")
    return pattern.strip(), target.strip()


def load_specs(path: str | Path) -> list[ModelSpec]:
    """The models of a --models YAML file; a mistake is a `SpecError` naming it."""
    import yaml

    path = Path(path).expanduser()
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise SpecError(f"cannot read {path}: {str(e).splitlines()[0]}") from None
    if isinstance(data, dict):
        data = data.get("models")
    if not isinstance(data, list) or not data:
        raise SpecError(f"{path}: expected a list of models (or a 'models:' list)")
    specs = [_spec(item, i, path.parent) for i, item in enumerate(data)]
    if sum(s.default for s in specs) > 1:
        raise SpecError(f"{path}: more than one model says default: true")
    return specs


def _spec(item: Any, i: int, base: Path) -> ModelSpec:
    where = f"models[{i}]"
    if isinstance(item, str):
        return ModelSpec(model=item)
    if not isinstance(item, dict):
        raise SpecError(f"{where}: expected a mapping or a model path")
    unknown = sorted(set(item) - _KEYS)
    if unknown:
        raise SpecError(f"{where}: unknown key {unknown[0]!r}; known: {', '.join(sorted(_KEYS))}")
    names = item.get("names") or ([item["name"]] if item.get("name") else [])
    sampling = item.get("sampling") or {}
    if not isinstance(sampling, dict) or set(sampling) - SAMPLING_KEYS:
        bad = sorted(set(sampling) - SAMPLING_KEYS) if isinstance(sampling, dict) else ["?"]
        raise SpecError(
            f"{where}.sampling: unknown field {bad[0]!r}; known: {', '.join(sorted(SAMPLING_KEYS))}"
        )
    template = item.get("chat_template")
    if template is not None and "{" not in str(template):
        file = (base / str(template)).expanduser()
        try:
            template = file.read_text()
        except OSError as e:
            raise SpecError(f"{where}.chat_template: cannot read {file}: {e.strerror}") from None
    ttl = item.get("idle_ttl")
    length = item.get("max_model_len")
    if ttl is not None and (not isinstance(ttl, int | float) or ttl < 0):
        raise SpecError(f"{where}.idle_ttl: must be a number of seconds")
    if length is not None and (not isinstance(length, int) or length < 1):
        raise SpecError(f"{where}.max_model_len: must be a positive integer")
    model = item.get("model")
    if model is not None and not isinstance(model, str):
        raise SpecError(f"{where}.model: must be a path or Hub id")
    return ModelSpec(
        model=model,
        names=[str(n) for n in names],
        aliases=[str(a) for a in item.get("aliases") or []],
        tool_call_parser=item.get("tool_call_parser"),
        reasoning_parser=item.get("reasoning_parser"),
        chat_template=template,
        sampling=dict(sampling),
        max_model_len=length,
        pinned=bool(item.get("pinned", False)),
        idle_ttl=None if ttl is None else float(ttl),
        default=bool(item.get("default", False)),
    )
