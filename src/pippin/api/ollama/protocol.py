"""Ollama's request bodies, and its `options` and `keep_alive` as pippin takes them.

Ollama's server (Go) ignores fields it does not know; these models do the same, so
clients written for any Ollama version work. Every field Ollama defines is read here:
honoured, or refused with a 400 that names it (see docs/api-compatibility.md, "Ollama").
An option no Ollama version defines is refused by name (Ollama only logs it): a typo in
`options` would otherwise change nothing without a word.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from pippin.serving.errors import bad_request


class Lenient(BaseModel):
    # Ollama ignores unknown fields; types are still checked (its decoder does too).
    model_config = ConfigDict(extra="ignore")


class ToolCallFunction(Lenient):
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    index: int | None = None


class ToolCall(Lenient):
    function: ToolCallFunction
    id: str | None = None


class Message(Lenient):
    role: str
    content: str | None = None  # null, as Ollama's decoder reads it: ""
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class Function(Lenient):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(Lenient):
    type: Literal["function"] = "function"
    function: Function


Format = Literal["", "json"] | dict[str, Any] | None
KeepAlive = float | int | str | None
Think = bool | Literal["high", "medium", "low"] | None


class GenerateFields(Lenient):
    model: str = ""
    stream: bool = True  # Ollama streams unless told not to
    format: Format = None
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None
    think: Think = None
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)


class ChatRequest(GenerateFields):
    messages: list[Message] = Field(default_factory=list)
    tools: list[Tool] | None = None


class GenerateRequest(GenerateFields):
    prompt: str | None = None
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool | None = None
    images: list[str] | None = None


class EmbedRequest(Lenient):
    model: str = ""
    input: str | list[str] = ""
    truncate: bool = True  # Ollama cuts long inputs unless told not to
    dimensions: int | None = Field(None, ge=1)
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None


class EmbeddingsRequest(Lenient):
    """The legacy /api/embeddings: one prompt, one vector."""

    model: str = ""
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: KeepAlive = None


class ShowRequest(Lenient):
    model: str = ""
    name: str = ""  # the field's old name
    verbose: bool = False


# --- options -------------------------------------------------------------------

# Ollama's option -> the OpenAI-side sampling field it sets.
SAMPLING = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "seed": "seed",
    "repeat_penalty": "repetition_penalty",
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "stop": "stop",
}
# Set up when Ollama loads a model (llama.cpp's threads, GPU layers, mmap, batch size):
# pippin's own flags decide these, so they are accepted and have no effect, as Ollama
# leaves them when the model is already loaded with other values. (`num_ctx` is not
# here: it caps the request's context, `context_option`.)
LOAD_TIME = frozenset(
    {
        "numa",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "f16_kv",
        "logits_all",
        "vocab_only",
        "use_mmap",
        "use_mlock",
        "embedding_only",
        "num_thread",
        "num_keep",  # what a context shift keeps; pippin never shifts (it refuses)
        # Load-time options of older Ollama versions, which older clients still send.
        "num_gqa",
        "rope_frequency_base",
        "rope_frequency_scale",
    }
)
# Sampling options today's Ollama no longer implements (its engines ignore them).
IGNORED = frozenset({"tfs_z", "mirostat", "mirostat_tau", "mirostat_eta", "penalize_newline"})


def _number(options: dict[str, Any], key: str, kind: type) -> Any:
    value = options[key]
    ok = isinstance(value, int | float) and not isinstance(value, bool)
    if kind is int:
        ok = ok and float(value).is_integer()
    if not ok:
        raise bad_request(
            f'option "{key}" must be of type {"integer" if kind is int else "number"}',
            param=f"options.{key}",
        )
    return kind(value)


def sampling_options(options: dict[str, Any] | None) -> tuple[dict[str, Any], int | None]:
    """`options` as OpenAI-side sampling fields, and `num_predict` (None: no limit)."""
    out: dict[str, Any] = {}
    num_predict: int | None = None
    opts = options or {}
    for key, value in opts.items():
        if value is None or key in LOAD_TIME or key in IGNORED:
            continue
        if key == "stop":
            if not (isinstance(value, list) and all(isinstance(s, str) for s in value)):
                raise bad_request('option "stop" must be a list of strings', param="options.stop")
            out["stop"] = value
        elif key in ("top_k", "seed"):
            out[key] = _number(opts, key, int)
        elif key in SAMPLING:
            out[SAMPLING[key]] = _number(opts, key, float)
        elif key == "num_ctx":
            context_option(opts)
        elif key == "num_predict":
            n = _number(opts, key, int)
            if n < -2 or n == 0:
                raise bad_request(
                    'option "num_predict" must be -1 (no limit), -2 (fill the context) or >= 1',
                    param="options.num_predict",
                )
            num_predict = n if n >= 0 else None
        elif key == "typical_p":
            if _number(opts, key, float) != 1.0:
                raise bad_request(
                    'option "typical_p" is not supported by this server (only 1.0, off)',
                    param="options.typical_p",
                )
        elif key == "repeat_last_n":
            # pippin's repetition penalty reads the whole context: only -1 means that.
            n = _number(opts, key, int)
            if n == 0:
                out["repetition_penalty"] = 1.0  # Ollama: 0 turns the penalty off
            elif n != -1 and float(opts.get("repeat_penalty", 1.0) or 1.0) != 1.0:
                raise bad_request(
                    'option "repeat_last_n" must be -1 (the whole context) or 0 here: '
                    "this server applies repeat_penalty to every token of the context",
                    param="options.repeat_last_n",
                )
        else:
            raise bad_request(f'invalid option provided: "{key}"', param=f"options.{key}")
    if "temperature" in out and not 0 <= out["temperature"] <= 2:
        raise bad_request('option "temperature" must be in [0, 2]', param="options.temperature")
    if "top_p" in out and not 0 <= out["top_p"] <= 1:
        raise bad_request('option "top_p" must be in [0, 1]', param="options.top_p")
    if "repetition_penalty" in out and not 0 < out["repetition_penalty"] <= 10:
        raise bad_request(
            'option "repeat_penalty" must be in (0, 10]', param="options.repeat_penalty"
        )
    if "seed" in out and out["seed"] < 0:
        del out["seed"]  # Ollama's -1: a random seed
    return out, num_predict


def context_option(options: dict[str, Any] | None) -> int | None:
    """`num_ctx`: the context this request may fill (prompt and answer), None if not set."""
    if not options or options.get("num_ctx") is None:
        return None
    n = _number(options, "num_ctx", int)
    if n < 1:
        raise bad_request('option "num_ctx" must be >= 1', param="options.num_ctx")
    return n


# --- keep_alive ----------------------------------------------------------------

_UNITS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|ms|s|m|h)")


def keep_alive_seconds(value: KeepAlive) -> float | None:
    """Ollama's `keep_alive`: seconds as a number, or a Go duration ("5m", "1h30m");
    negative: keep loaded forever (None); None when absent too."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise bad_request("keep_alive must be a duration", param="keep_alive")
    if isinstance(value, int | float):
        return None if value < 0 else float(value)
    text = value.strip()
    sign = -1.0 if text.startswith("-") else 1.0
    body = text.lstrip("+-")
    if body == "0":
        return 0.0
    try:
        return None if sign < 0 else float(body)  # "300" is seconds too
    except ValueError:
        pass
    total, pos = 0.0, 0
    for m in _DURATION.finditer(body):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNITS[m.group(2)]
        pos = m.end()
    if pos != len(body) or not body:
        raise bad_request(f'time: invalid duration "{value}"', param="keep_alive")
    return None if sign < 0 else total
