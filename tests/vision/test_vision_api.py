"""Images over real HTTP with the official SDKs against `pippin serve` of a tiny VLM."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import numpy as np
import openai
import pytest

pytest.importorskip("mlx_vlm")

from media_helpers import noise_png as png  # noqa: E402
from support.server_utils import Server, run_server  # noqa: E402
from support.tiny_vlms import get_tiny_vlm  # noqa: E402


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


def anthropic_client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0)


def b64_block(seed: int) -> dict:
    data = base64.b64encode(png(seed)).decode()
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": data}}


def test_anthropic_images_in_user_turns_and_tool_results(vlm_server: Server) -> None:
    client = anthropic_client(vlm_server)
    question = [b64_block(7), {"type": "text", "text": "What is in the picture?"}]
    first = client.messages.create(
        model="tiny-vl",
        max_tokens=6,
        messages=[{"role": "user", "content": question}],
    )
    count = client.messages.count_tokens(
        model="tiny-vl", messages=[{"role": "user", "content": question}]
    )
    text_only = client.messages.count_tokens(
        model="tiny-vl",
        messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is in the picture?"}]}
        ],
    )
    # The image's 4 tokens and its start/end markers.
    assert count.input_tokens == text_only.input_tokens + 6
    assert (
        first.usage.input_tokens + (first.usage.cache_read_input_tokens or 0) == count.input_tokens
    )
    # A second turn about the same image reads it from the cache.
    second = client.messages.create(
        model="tiny-vl",
        max_tokens=6,
        messages=[
            {"role": "user", "content": question},
            {"role": "assistant", "content": "It is noise."},
            {"role": "user", "content": "And its colours?"},
        ],
    )
    assert (second.usage.cache_read_input_tokens or 0) >= 8
    # A URL source (a data: URL here) and an image in a tool result.
    url_block = {"type": "image", "source": {"type": "url", "url": data_url(8)}}
    tool_turn = client.messages.create(
        model="tiny-vl",
        max_tokens=4,
        messages=[
            {
                "role": "user",
                "content": [url_block, {"type": "text", "text": "Take a screenshot."}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_1", "name": "screenshot", "input": {}}
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [b64_block(9)]}
                ],
            },
        ],
        tools=[
            {
                "name": "screenshot",
                "description": "A screenshot",
                "input_schema": {"type": "object"},
            }
        ],
    )
    assert tool_turn.usage.input_tokens > 8
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model="tiny-vl",
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/png", "data": "!!"},
                        }
                    ],
                }
            ],
        )
    assert e.value.body["type"] == "error"
    assert "messages[0].content[0]" in e.value.body["error"]["message"]


def test_anthropic_text_model_refuses_images(text_server: Server) -> None:
    client = anthropic.Anthropic(base_url=text_server.url, api_key="unused", max_retries=0)
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(
            model="tiny",
            max_tokens=4,
            messages=[{"role": "user", "content": [b64_block(1), {"type": "text", "text": "x"}]}],
        )
    assert e.value.body["type"] == "error"
    assert e.value.body["error"]["type"] == "invalid_request_error"
    assert "does not accept image" in e.value.body["error"]["message"]


def test_responses_input_image(vlm_server: Server) -> None:
    client = vlm_server.client()
    content = [
        {"type": "input_image", "image_url": data_url(11), "detail": "auto"},
        {"type": "input_text", "text": "What is this?"},
    ]
    first = client.responses.create(
        model="tiny-vl",
        input=[{"role": "user", "content": content}],
        max_output_tokens=6,
        temperature=0,
    )
    again = client.responses.create(
        model="tiny-vl",
        input=[{"role": "user", "content": content}],
        max_output_tokens=6,
        temperature=0,
    )
    assert first.output_text == again.output_text
    assert again.usage.input_tokens_details.cached_tokens >= 8


def test_video_frames_as_images(vlm_server: Server, tmp_path: Path) -> None:
    cv2 = pytest.importorskip("cv2")
    path = tmp_path / "clip.mp4"
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 4, (56, 56))
    rng = np.random.default_rng(0)
    for _ in range(8):  # 2 seconds at 4 fps
        writer.write((rng.random((56, 56, 3)) * 255).astype(np.uint8))
    writer.release()
    video = "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()
    r = ask(
        vlm_server,
        [
            {"type": "video_url", "video_url": {"url": video}},
            {"type": "text", "text": "What happens?"},
        ],
    )
    text = ask(vlm_server, [{"type": "text", "text": "What happens?"}])
    # Frames at 2 fps over 2 s: 4 frames of 4 tokens each plus their markers.
    assert r.usage.prompt_tokens - text.usage.prompt_tokens == 4 * 6
