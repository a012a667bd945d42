"""The page's Speech card in headless Chromium against a real `pippin serve --tts-model`
(tiny random KittenTTS): it appears only with a TTS model, lists its voices, and plays
what /v1/audio/speech returns."""

from __future__ import annotations

import importlib.util
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from support.server_utils import Server, run_server
from support.tts_models import VOICES, build_kitten

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
pytestmark = [
    pytest.mark.skipif(
        CHROMIUM is None, reason="no chromium on this machine (apt-get install chromium)"
    ),
    pytest.mark.skipif(
        importlib.util.find_spec("mlx_audio") is None or importlib.util.find_spec("av") is None,
        reason="text to speech needs the audio extra (pip install '.[audio]')",
    ),
]


@pytest.fixture(scope="module")
def server(
    tiny_models: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    tts = build_kitten(tmp_path_factory.mktemp("kitten"), deterministic=True)
    with run_server(
        str(tiny_models("llama")),
        "--served-model-name",
        "tiny",
        "--tts-model",
        str(tts),
        "--tts-served-model-name",
        "kitten",
    ) as s:
        yield s


def test_speech_card_speaks(server: Server) -> None:
    expect = sync_api.expect
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu", "--mute-audio"]
        )
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url + "/")
        expect(page.locator("#speech")).to_be_visible(timeout=20_000)
        # Only the TTS model is offered, with its voices.
        expect(page.locator("#speech-model option")).to_have_text(["kitten"])
        expect(page.locator("#speech-voice option")).to_have_text(sorted(VOICES))
        page.select_option("#speech-voice", VOICES[1])
        page.fill("#speech-input", "Hello from the page. A second sentence.")
        page.click("#speech-send")
        expect(page.locator("#speech-meta")).to_contain_text("KiB mp3", timeout=60_000)
        duration = page.evaluate(
            """() => new Promise((resolve) => {
                const a = document.getElementById('speech-audio');
                if (a.readyState >= 1) resolve(a.duration);
                else a.onloadedmetadata = () => resolve(a.duration);
                a.onerror = () => resolve(-1);
            })"""
        )
        assert duration > 0.5, duration
        # A bad request shows the server's message, and the page keeps working.
        page.fill("#speech-speed", "9")
        page.click("#speech-send")
        expect(page.locator("#speech-meta.error")).to_contain_text("speed", timeout=20_000)
        browser.close()
    assert not errors, errors


def test_no_speech_card_without_a_tts_model(tiny_models: Callable[..., Path]) -> None:
    with run_server(str(tiny_models("llama")), "--served-model-name", "tiny") as s:
        with sync_api.sync_playwright() as pw:
            browser = pw.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
            page = browser.new_page()
            page.goto(s.url + "/")
            sync_api.expect(page.locator("#models li")).to_have_count(1, timeout=20_000)
            sync_api.expect(page.locator("#speech")).to_be_hidden()
            browser.close()
