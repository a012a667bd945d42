"""Text -> token ids for embedding and reranking models, with the length policy.

The Rust tokenizer is used directly (no truncation or padding configured in it, so it is
never mutated and safe to share between worker threads); truncation, when the server
allows it, is done here, so a too-long input is either refused or cut on purpose, never
cut silently by a setting hidden in ``tokenizer.json``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class Item:
    """One sequence for the model: token ids and, for BERT pairs, token type ids."""

    ids: list[int]
    type_ids: list[int] | None = None


class InputTooLong(Exception):
    def __init__(self, index: int, length: int, limit: int) -> None:
        super().__init__(f"input {index} has {length} tokens; the limit is {limit}")
        self.index, self.length, self.limit = index, length, limit


class TextEncoder:
    def __init__(self, tokenizer: Any, max_len: int, truncate: bool) -> None:
        tokenizer.no_truncation()
        tokenizer.no_padding()
        self.tok = tokenizer
        self.max_len = max_len
        self.truncate = truncate
        proc = tokenizer.post_processor
        self._extra_single = proc.num_special_tokens_to_add(False) if proc else 0
        self._extra_pair = proc.num_special_tokens_to_add(True) if proc else 0

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        """Plain ids, no special tokens."""
        return self.tok.encode(text, add_special_tokens=False).ids

    def texts(self, texts: list[str], prefix: str = "", truncate: bool | None = None) -> list[Item]:
        """Each text with the model's special tokens; too long: cut (`truncate`, by
        default the encoder's policy) or InputTooLong."""
        cut = self.truncate if truncate is None else truncate
        encs = self.tok.encode_batch([prefix + t for t in texts], add_special_tokens=False)
        budget = self.max_len - self._extra_single
        out = []
        for i, enc in enumerate(encs):
            if len(enc.ids) > budget:
                if not cut:
                    raise InputTooLong(i, len(enc.ids) + self._extra_single, self.max_len)
                enc.truncate(budget)
            enc = self.tok.post_process(enc, None, add_special_tokens=True)
            out.append(Item(enc.ids))
        return out

    def ids(self, seqs: list[list[int]], truncate: bool | None = None) -> list[Item]:
        """Token ids as the client sent them (no special tokens added)."""
        cut = self.truncate if truncate is None else truncate
        out = []
        for i, ids in enumerate(seqs):
            if len(ids) > self.max_len:
                if not cut:
                    raise InputTooLong(i, len(ids), self.max_len)
                ids = ids[: self.max_len]
            out.append(Item(list(ids)))
        return out

    def pairs(self, query: str, docs: list[str], max_doc_tokens: int | None) -> list[Item]:
        """(query, document) pairs as a cross-encoder reads them, with its special tokens
        and token types. Too long: both sides cut as ``longest_first`` does, or refused."""
        q = self.tok.encode(query, add_special_tokens=False)
        encs = self.tok.encode_batch(docs, add_special_tokens=False)
        budget = self.max_len - self._extra_pair
        out = []
        for i, d in enumerate(encs):
            if max_doc_tokens is not None and len(d.ids) > max_doc_tokens:
                d.truncate(max_doc_tokens)
            nq, nd = len(q.ids), len(d.ids)
            qq = q
            if nq + nd > budget:
                if not self.truncate:
                    raise InputTooLong(i, nq + nd + self._extra_pair, self.max_len)
                nq, nd = longest_first(nq, nd, budget)
                qq = self.tok.encode(query, add_special_tokens=False)
                qq.truncate(nq)
                d.truncate(nd)
            enc = self.tok.post_process(qq, d, add_special_tokens=True)
            out.append(Item(enc.ids, enc.type_ids))
        return out

    def cut(self, text: str, max_tokens: int | None) -> str:
        """``text`` up to the end of its ``max_tokens``-th token."""
        if max_tokens is None:
            return text
        enc = self.tok.encode(text, add_special_tokens=False)
        if len(enc.ids) <= max_tokens:
            return text
        return text[: enc.offsets[max_tokens - 1][1]]

    def framed(self, prefix: list[int], middles: list[str], suffix: list[int]) -> list[Item]:
        """``prefix + middle + suffix`` for prompt-style models (decoder rerankers); a
        too-long middle loses its end, as the reference code truncates it."""
        encs = self.tok.encode_batch(middles, add_special_tokens=False)
        budget = self.max_len - len(prefix) - len(suffix)
        out = []
        for i, enc in enumerate(encs):
            ids = enc.ids
            if len(ids) > budget:
                if not self.truncate:
                    raise InputTooLong(i, len(ids) + len(prefix) + len(suffix), self.max_len)
                ids = ids[:budget]
            out.append(Item(prefix + ids + suffix))
        return out


def longest_first(n1: int, n2: int, budget: int) -> tuple[int, int]:
    """The lengths Hugging Face tokenizers' ``longest_first`` strategy keeps of a pair."""
    swap = n1 > n2
    if swap:
        n1, n2 = n2, n1
    n2 = n1 if n1 > budget else max(n1, budget - n1)
    if n1 + n2 > budget:
        n1 = budget // 2
        n2 = n1 + budget % 2
    return (n2, n1) if swap else (n1, n2)
