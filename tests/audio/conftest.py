from __future__ import annotations

from pathlib import Path

import pytest
from support.whisper_models import ct2_tiny_en_dir


@pytest.fixture(scope="session")
def tiny_en(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real whisper tiny.en, converted from CTranslate2 to the MLX layout once."""
    pytest.importorskip("mlx_audio", reason="mlx-audio is in the 'audio' extra")
    from pippin.audio.ct2_convert import convert_ct2_whisper

    return convert_ct2_whisper(ct2_tiny_en_dir(), tmp_path_factory.mktemp("tiny_en_mlx"))
