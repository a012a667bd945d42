"""Images over real HTTP with the official SDKs against `pippin serve` of a tiny VLM."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import numpy as np
import openai
import pytest

pytest.importorskip("mlx_vlm")

from PIL import Image  # noqa: E402
from server_utils import Server, run_server  # noqa: E402
from tiny_vlms import get_tiny_vlm  # noqa: E402


def png(seed: int, size: tuple[int, int] = (56, 56)) -> bytes:
    arr = (np.random.default_rng(seed).random((size[1], size[0], 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def data_url(seed: int, size: tuple[int, int] = (56, 56)) -> str:
    return "data:image/png;base64," + base64.b64encode(png(seed, size)).decode()


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    path = get_tiny_vlm("qwen2_5_vl", tmp_path_factory.mktemp("vlm"))
    with run_server(
        str(path),
        "--served-model-name",
        "tiny-vl",
        "--block-size",
        "4",
        "--limit-mm-per-prompt",
        '{"image": 3, "video": 1}',
    ) as server:
        yield server


@pytest.fixture(scope="module")
def text_server(tiny_models) -> Iterator[Server]:
    with run_server(str(tiny_models("llama")), "--served-model-name", "tiny") as server:
        yield server


def ask(server: Server, content: list, max_tokens: int = 6):
    return server.client().chat.completions.create(
        model="tiny-vl",
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
    )


def image_part(seed: int, detail: str | None = None) -> dict:
    url: dict = {"url": data_url(seed)}
    if detail:
        url["detail"] = detail
    return {"type": "image_url", "image_url": url}


def test_openai_image_second_turn_is_cached_and_other_image_is_not(vlm_server: Server) -> None:
    first = ask(vlm_server, [image_part(1), {"type": "text", "text": "What is this?"}])
    assert first.usage is not None
    # 4 image tokens (56x56 at 14-px patches, merged 2x2) among the prompt's.
    assert first.usage.prompt_tokens > 4
    again = ask(vlm_server, [image_part(1), {"type": "text", "text": "What is this? Tell me."}])
    details = again.usage.prompt_tokens_details
    assert details is not None and details.cached_tokens and details.cached_tokens >= 8
    assert again.choices[0].message.content is not None
    other = ask(vlm_server, [image_part(2), {"type": "text", "text": "What is this? Tell me."}])
    # Only the text before the image is shared (the first block: 4 tokens).
    assert (other.usage.prompt_tokens_details.cached_tokens or 0) < details.cached_tokens
    # The answer depends on the picture: same picture, same greedy answer.
    same = ask(vlm_server, [image_part(1), {"type": "text", "text": "What is this?"}])
    assert same.choices[0].message.content == first.choices[0].message.content


def test_text_request_batched_with_image_request(vlm_server: Server) -> None:
    alone = ask(vlm_server, [{"type": "text", "text": "Hello, how are you today?"}], max_tokens=16)
    img_alone = ask(
        vlm_server, [image_part(3), {"type": "text", "text": "Describe."}], max_tokens=16
    )
    with ThreadPoolExecutor(4) as pool:
        futs = [
            pool.submit(
                ask,
                vlm_server,
                [{"type": "text", "text": "Hello, how are you today?"}],
                max_tokens=16,
            ),
            pool.submit(
                ask,
                vlm_server,
                [image_part(3), {"type": "text", "text": "Describe."}],
                max_tokens=16,
            ),
        ]
        text, img = (f.result() for f in futs)
    assert text.choices[0].message.content == alone.choices[0].message.content
    assert img.choices[0].message.content == img_alone.choices[0].message.content


def test_openai_media_errors(vlm_server: Server, text_server: Server) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        text_server.client().chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": [image_part(1), {"type": "text", "text": "x"}]}],
            max_tokens=2,
        )
    assert "does not accept image" in str(e.value)
    assert e.value.body["param"] == "messages[0].content[0]"
    with pytest.raises(openai.BadRequestError) as e:
        ask(vlm_server, [image_part(i) for i in range(4)])
    assert "at most 3" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        ask(vlm_server, [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}])
    assert e.value.body["param"] == "messages[0].content[0]"
    with pytest.raises(openai.BadRequestError) as e:
        ask(vlm_server, [{"type": "image_url", "image_url": {"url": data_url(1), "detail": "max"}}])
    assert "detail" in str(e.value)
