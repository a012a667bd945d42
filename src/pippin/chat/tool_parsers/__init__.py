"""Tool-call parsers, one per format family, found by name or from the model.

Every module of this package is imported and its `ToolParser` subclasses with a
`name` are registered; `detect` picks the one whose `matches` says yes with the
highest `priority` (specific formats before the generic ones they contain).
"""

from __future__ import annotations

import importlib
import pkgutil

from pippin.chat.tool_parsers.base import ToolParser

_REGISTRY: dict[str, type[ToolParser]] = {}


def _subclasses(cls: type[ToolParser]) -> list[type[ToolParser]]:
    out = []
    for sub in cls.__subclasses__():
        out.append(sub)
        out.extend(_subclasses(sub))
    return out


def registry() -> dict[str, type[ToolParser]]:
    if not _REGISTRY:
        for mod in pkgutil.iter_modules(__path__):
            importlib.import_module(f"{__name__}.{mod.name}")
        for sub in _subclasses(ToolParser):
            for name in (sub.name, *sub.aliases):
                if name and sub.__dict__.get("name"):
                    _REGISTRY[name] = sub
    return _REGISTRY


def get_tool_parser(name: str) -> type[ToolParser]:
    parsers = registry()
    if name not in parsers:
        raise ValueError(
            f"Unknown tool-call parser {name!r}; choose one of {', '.join(sorted(parsers))}."
        )
    return parsers[name]


def detect_tool_parser(
    template_source: str, model_type: str, vocab: set[str] | dict[str, int]
) -> type[ToolParser] | None:
    """The format a model writes its tool calls in, from its chat template and config."""
    candidates = sorted(dict.fromkeys(registry().values()), key=lambda c: -c.priority)
    for cls in candidates:
        if cls.matches(template_source, model_type, vocab):
            return cls
    return None
