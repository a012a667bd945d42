"""Speech to text with Whisper (mlx-audio's implementation), on one worker thread.

mlx-audio's `generate` does the long-form work: 30-second windows whose seek moves to the
last complete segment, timestamps carried across windows, the previous window's text as
the next one's prompt, temperature fallback on repetitive or unlikely output, and word
times from cross-attention (DTW). It takes one file at a time and keeps its state in
local variables, so the encoder cannot batch several clients' windows through it:
requests are served one after another on a single thread that owns all of the model's
MLX work (MLX streams are thread-affine), never on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from pippin.audio.decode import SAMPLE_RATE

log = logging.getLogger("pippin.audio")

# Whisper's fallback ladder (OpenAI: temperature 0 raises it "until certain thresholds").
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)


@dataclass(frozen=True)
class TranscribeOptions:
    task: str = "transcribe"  # or "translate" (to English)
    language: str | None = None  # ISO-639-1; None: detected (multilingual models)
    prompt: str | None = None
    temperature: float = 0.0
    word_timestamps: bool = False


@dataclass
class Transcript:
    text: str
    language: str
    duration: float
    segments: list[dict[str, Any]] = field(default_factory=list)

    def words(self) -> list[dict[str, Any]]:
        return [
            {"word": w["word"].strip(), "start": float(w["start"]), "end": float(w["end"])}
            for s in self.segments
            for w in s.get("words", [])
        ]


class SttModel:
    """A loaded Whisper and what requests may ask of it."""

    def __init__(self, model: Any, name: str) -> None:
        self.model = model
        self.name = name

    @property
    def multilingual(self) -> bool:
        return bool(self.model.is_multilingual)

    def languages(self) -> dict[str, str]:
        from mlx_audio.stt.models.whisper.tokenizer import LANGUAGES

        if not self.multilingual:
            return {"en": LANGUAGES["en"]}
        return dict(list(LANGUAGES.items())[: self.model.num_languages])

    def transcribe(self, audio: np.ndarray, opts: TranscribeOptions) -> Transcript:
        import mlx.core as mx

        temperature: float | tuple[float, ...] = (
            FALLBACK_TEMPERATURES if opts.temperature == 0 else opts.temperature
        )
        # An English-only model has no task or language tokens: it transcribes English.
        task = opts.task if self.multilingual else "transcribe"
        language = opts.language if self.multilingual else "en"
        out = self.model.generate(
            audio,
            task=task,
            language=language,
            initial_prompt=opts.prompt or None,
            temperature=temperature,
            word_timestamps=opts.word_timestamps,
            fp16=self.model.dtype == mx.float16,
            verbose=None,
        )
        segments = [s for s in out.segments if s.get("text", "").strip()]
        return Transcript(
            text="".join(s["text"] for s in segments).strip(),
            language=self.languages().get(out.language or "en", out.language or "en"),
            duration=audio.size / SAMPLE_RATE,
            segments=segments,
        )


class SttWorker:
    """Owns the Whisper model on one thread; `transcribe` queues a request to it."""

    def __init__(self, path: Path, name: str, cache: Path) -> None:
        self.path = path
        self.name = name
        self.cache = cache
        self.model: SttModel | None = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pippin-stt")

    @property
    def ready(self) -> bool:
        return self.model is not None

    def _load(self) -> SttModel:
        from pippin.audio.whisper_model import load_whisper

        return SttModel(load_whisper(self.path, self.cache), self.name)

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.model = await loop.run_in_executor(self._pool, self._load)
        log.info("speech-to-text model '%s' ready", self.name)

    async def transcribe(self, audio: np.ndarray, opts: TranscribeOptions) -> Transcript:
        model = self.model
        assert model is not None
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, model.transcribe, audio, opts)

    async def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
