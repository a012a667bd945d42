"""Audio in chat (`input_audio`) over real HTTP with the `openai` SDK against
`pippin serve` of a tiny random Gemma 4 with an audio tower."""

from __future__ import annotations

import base64
import hashlib
import io
import wave
from collections.abc import Iterator

import numpy as np
import openai
import pytest

pytest.importorskip("mlx_vlm")

from support.errors import assert_api_error  # noqa: E402
from support.server_utils import Server, run_server  # noqa: E402
from support.tiny_omni import clip, get_tiny_omni  # noqa: E402

from pippin.audio.decode import decode_audio  # noqa: E402
from pippin.store.loader import load_model  # noqa: E402
from pippin.vision import omni  # noqa: E402
from pippin.vision import prompt as vprompt  # noqa: E402


def wav(samples: np.ndarray, rate: int = 16000) -> bytes:
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes((np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes())
    return buf.getvalue()


def audio_part(data: bytes, fmt: str = "wav") -> dict:
    return {
        "type": "input_audio",
        "input_audio": {"data": base64.b64encode(data).decode(), "format": fmt},
    }


@pytest.fixture(scope="module")
def omni_path(tmp_path_factory: pytest.TempPathFactory):
    return get_tiny_omni(tmp_path_factory.mktemp("omni"))


@pytest.fixture(scope="module")
def omni_server(omni_path) -> Iterator[Server]:
    with run_server(
        str(omni_path), "--served-model-name", "tiny-omni", "--block-size", "4"
    ) as server:
        yield server


def ask(server: Server, content: list, model: str = "tiny-omni", max_tokens: int = 6):
    return server.client().chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
    )


def reference(omni_path, data: bytes, text: str, n: int) -> tuple[list[int], int, str]:
    """mlx-vlm's own greedy answer to the same upload (decoded as the server does), the
    end of the clip's span and the answer's text."""
    import mlx.core as mx
    from mlx_vlm.generate import generate_step

    loaded = load_model(str(omni_path))
    samples = decode_audio(data)
    msgs = [{"role": "user", "content": [{"type": "audio"}, {"type": "text", "text": text}]}]
    tok = loaded.vision.processor.tokenizer
    rendered = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    ids, mm = vprompt.build(loaded.vision, loaded.tokenizer, rendered, [])
    sha = hashlib.sha256(data).hexdigest()
    ids, mm = omni.expand_audio(loaded.vision, loaded.tokenizer, ids, mm, [(samples, sha)])
    assert mm is not None
    kw = {k: mx.array(v) for k, v in mm.images[0].arrays.items()}
    x = mx.array([ids])
    steps = generate_step(
        x, loaded.vision.vlm, None, mx.ones_like(x), max_tokens=n, temperature=0.0, **kw
    )
    out = [int(t) for t, _ in steps]
    return out, mm.images[0].end, loaded.tokenizer.decode(out)


def test_audio_answer_equals_mlx_vlm_and_second_turn_is_cached(
    omni_server: Server, omni_path
) -> None:
    data = wav(clip(1))
    text = "What is said? Tell me."
    ref, end, ref_text = reference(omni_path, data, text, 6)
    first = ask(omni_server, [audio_part(data), {"type": "text", "text": "What is said?"}])
    assert first.usage is not None and first.usage.prompt_tokens > 13
    again = ask(omni_server, [audio_part(data), {"type": "text", "text": text}])
    assert again.choices[0].message.content == ref_text, ref
    details = again.usage.prompt_tokens_details
    # Every full block through the clip is a prefix hit.
    assert details is not None and details.cached_tokens and details.cached_tokens >= end // 4 * 4
    other = ask(omni_server, [audio_part(wav(clip(6))), {"type": "text", "text": text}])
    details = other.usage.prompt_tokens_details
    # Another clip: nothing from its span on is shared.
    assert details is None or (details.cached_tokens or 0) < end - 13


def test_audio_and_text_requests_at_once(omni_server: Server) -> None:
    from concurrent.futures import ThreadPoolExecutor

    contents = [
        [audio_part(wav(clip(2))), {"type": "text", "text": "Transcribe."}],
        [{"type": "text", "text": "Just text, please."}],
        [audio_part(wav(clip(3, 1.2))), {"type": "text", "text": "Transcribe."}],
    ]
    alone = [ask(omni_server, c).choices[0].message.content for c in contents]
    with ThreadPoolExecutor(3) as pool:
        together = list(
            pool.map(lambda c: ask(omni_server, c).choices[0].message.content, contents)
        )
    assert together == alone


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"not audio at all" * 10, "audio"),
        (b"", "empty"),
        (wav(np.zeros(16000 * 31, dtype=np.float32)), "30"),
    ],
)
def test_bad_audio_is_a_400_naming_the_part(omni_server: Server, data: bytes, says: str) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        ask(omni_server, [{"type": "text", "text": "Hi"}, audio_part(data)])
    assert_api_error(e, 400, param="messages[0].content[1]", message=says)


def test_bad_base64_is_a_400_naming_the_part(omni_server: Server) -> None:
    part = {"type": "input_audio", "input_audio": {"data": "%%%not base64", "format": "wav"}}
    with pytest.raises(openai.BadRequestError) as e:
        ask(omni_server, [part])
    assert_api_error(e, 400, param="messages[0].content[0]", message="base64")


def test_images_are_refused_on_the_audio_model(omni_server: Server) -> None:
    png = base64.b64encode(b"\x89PNG\r\n\x1a\n").decode()
    part = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{png}"}}
    with pytest.raises(openai.BadRequestError) as e:
        ask(omni_server, [part])
    assert_api_error(e, 400, param="messages[0].content[0]", message="does not accept image")


def test_text_model_refuses_input_audio(text_server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        ask(text_server, [audio_part(wav(clip(1)))], model="tiny")
    assert_api_error(
        e,
        400,
        param="messages[0].content[0]",
        code="unsupported_value",
        message="does not accept audio input",
    )
