"""Ollama's Modelfile (the legacy ``modelfile`` field of /api/create, and what /api/show
writes back): FROM, TEMPLATE, SYSTEM, PARAMETER, MESSAGE, LICENSE and ADAPTER.

An argument is the rest of its line, a "quoted string" (JSON escapes) or a
\"\"\"block\"\"\" over several lines; ``#`` starts a comment line. As Ollama parses it:
instructions in any case, PARAMETER and MESSAGE take a word and then an argument, a
repeated PARAMETER stop adds a stop string.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

from pippin.serving.errors import bad_request

INSTRUCTIONS = ("from", "template", "system", "parameter", "message", "license", "adapter")
_INSTRUCTION = re.compile(r"[ \t]*([A-Za-z_]+)[ \t]*")
_WORD = re.compile(r"(\S+)[ \t]*")
_QUOTED = re.compile(r'"(?:[^"\\\n]|\\.)*"')
_SKIP = re.compile(r"(?:[ \t]*(?:#[^\n]*)?\n)*[ \t]*(?:#[^\n]*)?")


@dataclass
class Modelfile:
    from_: str | None = None
    template: str | None = None
    system: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    messages: list[dict[str, str]] = field(default_factory=list)
    license: list[str] = field(default_factory=list)
    adapters: list[str] = field(default_factory=list)


def _error(message: str) -> Exception:
    return bad_request(f"modelfile: {message}", param="modelfile")


def _argument(text: str, i: int, line: int) -> tuple[str, int]:
    """The argument at ``i`` and where it ends."""
    if text.startswith('"""', i):
        end = text.find('"""', i + 3)
        if end < 0:
            raise _error(f'line {line}: a """ block is not closed')
        return text[i + 3 : end], end + 3
    if text.startswith('"', i):
        m = _QUOTED.match(text, i)
        if m is None:
            raise _error(f"line {line}: a quoted string is not closed")
        try:
            return str(json.loads(m.group())), m.end()
        except ValueError:
            return m.group()[1:-1], m.end()
    end = text.find("\n", i)
    end = len(text) if end < 0 else end
    return text[i:end].strip(), end


def parse_modelfile(text: str) -> Modelfile:
    """The instructions of a Modelfile; a 400 naming an unknown instruction or a
    malformed line."""
    out = Modelfile()
    i = 0
    while True:
        i = _SKIP.match(text, i).end()  # type: ignore[union-attr]
        if i >= len(text):
            return out
        line = text.count("\n", 0, i) + 1
        m = _INSTRUCTION.match(text, i)
        if m is None:
            raise _error(f"line {line}: expected an instruction")
        name, i = m.group(1).lower(), m.end()
        if name not in INSTRUCTIONS:
            raise _error(
                f"unknown instruction {m.group(1).upper()!r} on line {line}; known: "
                + ", ".join(n.upper() for n in INSTRUCTIONS)
            )
        word = ""
        if name in ("parameter", "message"):
            w = _WORD.match(text, i)
            if w is None or text.startswith('"', i):
                raise _error(f"line {line}: {name.upper()} needs a name and a value")
            word, i = w.group(1), w.end()
        value, i = _argument(text, i, line)
        if not value and name in ("from", "parameter", "adapter"):
            raise _error(f"line {line}: {name.upper()} needs a value")
        rest = text.find("\n", i)
        tail = text[i : len(text) if rest < 0 else rest]
        if tail.strip():
            raise _error(f"line {line}: unexpected text after the argument: {tail.strip()!r}")
        _apply(out, name, word, value, line)


def _apply(out: Modelfile, name: str, word: str, value: str, line: int) -> None:
    if name == "from":
        out.from_ = value
    elif name == "template":
        out.template = value
    elif name == "system":
        out.system = value
    elif name == "license":
        out.license.append(value)
    elif name == "adapter":
        out.adapters.append(value)
    elif name == "message":
        if word not in ("system", "user", "assistant"):
            raise _error(f"line {line}: MESSAGE role must be system, user or assistant")
        out.messages.append({"role": word, "content": value})
    elif word == "stop":
        out.parameters.setdefault("stop", []).append(value)
    else:
        out.parameters[word] = value


def _quote(text: str) -> str:
    return f'"""{text}"""' if "\n" in text or '"' in text else text


def write_modelfile(source: str, settings: dict[str, Any], *, license_text: bool = True) -> str:
    """The Modelfile /api/show gives a library model: FROM its files, then its settings."""
    lines = [f"FROM {source}"]
    if settings.get("template"):
        lines.append(f"TEMPLATE {_quote(settings['template'])}")
    if settings.get("system"):
        lines.append(f"SYSTEM {_quote(settings['system'])}")
    for key, value in (settings.get("parameters") or {}).items():
        for v in value if isinstance(value, list) else [value]:
            text = json.dumps(v) if isinstance(v, str) else str(v).lower()
            lines.append(f"PARAMETER {key} {text}")
    for m in settings.get("messages") or []:
        lines.append(f"MESSAGE {m['role']} {_quote(str(m.get('content') or ''))}")
    if license_text:
        lines.extend(f"LICENSE {_quote(t)}" for t in settings.get("license") or [])
    return "\n".join(lines) + "\n"
