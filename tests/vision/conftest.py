"""Fixtures the vision tests share."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from support.server_utils import Server, run_server


@pytest.fixture(scope="module")
def text_server(tiny_models) -> Iterator[Server]:
    """`pippin serve` of a tiny text-only model, served as "tiny"."""
    with run_server(str(tiny_models("llama")), "--served-model-name", "tiny") as server:
        yield server
