"""The library's models (`pippin.store.library`) as the registry serves them, and Ollama's
Modelfile parameters as pippin takes them.

A library model's settings (what /api/create and /api/copy stored: ``template``,
``system``, ``parameters``, ``messages``) become its `ModelSpec`: the template replaces the
tokenizer's chat template, the parameters become its sampling defaults (below a request's
own fields, above the server's ``--default-*``), ``num_ctx`` its context length, and the
system prompt and messages go before a request's messages (`LiveModel.with_preset`).
"""

from __future__ import annotations

from typing import Any

from pippin.serving.model_specs import ModelSpec
from pippin.store.library import StoredModel

# Ollama's parameter -> (its type, the SamplingParams default it sets).
HONOURED: dict[str, tuple[type, str]] = {
    "temperature": (float, "temperature"),
    "top_p": (float, "top_p"),
    "top_k": (int, "top_k"),
    "min_p": (float, "min_p"),
    "repeat_penalty": (float, "repetition_penalty"),
    "presence_penalty": (float, "presence_penalty"),
    "frequency_penalty": (float, "frequency_penalty"),
    "num_predict": (int, "max_tokens"),
    "seed": (int, "seed"),
    "stop": (list, "stop"),
    "num_ctx": (int, "max_model_len"),
}
# Set when llama.cpp loads a model: pippin's own flags decide these, so they are kept and
# have no effect (as the same options of a request).
LOAD_TIME: dict[str, type] = {
    "num_batch": int,
    "num_gpu": int,
    "main_gpu": int,
    "num_thread": int,
    "num_keep": int,
    "use_mmap": bool,
    "use_mlock": bool,
    "numa": bool,
    "low_vram": bool,
    "f16_kv": bool,
    "vocab_only": bool,
    "logits_all": bool,
    "embedding_only": bool,
}
# Ollama's other parameters, which pippin's sampler does not implement.
UNSUPPORTED = frozenset(
    {"typical_p", "repeat_last_n", "mirostat", "mirostat_tau", "mirostat_eta", "tfs_z"}
    | {"penalize_newline"}
)


class ParameterError(ValueError):
    """A parameter pippin does not take, or a bad value; the message names it."""


def _value(name: str, kind: type, value: Any) -> Any:
    """``value`` (JSON, or a Modelfile's text) as ``kind``."""
    if kind is list:
        values = value if isinstance(value, list) else [value]
        if not all(isinstance(v, str) for v in values):
            raise ParameterError(f"parameter '{name}' must be a string or a list of strings")
        return [v for v in values if v]
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false"):
            return value.lower() == "true"
        raise ParameterError(f"parameter '{name}' must be true or false")
    try:
        number = float(value) if isinstance(value, str | int | float) else None
    except ValueError:
        number = None
    if number is None or isinstance(value, bool) or (kind is int and not number.is_integer()):
        what = "an integer" if kind is int else "a number"
        raise ParameterError(f"parameter '{name}' must be {what}, not {value!r}")
    return int(number) if kind is int else number


def normalize_parameters(raw: dict[str, Any]) -> dict[str, Any]:
    """Ollama's ``parameters`` checked and typed (``stop`` always a list); a parameter
    pippin cannot honour is a `ParameterError` naming it."""
    out: dict[str, Any] = {}
    for name, value in raw.items():
        if name in HONOURED:
            out[name] = _value(name, HONOURED[name][0], value)
        elif name in LOAD_TIME:
            out[name] = _value(name, LOAD_TIME[name], value)
        elif name in UNSUPPORTED:
            raise ParameterError(f"parameter '{name}' is not supported by this server")
        else:
            raise ParameterError(f"unknown parameter '{name}'")
    if out.get("num_ctx", 1) < 1 or out.get("num_predict", 1) == 0:
        raise ParameterError("parameters 'num_ctx' and 'num_predict' must be positive")
    return out


def merge_parameters(base: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """A create's parameters over those of the model it is made from (stop strings
    added to the base's, as Ollama merges them)."""
    out = {**base, **new}
    if "stop" in base and "stop" in new:
        out["stop"] = list(dict.fromkeys([*base["stop"], *new["stop"]]))
    return out


def spec_from_stored(stored: StoredModel, idle_ttl: float | None = None) -> ModelSpec:
    """The `ModelSpec` a library model is served with, under its own name; on demand,
    unloaded after ``idle_ttl`` seconds idle (--idle-ttl; None: never)."""
    settings = stored.settings
    params = settings.get("parameters") or {}
    sampling: dict[str, Any] = {}
    for name, value in params.items():
        target = HONOURED.get(name, (None, None))[1]
        if target is not None and target != "max_model_len":
            sampling[target] = value
    if sampling.get("max_tokens", 0) < 0:
        del sampling["max_tokens"]  # Ollama's -1: no limit
    return ModelSpec(
        model=str(stored.path),
        names=[stored.name],
        chat_template=settings.get("template") or None,
        sampling=sampling,
        max_model_len=params.get("num_ctx"),
        system=settings.get("system") or None,
        messages=[dict(m) for m in settings.get("messages") or []],
        idle_ttl=idle_ttl,
    )
