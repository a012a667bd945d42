"""`pippin serve`'s text-to-speech and speech-to-text flags, the `SttSettings` they give,
and the check that a --tts-model can be served."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

from pippin.argtypes import positive_float
from pippin.audio.config import SttSettings


def add_tts_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "text to speech",
        "an optional model served on /v1/audio/speech (pip install 'pippin[audio]')",
    )
    g.add_argument(
        "--tts-model",
        metavar="PATH",
        help="text-to-speech model for /v1/audio/speech: a local folder mlx-audio loads "
        "(Kokoro, KittenTTS, ...: config.json, safetensors weights, and its voices)",
    )
    g.add_argument(
        "--tts-served-model-name",
        nargs="+",
        metavar="NAME",
        help="name(s) of the TTS model in the 'model' field; default: its folder name",
    )


def add_stt_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "speech to text",
        "a Whisper model on /v1/audio/transcriptions and /v1/audio/translations "
        "(needs the 'audio' extra: pip install 'pippin[audio]')",
    )
    g.add_argument(
        "--stt-model",
        metavar="PATH",
        help="Whisper model folder: MLX layout (config.json + safetensors, as mlx-community "
        "publishes) or CTranslate2 (model.bin, as faster-whisper uses; converted once into "
        "the cache folder)",
    )
    g.add_argument(
        "--stt-served-model-name",
        nargs="+",
        metavar="NAME",
        help="name(s) of the Whisper model in the 'model' field; default: its folder name "
        "and whisper-1",
    )
    g.add_argument(
        "--stt-max-mb",
        type=positive_float,
        metavar="MB",
        default=SttSettings.max_bytes / (1024 * 1024),
        help="largest audio upload in MiB (default: %(default)g, OpenAI's 25 MB)",
    )
    g.add_argument(
        "--stt-max-seconds",
        type=positive_float,
        metavar="S",
        default=SttSettings.max_seconds,
        help="longest audio accepted, in seconds (default: %(default)g)",
    )


def stt_settings(args: argparse.Namespace) -> SttSettings:
    from pippin.serving.settings import MIB

    return SttSettings(
        model=args.stt_model,
        names=list(args.stt_served_model_name or []),
        max_bytes=int(args.stt_max_mb * MIB),
        max_seconds=args.stt_max_seconds,
    )


def tts_problem(path: str) -> str | None:
    """Why --tts-model cannot be served, found before the server starts (None: it can)."""
    if importlib.util.find_spec("mlx_audio") is None or importlib.util.find_spec("av") is None:
        return "text to speech needs the audio extra: pip install 'pippin[audio]'"
    if not (Path(path) / "config.json").is_file():
        return f"{path} is not a model folder (no config.json)"
    return None
