"""Text-to-speech models, run through mlx-audio's own model classes and ``generate``.

`TTSModel` wraps whatever ``mlx_audio.tts.utils.load_model`` loads (Kokoro, KittenTTS and
the other architectures mlx-audio runs) and says what the model takes: its voices, whether
it follows ``instructions`` (its ``generate`` has an ``instruct`` argument) and whether it
changes ``speed``. `TTSWorker` owns the one thread that runs all of its MLX work (MLX streams
are thread-affine); a request's sentences go to it one at a time, so two requests take turns
sentence by sentence instead of one waiting for the whole of the other.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

log = logging.getLogger("pippin.audio")

T = TypeVar("T")


class TTSLoadError(Exception):
    """The folder is not a text-to-speech model mlx-audio can load."""


@dataclass(frozen=True)
class Speech:
    """One piece of input as audio: mono float32 samples and the text tokens it took."""

    samples: np.ndarray
    tokens: int


def find_espeak() -> None:
    """Point phonemizer (KittenTTS's G2P, and misaki's espeak one) at the espeak-ng library
    that ``espeakng-loader`` ships when the system has none, so the audio extra alone
    suffices; a system espeak-ng is left in use."""
    import ctypes.util

    try:
        import espeakng_loader
        from phonemizer.backend.espeak.wrapper import EspeakWrapper
    except ImportError:
        return
    if ctypes.util.find_library("espeak-ng") or ctypes.util.find_library("espeak"):
        return
    EspeakWrapper.set_library(espeakng_loader.get_library_path())
    EspeakWrapper.set_data_path(espeakng_loader.get_data_path())


class TTSModel:
    """One loaded mlx-audio TTS model. Call its methods on the worker's thread only."""

    def __init__(self, path: str | Path, name: str | None = None) -> None:
        from mlx_audio.tts.utils import load_model

        find_espeak()
        self.path = Path(path)
        if not (self.path / "config.json").is_file():
            raise TTSLoadError(f"{self.path} has no config.json")
        try:
            self.model = load_model(self.path, strict=True)
        except Exception as e:  # noqa: BLE001 - mlx-audio raises many kinds for a bad folder
            raise TTSLoadError(f"mlx-audio cannot load {self.path}: {e}") from e
        self.name = name or self.path.name
        self.model_type = str(getattr(self.model.config, "model_type", "") or "")
        self.sample_rate = int(self.model.sample_rate)
        params = inspect.signature(self.model.generate).parameters
        self.takes_instructions = "instruct" in params
        self.takes_speed = "speed" in params
        self.voices = self._voices()

    def _voices(self) -> list[str] | None:
        """The voices the model has, or None where it does not list them."""
        voices_dir = self.path / "voices"
        if self._is_kokoro() and voices_dir.is_dir():
            return sorted(p.stem for p in voices_dir.glob("*.safetensors"))
        table = getattr(self.model, "voices", None)
        if isinstance(table, dict) and table:
            aliases = getattr(self.model, "voice_aliases", None) or {}
            return sorted({*table, *aliases})
        return None

    def _is_kokoro(self) -> bool:
        return type(self.model).__module__.startswith("mlx_audio.tts.models.kokoro")

    def generate_kwargs(self, voice: str, speed: float, instructions: str | None) -> dict[str, Any]:
        """The arguments of ``model.generate`` besides the text."""
        kwargs: dict[str, Any] = {"voice": voice}
        if self.takes_speed:
            kwargs["speed"] = speed
        if instructions is not None:
            kwargs["instruct"] = instructions
        if self._is_kokoro():
            # Kokoro's voices are named by language first (af_heart: American English,
            # ef_dora: Spanish, ...); its pipeline's G2P is chosen by that letter.
            kwargs["lang_code"] = voice[0]
        return kwargs

    def synthesize(self, text: str, voice: str, speed: float, instructions: str | None) -> Speech:
        """``text`` (one piece, see `pippin.audio.sentences`) as audio: the segments
        mlx-audio's ``generate`` yields for it, joined."""
        kwargs = self.generate_kwargs(voice, speed, instructions)
        chunks: list[np.ndarray] = []
        tokens = 0
        for result in self.model.generate(text, **kwargs):
            chunks.append(np.asarray(result.audio, dtype=np.float32).reshape(-1))
            tokens += int(getattr(result, "token_count", 0) or 0)
        samples = np.concatenate(chunks) if chunks else np.zeros(0, np.float32)
        return Speech(samples, tokens)


class TTSWorker:
    """The thread that loads and runs the TTS model."""

    def __init__(self, path: str, name: str | None = None) -> None:
        self.path = path
        self.name = name
        self.model: TTSModel | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pippin-tts")

    @property
    def ready(self) -> bool:
        return self.model is not None

    async def start(self) -> None:
        self.model = await self.run(TTSModel, self.path, self.name)
        log.info(
            "TTS model '%s' ready (%s, %d Hz)",
            self.model.name,
            self.model.model_type,
            self.model.sample_rate,
        )

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
