"""The page at `/` transcribes an uploaded clip: headless Chromium (Playwright, the
system's chromium) against a real `pippin serve --stt-model` with the real tiny.en."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from support.server_utils import Server, run_server
from support.whisper_models import speak, word_errors

CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        CHROMIUM is None, reason="no chromium on this machine (apt-get install chromium)"
    ),
]
SENTENCE = "Please send me the report before the meeting on Monday morning."


@pytest.fixture(scope="module")
def server(tiny_en: Path) -> Iterator[Server]:
    with run_server("--max-model-len", "512", "--stt-model", str(tiny_en)) as s:
        yield s


def test_upload_a_clip_and_read_its_transcript(server: Server, tmp_path: Path) -> None:
    wav = speak(SENTENCE, tmp_path / "clip.wav")
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        page = browser.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url + "/")
        page.wait_for_selector("#transcribe:not([hidden])", timeout=30_000)
        # Only chat models are offered for chat.
        options = page.eval_on_selector_all("#chat-model option", "os => os.map(o => o.value)")
        assert "whisper-1" not in options
        page.click("#stt-send")  # nothing chosen yet: says so
        assert "Choose" in page.inner_text("#stt-status")
        page.set_input_files("#stt-file", str(wav))
        page.click("#stt-send")
        page.wait_for_function(
            "document.querySelector('#stt-text').textContent.length > 0", timeout=300_000
        )
        text = page.inner_text("#stt-text")
        browser.close()
    errs, n = word_errors(SENTENCE, text)
    assert errs / n <= 0.15, text
    assert not errors, errors
