"""Request fields + the model's defaults + server limits -> SamplingParams.

Precedence for every sampling knob: the request, then the server's ``--default-*``
overrides, then the model's own ``generation_config.json``, then the built-in values
below. ``max_tokens`` defaults to what is left of the context, capped by the model's
default and by ``--max-tokens``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pippin.engine.types import SamplingParams
from pippin.serving.admission import salted
from pippin.serving.errors import bad_request
from pippin.serving.limits import Limits, context_exceeded


@dataclass
class Sampling:
    """A request's sampling fields in no API's shape (None: the defaults decide).

    Each API fills in what it has: OpenAI's chat and completions all of it, Anthropic's
    Messages temperature, top_p, top_k and stop sequences, Ollama's `options`."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    min_tokens: int | None = None
    n: int | None = None
    skip_special_tokens: bool | None = None
    cache_salt: str | None = None
    priority: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    # vLLM's: prompt tokens' logprobs (with the top k), the only tokens that may be
    # sampled, and words never to be generated.
    prompt_logprobs: int | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None


def resolve_max_tokens(
    requested: int | None,
    prompt_len: int,
    limits: Limits,
    model_default: int | None,
    api_default: int | None,
    what: str,
    param: str = "max_tokens",
) -> int:
    """How many tokens to generate at most; 400 when the request cannot fit.

    A prompt that leaves no room is refused naming `what` (the prompt's field: messages,
    prompt, input); a requested length the rest of the context cannot hold is refused
    naming `param`, the field the request used (max_tokens, max_completion_tokens,
    max_output_tokens, options.num_predict), as OpenAI refuses it."""
    room = limits.max_model_len - prompt_len
    if room < 1:
        raise context_exceeded(limits.max_model_len, prompt_len, what)
    cap = limits.max_tokens_cap
    if requested is not None:
        if cap is not None and requested > cap:
            raise bad_request(
                f"{param} is too large: {requested}. This server allows at most {cap} "
                "completion tokens per request.",
                param=param,
                code="invalid_value",
            )
        if requested > room:
            # As OpenAI does: refuse rather than silently shorten the answer. The prompt
            # fits, so the field to change is the one that asked for too much.
            raise bad_request(
                f"This model's maximum context length is {limits.max_model_len} tokens. "
                f"However, you requested {prompt_len + requested} tokens ({prompt_len} in the "
                f"{what}, {requested} in the completion). Please reduce the length of the "
                f"{what} or '{param}' (at most {room} here).",
                param=param,
                code="context_length_exceeded",
            )
        return requested
    out = room
    for bound in (cap, model_default, api_default):
        if bound is not None and bound > 0:
            out = min(out, bound)
    return out


def _token_id(value: int, limits: Limits, param: str) -> int:
    if not 0 <= value < limits.vocab_size:
        raise bad_request(
            f"Invalid token id {value} in '{param}': ids must be in [0, {limits.vocab_size}).",
            param=param,
            code="invalid_value",
        )
    return value


def _logit_bias(raw: dict[str, float] | None, limits: Limits) -> dict[int, float]:
    out: dict[int, float] = {}
    for key, bias in (raw or {}).items():
        try:
            tok = int(key)
        except ValueError:
            raise bad_request(
                f"Invalid key '{key}' in 'logit_bias': keys must be token ids.",
                param="logit_bias",
                code="invalid_value",
            ) from None
        _token_id(tok, limits, "logit_bias")
        if not -100 <= bias <= 100:
            raise bad_request(
                f"Invalid value {bias} for token {key} in 'logit_bias': must be in [-100, 100].",
                param="logit_bias",
                code="invalid_value",
            )
        out[tok] = float(bias)
    return out


def _bad_words_ids(words: list[str], tokenizer: Any, limits: Limits) -> list[list[int]]:
    """vLLM's tokenization of bad words: each as written (its leading spaces dropped),
    and after a space where that makes another first token of as many tokens, so the
    word is banned at the start of the text and inside it."""
    out: list[list[int]] = []
    for word in words:
        if not word.strip():
            raise bad_request(
                "'bad_words' must not hold empty words.", param="bad_words", code="invalid_value"
            )
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        for ids in (plain, spaced):
            for t in ids:
                _token_id(t, limits, "bad_words")
        if plain:
            out.append(plain)
        if spaced and (not plain or (spaced[0] != plain[0] and len(spaced) == len(plain))):
            out.append(spaced)
    return out


def build_sampling_params(
    req: Sampling,
    *,
    max_tokens: int,
    limits: Limits,
    defaults: dict[str, Any],
    tokenizer: Any = None,
) -> SamplingParams:
    """`max_tokens` comes from resolve_max_tokens; `defaults` from merge_defaults;
    `tokenizer` tokenizes `bad_words` (the APIs that take them pass it)."""

    def pick(name: str) -> Any:
        value = getattr(req, name)
        return defaults[name] if value is None else value

    temperature = float(pick("temperature"))
    top_p = float(pick("top_p"))
    if top_p == 0.0:
        # The nucleus of mass 0 is the single most likely token: greedy.
        temperature, top_p = 0.0, 1.0
    top_k = int(pick("top_k"))
    stop = defaults.get("stop") if req.stop is None else req.stop
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if req.priority and not limits.priorities:
        # vLLM refuses it too: under first come, first served it would be ignored.
        raise bad_request(
            "'priority' needs a server started with --scheduling-policy priority.",
            param="priority",
            code="invalid_value",
        )
    if req.allowed_token_ids is not None and not req.allowed_token_ids:
        # As vLLM: nothing could be sampled.
        param = "allowed_token_ids"
        raise bad_request(f"'{param}' must not be empty.", param=param, code="invalid_value")
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens ({min_tokens}) must not exceed max_tokens ({max_tokens}).",
            param="min_tokens",
            code="invalid_value",
        )
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=max(top_k, 0),  # vLLM's -1 and our 0 both mean off
        min_p=float(pick("min_p")),
        repetition_penalty=float(pick("repetition_penalty")),
        presence_penalty=float(pick("presence_penalty")),
        frequency_penalty=float(pick("frequency_penalty")),
        logit_bias=_logit_bias(req.logit_bias, limits),
        seed=defaults.get("seed") if req.seed is None else req.seed,
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs if req.logprobs else 0,
        # An empty stop string would end every answer before it starts.
        stop=[s for s in stops if s],
        stop_token_ids=[_token_id(t, limits, "stop_token_ids") for t in req.stop_token_ids or []],
        ignore_eos=bool(req.ignore_eos),
        min_tokens=min_tokens,
        n=req.n or 1,
        skip_special_tokens=True if req.skip_special_tokens is None else req.skip_special_tokens,
        cache_salt=salted(req.cache_salt),
        priority=req.priority or 0,
        prompt_logprobs=req.prompt_logprobs,
        allowed_token_ids=frozenset(
            _token_id(t, limits, "allowed_token_ids") for t in req.allowed_token_ids or []
        ),
        bad_words_ids=_bad_words_ids(req.bad_words or [], tokenizer, limits),
    )
