"""The served model's limits and sampling defaults, which every API surface applies.

Precedence for every sampling knob: the request, then the server's ``--default-*``
overrides, then the model's own ``generation_config.json``, then `BUILTIN_DEFAULTS`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pippin.serving.errors import ApiError, bad_request

BUILTIN_DEFAULTS: dict[str, Any] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}
# Keys a model's generation_config or the server's overrides may set; a library model's
# parameters may also set stop strings and a seed (Ollama's PARAMETER stop / seed).
DEFAULTABLE = frozenset(BUILTIN_DEFAULTS) | {"max_tokens", "stop", "seed"}


@dataclass(frozen=True)
class Limits:
    max_model_len: int
    # Token ids must be below this (the model's logits width).
    vocab_size: int
    # --max-tokens: the most a request may ask for (None: up to the context).
    max_tokens_cap: int | None = None
    # --scheduling-policy priority: requests may set a priority (else a non-zero one is a 400).
    priorities: bool = False


def merge_defaults(model_defaults: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(BUILTIN_DEFAULTS)
    out.update({k: v for k, v in model_defaults.items() if k in DEFAULTABLE and v is not None})
    out.update({k: v for k, v in overrides.items() if k in DEFAULTABLE and v is not None})
    return out


def context_exceeded(limit: int, prompt_len: int, what: str) -> ApiError:
    return bad_request(
        f"This model's maximum context length is {limit} tokens. However, your {what} "
        f"resulted in {prompt_len} tokens. Please reduce the length of the {what}.",
        param=what,
        code="context_length_exceeded",
    )


def truncate_prompt(ids: list[int], keep: int | None, limits: Limits) -> list[int]:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: as many as
    the context holds); None leaves it whole. Asking for more than the context: 400."""
    if keep is None:
        return ids
    param = "truncate_prompt_tokens"
    if keep == 0 or keep < -1:
        raise bad_request(f"'{param}' must be -1 or at least 1.", param=param, code="invalid_value")
    if keep > limits.max_model_len:
        raise bad_request(
            f"'{param}' ({keep}) must not exceed the model's context length "
            f"({limits.max_model_len}).",
            param=param,
            code="invalid_value",
        )
    if keep == -1:
        keep = limits.max_model_len
    return ids[-keep:]
