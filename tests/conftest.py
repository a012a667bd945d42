"""Shared pytest fixtures.

``tests/`` has no ``__init__.py``, so helper modules here (``tiny_models``) are imported
by name; putting this folder on ``sys.path`` keeps that working under any import mode.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

_TESTS_DIR = str(Path(__file__).resolve().parent)
if _TESTS_DIR not in sys.path:
    sys.path.insert(0, _TESTS_DIR)

import tiny_models as _tiny  # noqa: E402  (needs the path above)

TinyModelFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> TinyModelFactory:
    """``tiny_models(arch, *, seed=0, **config_overrides) -> Path``, each built once.

    ``arch`` is one of ``tiny_models.ARCHS``: "llama", "qwen3", "gemma3", "qwen3_next".
    The folder loads with ``mlx_lm.utils.load`` and ``transformers``; don't write to it.
    """
    _tiny.set_cache_root(tmp_path_factory.mktemp("tiny_models"))

    def factory(arch: str, *, seed: int = 0, **overrides: Any) -> Path:
        return _tiny.get_tiny_model(arch, seed=seed, **overrides)

    return factory


@pytest.fixture(params=_tiny.ARCHS)
def tiny_arch(request: pytest.FixtureRequest) -> str:
    """Each tiny architecture in turn; a test taking it runs once per arch."""
    return request.param


@pytest.fixture
def tiny_model_dir(tiny_models: TinyModelFactory, tiny_arch: str) -> Path:
    """The default (seed 0) tiny model of each architecture in turn."""
    return tiny_models(tiny_arch)
