"""Tokens as the logprobs of the APIs show them: text, UTF-8 bytes, a finite logprob."""

from __future__ import annotations

from typing import Any

from pippin.engine.types import TokenLogprob

# JSON has no -inf; a token the model considers impossible is reported this low
# (vLLM does the same).
MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float:
    return value if value > MIN_LOGPROB else MIN_LOGPROB


class TokenRenderer:
    """Token id -> (text, UTF-8 bytes) as OpenAI's logprobs show single tokens.

    A token may be part of a multi-byte character, so its exact bytes come from the
    tokenizer's byte-level vocabulary, not from decoding it alone. Cached per id.
    """

    def __init__(self, tokenizer: Any) -> None:
        from mlx_lm.tokenizer_utils import (
            BPEStreamingDetokenizer,
            SPMStreamingDetokenizer,
            _byte_decoder,
        )

        self._tokenizer = tokenizer
        detok = getattr(tokenizer, "detokenizer", None)
        self._map: list[Any] | None = getattr(detok, "tokenmap", None)
        self._bpe = isinstance(detok, BPEStreamingDetokenizer)
        self._spm = isinstance(detok, SPMStreamingDetokenizer)
        self._byte_decoder: dict[str, int] = _byte_decoder() if self._bpe else {}
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _bytes(self, token_id: int) -> bytes:
        piece = self._map[token_id] if self._map and token_id < len(self._map) else None
        if piece is not None and self._bpe:
            out = bytearray()
            for ch in piece:
                b = self._byte_decoder.get(ch)
                out.extend(bytes([b]) if b is not None else ch.encode("utf-8"))
            return bytes(out)
        if piece is not None and self._spm:
            return piece.replace("\u2581".encode(), b" ")
        return self._tokenizer.decode([token_id]).encode("utf-8")

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is None:
            raw = self._bytes(token_id)
            hit = (raw.decode("utf-8", errors="replace"), list(raw))
            self._cache[token_id] = hit
        return hit


def token_logprobs(lps: list[TokenLogprob], render: TokenRenderer) -> list[dict[str, Any]]:
    """Chosen tokens with their alternatives, as OpenAI's chat and Ollama show them."""
    out = []
    for lp in lps:
        text, raw = render(lp.token_id)
        top = []
        for tid, val in lp.top:
            t, b = render(tid)
            top.append({"token": t, "logprob": clamp_logprob(val), "bytes": b})
        out.append(
            {"token": text, "logprob": clamp_logprob(lp.logprob), "bytes": raw, "top_logprobs": top}
        )
    return out


def prompt_logprobs_body(
    lps: list[TokenLogprob | None], render: TokenRenderer
) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's `prompt_logprobs`: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}}, the prompt's own token first, then the top alternatives."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for lp in lps:
        if lp is None:
            out.append(None)
            continue
        entry = {str(lp.token_id): _scored(lp.token_id, lp.logprob, lp.rank, render)}
        for rank, (tid, val) in enumerate(lp.top, 1):
            entry.setdefault(str(tid), _scored(tid, val, rank, render))
        out.append(entry)
    return out


def _scored(token_id: int, value: float, rank: int | None, render: TokenRenderer) -> dict[str, Any]:
    return {"logprob": clamp_logprob(value), "rank": rank, "decoded_token": render(token_id)[0]}
