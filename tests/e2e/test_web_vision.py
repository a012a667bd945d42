"""The page's image attachments in headless Chromium against a real `pippin serve` of a
tiny VLM (and of a tiny text model, whose chat offers none)."""

from __future__ import annotations

import base64
import io
import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from support.server_utils import Server, run_server

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
pytest.importorskip("mlx_vlm")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on this machine (apt-get install chromium)"
)

from PIL import Image  # noqa: E402
from support.tiny_vlms import get_tiny_vlm  # noqa: E402


def png(seed: int) -> bytes:
    arr = (np.random.default_rng(seed).random((56, 56, 3)) * 255).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def browser() -> Iterator[object]:
    with sync_api.sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()


def open_page(browser: object, server: Server) -> tuple[object, list[str]]:
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(server.url + "/")
    return page, errors


def test_vision_model_takes_attached_and_pasted_images(
    browser: object, tmp_path_factory: pytest.TempPathFactory
) -> None:
    expect = sync_api.expect
    path = get_tiny_vlm("qwen2_5_vl", tmp_path_factory.mktemp("vlm"))
    with run_server(str(path), "--served-model-name", "tiny-vl") as server:
        page, errors = open_page(browser, server)
        expect(page.locator("#chat-attach")).to_be_visible(timeout=20_000)
        sent: list[dict] = []
        page.on(
            "request",
            lambda r: (
                sent.append(json.loads(r.post_data))
                if r.url.endswith("/v1/chat/completions")
                else None
            ),
        )
        page.fill("#chat-max", "4")
        page.fill("#chat-temp", "0")
        page.set_input_files(
            "#chat-file", files=[{"name": "a.png", "mimeType": "image/png", "buffer": png(1)}]
        )
        expect(page.locator("#chat-attached img.thumb")).to_have_count(1)
        # A pasted screenshot joins it.
        page.evaluate(
            """(b64) => {
            const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
            const dt = new DataTransfer();
            dt.items.add(new File([bytes], "shot.png", {type: "image/png"}));
            document.getElementById("chat-input").dispatchEvent(
                new ClipboardEvent("paste", {clipboardData: dt, bubbles: true, cancelable: true}));
        }""",
            base64.b64encode(png(2)).decode(),
        )
        expect(page.locator("#chat-attached img.thumb")).to_have_count(2)
        page.fill("#chat-input", "What is in these pictures?")
        page.click("#chat-send")
        answer = page.locator("#chat-log .msg.assistant.done")
        expect(answer).to_have_count(1, timeout=60_000)
        expect(answer.locator(".meta")).to_contain_text("tokens")
        expect(answer.locator(".meta")).not_to_have_class("meta error")
        expect(page.locator("#chat-log .msg.user img.thumb")).to_have_count(2)
        expect(page.locator("#chat-attached")).to_be_hidden()
        content = sent[0]["messages"][0]["content"]
        assert [p["type"] for p in content] == ["image_url", "image_url", "text"]
        urls = [p["image_url"]["url"] for p in content[:2]]
        assert urls == [
            "data:image/png;base64," + base64.b64encode(png(s)).decode() for s in (1, 2)
        ]
        assert content[2]["text"] == "What is in these pictures?"
        # The next turn sends the conversation, pictures included, and is answered too.
        page.fill("#chat-input", "And now?")
        page.click("#chat-send")
        expect(answer).to_have_count(2, timeout=60_000)
        assert sent[1]["messages"][0]["content"] == content
        assert not page.locator("#chat-log .meta.error").count()
        page.close()
        assert not errors, errors


def test_text_model_hides_the_attach_button(
    browser: object, tiny_models: Callable[..., Path]
) -> None:
    expect = sync_api.expect
    with run_server(str(tiny_models("llama")), "--served-model-name", "tiny") as server:
        page, errors = open_page(browser, server)
        expect(page.locator("#chat-model option")).to_have_count(1, timeout=20_000)
        expect(page.locator("#chat-attach")).to_be_hidden()
        # A pasted image is not taken (the text paste goes on as usual).
        page.evaluate(
            """() => {
            const dt = new DataTransfer();
            dt.items.add(new File([new Uint8Array([137, 80, 78, 71])], "x.png",
                                  {type: "image/png"}));
            document.getElementById("chat-input").dispatchEvent(
                new ClipboardEvent("paste", {clipboardData: dt, bubbles: true, cancelable: true}));
        }"""
        )
        expect(page.locator("#chat-attached")).to_be_hidden()
        page.close()
        assert not errors, errors
