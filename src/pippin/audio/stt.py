"""Speech to text with Whisper (mlx-audio's implementation), on one worker thread.

mlx-audio's `generate` does the long-form work: 30-second windows whose seek moves to the
last complete segment, timestamps carried across windows, the previous window's text as
the next one's prompt, temperature fallback on repetitive or unlikely output, and word
times from cross-attention (DTW). It takes one file at a time and keeps its state in
local variables, so the encoder cannot batch several clients' windows through it:
requests are served one after another on a single thread that owns all of the model's
MLX work (MLX streams are thread-affine), never on the event loop.

A streamed request is transcribed in pieces of at most 28 s cut at quiet moments
(`quiet_cuts`), each sent when done; a file of one piece streams the same text as it
would answer whole.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
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


# A stream is transcribed in pieces of at most this long, cut at the quietest tenth of a
# second of the last SEARCH_S before the limit, so each piece's text can be sent as soon as
# it is done (Whisper's own windows are 30 s; below that a piece is one window).
PIECE_S = 28.0
SEARCH_S = 8.0


def quiet_cuts(
    audio: np.ndarray, piece_s: float = PIECE_S, search_s: float = SEARCH_S
) -> list[int]:
    """Sample offsets [0, ..., len] cutting ``audio`` into pieces of at most ``piece_s``,
    each cut at the lowest-energy 0.1 s in the ``search_s`` before its limit."""
    hop, longest = SAMPLE_RATE // 10, int(piece_s * SAMPLE_RATE)
    cuts = [0]
    while audio.size - cuts[-1] > longest:
        hi = cuts[-1] + longest
        lo = hi - int(search_s * SAMPLE_RATE)
        frames = audio[lo : lo + (hi - lo) // hop * hop].reshape(-1, hop)
        cuts.append(lo + int(np.argmin((frames**2).mean(axis=1))) * hop + hop // 2)
    return [*cuts, audio.size]


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

    async def stream(self, audio: np.ndarray, opts: TranscribeOptions) -> AsyncIterator[str]:
        """The text of each piece (`quiet_cuts`) as soon as it is transcribed; a piece after
        the first is prompted with the text before it, as Whisper's windows are."""
        model = self.model
        assert model is not None
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, object]] = asyncio.Queue()
        stop = threading.Event()

        def run() -> None:
            try:
                prompt = opts.prompt
                cuts = quiet_cuts(audio)
                for start, end in zip(cuts, cuts[1:]):
                    if stop.is_set():
                        return
                    piece = replace(opts, prompt=prompt)
                    text = model.transcribe(audio[start:end], piece).text
                    prompt = text or prompt
                    loop.call_soon_threadsafe(queue.put_nowait, ("text", text))
                loop.call_soon_threadsafe(queue.put_nowait, ("end", None))
            except Exception as e:  # handed to the stream, which sends an error event
                loop.call_soon_threadsafe(queue.put_nowait, ("error", e))

        work = loop.run_in_executor(self._pool, run)
        try:
            while True:
                kind, item = await queue.get()
                if kind == "end":
                    return
                if kind == "error":
                    assert isinstance(item, Exception)
                    raise item
                if item:
                    yield str(item)
        finally:
            stop.set()  # a client that left: the pieces not yet begun are skipped
            work.cancel()

    async def stop(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
