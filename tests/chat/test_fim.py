"""Fill-in-the-middle prompts (`pippin.chat.fim`) on a real byte-level BPE tokenizer (the
tiny models' one), given each family's FIM tokens in turn."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from support.tiny_models import build_tokenizer
from transformers import PreTrainedTokenizerFast

from pippin.chat.fim import FORMATS, fim_format, fim_prompt

BEFORE = "def add(a, b):\n    "
AFTER = "\n\nprint(add(2, 3))\n"


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    dest = tmp_path_factory.mktemp("tok")
    build_tokenizer(dest)
    return dest


def tokenizer(folder: Path, *special: str) -> Any:
    tok = PreTrainedTokenizerFast.from_pretrained(str(folder))
    tok.add_special_tokens({"additional_special_tokens": list(special)})
    return tok


def test_no_fim_tokens(folder: Path) -> None:
    assert fim_format(tokenizer(folder)) is None


@pytest.mark.parametrize("fmt", FORMATS, ids=lambda f: f.prefix)
def test_each_family(folder: Path, fmt: Any) -> None:
    tok = tokenizer(folder, fmt.prefix, fmt.suffix, fmt.middle, *fmt.stops)
    assert fim_format(tok) == fmt
    p = fim_prompt(tok, fmt, BEFORE, AFTER)
    special = tok.convert_tokens_to_ids([fmt.prefix, fmt.suffix, fmt.middle])
    text = [tok.encode(t, add_special_tokens=False) for t in (BEFORE, AFTER)]
    assert p.ids == [special[0], *text[0], special[1], *text[1], special[2]]
    assert tok.decode(p.ids) == f"{fmt.prefix}{BEFORE}{fmt.suffix}{AFTER}{fmt.middle}"
    # The family's end tokens stop the middle (`<|endoftext|>` is the tokenizer's own).
    assert p.stop_token_ids == tok.convert_tokens_to_ids(list(fmt.stops))


def test_empty_hole_sides(folder: Path) -> None:
    fmt = FORMATS[0]
    tok = tokenizer(folder, fmt.prefix, fmt.suffix, fmt.middle)
    special = tok.convert_tokens_to_ids([fmt.prefix, fmt.suffix, fmt.middle])
    assert fim_prompt(tok, fmt, "", "").ids == special
