"""`pippin --help` and `pippin serve --help`, as a user runs them: every API, the page,
where the docs are, and the sampling a request without its own gets."""

from __future__ import annotations

import subprocess
import sys

from pippin.store.default_model import DEFAULT_MODEL_SAMPLING, describe_sampling


def _help(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "pippin.cli", *args, "--help"],
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return " ".join(out.stdout.split())  # argparse wraps lines where it likes


def test_top_help_names_every_api_the_page_and_the_docs() -> None:
    text = _help()
    for part in ("OpenAI API", "Anthropic Messages API", "Ollama API", "web page", "docs/"):
        assert part in text, part


def test_serve_help_lists_every_surface_and_the_effective_sampling() -> None:
    text = _help("serve")
    routes = (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/v1/rerank",
        "/v1/audio/speech",
        "/v1/audio/transcriptions",
        "/v1/messages",
        "/v1/messages/count_tokens",
        "/api/chat",
        "/api/generate",
        "/api/embed",
        "/api/tags",
        "/metrics",
        "web page",
        "docs/",
    )
    for route in routes:
        assert route in text, route
    # The default model's own sampling, and the built-in values for the others.
    assert f"SmolLM2-135M-Instruct, {describe_sampling(DEFAULT_MODEL_SAMPLING)}" in text
    assert "temperature 1.0, top_p 1.0, top_k 0 (off)" in text
