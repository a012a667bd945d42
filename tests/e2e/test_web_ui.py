"""The page at `/` in headless Chromium against a real `pippin serve` (tiny model).

Driven with Playwright on the system's chromium (Debian's `chromium` package; no browser
download). It checks that the page is behind the API key, shows live metrics that change
under load, lists the model, and streams a chat answer.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from support.server_utils import Server, run_server

KEY = "sk-web-test"
CHROMIUM = next(
    (p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None
)
sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no chromium on this machine (apt-get install chromium)"
)


@pytest.fixture(scope="module")
def server(tiny_models: Callable[..., Path]) -> Iterator[Server]:
    with run_server(str(tiny_models("llama")), "--served-model-name", "tiny", api_key=KEY) as s:
        yield s


@pytest.fixture(scope="module")
def page(server: Server) -> Iterator[object]:
    with sync_api.sync_playwright() as pw:
        browser = pw.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", "--disable-gpu"]
        )
        # The browser's login for the page (HTTP Basic: the key as the password).
        context = browser.new_context(http_credentials={"username": "me", "password": KEY})
        page = context.new_page()
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url + "/")
        yield page
        browser.close()
        assert not errors, errors


def _load(server: Server, n: int) -> None:
    client = server.client()
    for i in range(n):
        client.completions.create(
            model="tiny", prompt=f"load {i}", max_tokens=24, extra_body={"ignore_eos": True}
        )


def test_page_is_behind_the_key(server: Server) -> None:
    for path in ("/", "/ui/app.js"):
        r = httpx.get(server.url + path)
        assert r.status_code == 401 and r.headers["www-authenticate"].startswith("Basic")
        assert "error" in r.json()
        wrong = httpx.get(server.url + path, auth=("me", "sk-wrong"))
        assert wrong.status_code == 401
        assert httpx.get(server.url + path, auth=("me", KEY)).status_code == 200
    # The API takes the same login; clients probe HEAD / without one.
    assert httpx.get(server.url + "/v1/models", auth=("me", KEY)).status_code == 200
    assert httpx.get(server.url + "/v1/models").headers["www-authenticate"] == "Bearer"
    assert httpx.head(server.url + "/").status_code == 200


def test_page_logs_in_then_shows_models(page: object, server: Server) -> None:
    """The page's own API calls carry the browser's login: no key form."""
    expect = sync_api.expect
    expect(page.locator("#models li")).to_contain_text("tiny", timeout=20_000)
    expect(page.locator("#key-form")).to_be_hidden()
    expect(page.locator("#health")).to_have_text("ready")
    expect(page.locator("#kv-used")).to_contain_text("blocks", timeout=20_000)


def test_metrics_change_under_load(page: object, server: Server) -> None:
    expect = sync_api.expect
    expect(page.locator("#gen-total")).not_to_have_text("–", timeout=20_000)
    before = page.locator("#gen-total").inner_text()
    worker = threading.Thread(target=_load, args=(server, 6))
    worker.start()
    # While the load runs the throughput becomes non-zero at some refresh...
    page.wait_for_function(
        "() => parseFloat(document.getElementById('tok-rate').textContent.replace(/,/g, '')) > 0",
        timeout=60_000,
    )
    worker.join()
    # ...and the total counts every token of the finished requests at a later refresh.
    want = int(before.replace(",", "")) + 6 * 24
    page.wait_for_function(
        f"() => parseInt(document.getElementById('gen-total').textContent.replace(/,/g, ''))"
        f" >= {want}",
        timeout=20_000,
    )
    expect(page.locator("#ttft")).to_contain_text("s")
    expect(page.locator("#itl")).to_contain_text("s")


def test_chat_leaves_the_temperature_to_the_model_by_default(page: object, server: Server) -> None:
    """The field starts empty, showing the model's default (/v1/models' sampling_defaults),
    and then the request carries no temperature: the model's own sampling applies (a fixed
    0.7 made the default model's first answer nonsense)."""
    expect = sync_api.expect
    expect(page.locator("#chat-temp")).to_have_value("")
    expect(page.locator("#chat-temp")).to_have_attribute("placeholder", "model's: 1")
    page.fill("#chat-max", "4")
    page.fill("#chat-input", "Hello")
    done = page.locator("#chat-log .msg.assistant.done")
    before = done.count()
    with page.expect_request(lambda r: r.url.endswith("/v1/chat/completions")) as sent:
        page.click("#chat-send")
    body = json.loads(sent.value.post_data or "{}")
    assert "temperature" not in body and body["max_tokens"] == 4, body
    expect(done).to_have_count(before + 1, timeout=60_000)
    page.click("#chat-clear")


def test_chat_streams_an_answer(page: object, server: Server) -> None:
    expect = sync_api.expect
    page.fill("#chat-max", "12")
    # Greedy: sampled, the random model ends its answer early about 1 token in 768.
    page.fill("#chat-temp", "0")
    page.fill("#chat-input", "Hello there")
    # Count the text updates of the answer while it streams.
    page.evaluate(
        """() => {
        window.__updates = 0;
        const options = {subtree: true, characterData: true, childList: true};
        new MutationObserver(() => window.__updates++).observe(
            document.getElementById('chat-log'), options);
    }"""
    )
    page.click("#chat-send")
    expect(page.locator("#chat-log .msg.user")).to_have_text("youHello there")
    answer = page.locator("#chat-log .msg.assistant.done")
    expect(answer).to_have_count(1, timeout=60_000)
    expect(answer.locator(".meta")).to_contain_text("12 tokens")
    assert answer.locator(".text").inner_text().strip()
    # Several deltas arrived one by one, not one final body.
    assert page.evaluate("window.__updates") > 4
