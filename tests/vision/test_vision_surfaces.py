"""Images on the other surfaces, against `pippin serve` of a tiny VLM over real HTTP:
the Ollama API through the `ollama` client, /v1/models' capabilities, and the Anthropic
request Claude Code sends with a pasted screenshot."""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import Iterator

import anthropic
import httpx
import pytest

pytest.importorskip("mlx_vlm")
ollama = pytest.importorskip("ollama")

from media_helpers import noise_png as png  # noqa: E402
from support.mcp_test_server import SCRIPT  # noqa: E402
from support.server_utils import Server, run_server  # noqa: E402
from support.tiny_vlms import get_tiny_vlm  # noqa: E402


@pytest.fixture(scope="module")
def vlm_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("vlm")
    path = get_tiny_vlm("qwen2_5_vl", tmp)
    mcp = tmp / "mcp.json"
    mcp.write_text(
        json.dumps({"mcpServers": {"local": {"command": sys.executable, "args": [SCRIPT]}}})
    )
    with run_server(
        str(path),
        "--served-model-name",
        "tiny-vl",
        "--block-size",
        "4",
        "--mcp-config",
        str(mcp),
        "--mcp-max-calls",
        "1",
    ) as server:
        yield server


GREEDY = {"temperature": 0, "num_predict": 6}


def test_ollama_chat_and_generate_take_images(vlm_server: Server) -> None:
    client = ollama.Client(host=vlm_server.url, timeout=120)
    ask = {"role": "user", "content": "What is in the picture?"}
    plain = client.chat(model="tiny-vl", messages=[ask], options=GREEDY)
    seen = client.chat(model="tiny-vl", messages=[{**ask, "images": [png(1)]}], options=GREEDY)
    # The image's 4 tokens (56x56 at 14-px patches, merged 2x2) and its start/end markers.
    assert seen.prompt_eval_count == plain.prompt_eval_count + 6
    # The answer depends on the picture: the same one gives the same greedy answer.
    again = client.chat(model="tiny-vl", messages=[{**ask, "images": [png(1)]}], options=GREEDY)
    assert again.message.content == seen.message.content
    # Two images, streamed, as base64 strings (what the client sends for bytes too).
    b64 = [base64.b64encode(png(s)).decode() for s in (2, 3)]
    chunks = list(
        client.chat(model="tiny-vl", messages=[{**ask, "images": b64}], options=GREEDY, stream=True)
    )
    assert chunks[-1].done and chunks[-1].prompt_eval_count == plain.prompt_eval_count + 12
    gen_plain = client.generate(model="tiny-vl", prompt="Describe it.", options=GREEDY)
    gen = client.generate(model="tiny-vl", prompt="Describe it.", images=[png(1)], options=GREEDY)
    assert gen.prompt_eval_count == gen_plain.prompt_eval_count + 6
    assert "vision" in client.show("tiny-vl").capabilities
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny-vl", messages=[{**ask, "images": [b"\x89PNG not really"]}])
    assert e.value.status_code == 400 and "messages[0].images[0]" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="tiny-vl", prompt="x", images=[png(1)], raw=True)
    assert e.value.status_code == 400 and "raw" in e.value.error


def test_ollama_text_model_refuses_images(text_server: Server) -> None:
    client = ollama.Client(host=text_server.url, timeout=120)
    msg = {"role": "user", "content": "Hi", "images": [png(1)]}
    with pytest.raises(ollama.ResponseError) as e:
        client.chat(model="tiny", messages=[msg])
    assert (
        e.value.status_code == 400
        and e.value.error == '"tiny" does not support vision (image input)'
    )
    with pytest.raises(ollama.ResponseError) as e:
        client.generate(model="tiny", prompt="Hi", images=[png(1)])
    assert e.value.status_code == 400 and "does not support vision" in e.value.error
    assert "vision" not in (client.show("tiny").capabilities or [])


def test_models_list_says_which_take_images(vlm_server: Server, text_server: Server) -> None:
    vl = httpx.get(f"{vlm_server.url}/v1/models").json()["data"]
    assert [m["capabilities"] for m in vl if m["id"] == "tiny-vl"] == [["chat", "vision"]]
    text = httpx.get(f"{text_server.url}/v1/models/tiny").json()
    assert text["capabilities"] == ["chat"]


def test_claude_code_pasted_screenshot(vlm_server: Server) -> None:
    """Claude Code's shape: system blocks with cache_control, tools, a streamed answer,
    and the screenshot as a base64 `image` block in the last user turn."""
    client = anthropic.Anthropic(base_url=vlm_server.url, api_key="unused", max_retries=0)
    shot = {
        "type": "image",
        "source": {
            "type": "base64",
            "media_type": "image/png",
            "data": base64.b64encode(png(5, (84, 56))).decode(),
        },
    }
    system = [
        {"type": "text", "text": "You are Claude Code, Anthropic's official CLI for Claude."},
        {
            "type": "text",
            "text": "You are an interactive CLI tool that helps users with software tasks.",
            "cache_control": {"type": "ephemeral"},
        },
    ]
    tools = [
        {
            "name": "Bash",
            "description": "Executes a bash command",
            "input_schema": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
        {
            "name": "Read",
            "description": "Reads a file",
            "input_schema": {
                "type": "object",
                "properties": {"file_path": {"type": "string"}},
                "required": ["file_path"],
            },
            "cache_control": {"type": "ephemeral"},
        },
    ]
    text = {"type": "text", "text": "Why does this page look broken?"}
    messages = [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hello!"}]},
        {
            "role": "user",
            "content": [shot, {**text, "cache_control": {"type": "ephemeral"}}],
        },
    ]
    common = {"model": "tiny-vl", "system": system, "tools": tools}
    with client.messages.stream(max_tokens=8, messages=messages, **common) as stream:
        final = stream.get_final_message()
    counted = client.messages.count_tokens(messages=messages, **common)
    text_only = [*messages[:2], {"role": "user", "content": [text]}]
    without = client.messages.count_tokens(messages=text_only, **common)
    # 84x56 at 14-px patches merged 2x2: 6 image tokens, with start/end markers.
    assert counted.input_tokens == without.input_tokens + 8
    usage = final.usage
    read = usage.cache_read_input_tokens or 0
    assert (
        usage.input_tokens + read + (usage.cache_creation_input_tokens or 0) == counted.input_tokens
    )
    assert final.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_images_with_mcp_tools_survive_the_tool_loop(vlm_server: Server) -> None:
    """An approved call runs on the server before the model's turn; that turn's prompt,
    rendered again with the call and its result, still holds the picture."""
    url = "data:image/png;base64," + base64.b64encode(png(4)).decode()
    approved = [
        {
            "type": "mcp_approval_request",
            "id": "mcpr_1",
            "server_label": "local",
            "name": "lookup_code",
            "arguments": json.dumps({"city": "Paris"}),
        },
        {"type": "mcp_approval_response", "approval_request_id": "mcpr_1", "approve": True},
    ]
    tool = {"type": "mcp", "server_label": "local", "require_approval": "never"}

    def respond(with_image: bool) -> dict:
        content: list[dict] = [{"type": "input_text", "text": "What is the door code?"}]
        if with_image:
            content.insert(0, {"type": "input_image", "image_url": url})
        r = vlm_server.http().post(
            "/v1/responses",
            json={
                "model": "tiny-vl",
                "input": [{"role": "user", "content": content}, *approved],
                "tools": [tool],
                "temperature": 0,
                "max_output_tokens": 4,
            },
        )
        assert r.status_code == 200, r.text
        return r.json()

    seen, plain = respond(True), respond(False)
    call = next(i for i in seen["output"] if i["type"] == "mcp_call")
    assert call["output"] == "PX-4417" and call["approval_request_id"] == "mcpr_1"
    # The image's 4 tokens and its start/end markers, in the turn after the call.
    assert seen["usage"]["input_tokens"] == plain["usage"]["input_tokens"] + 6
    # Chat's `mcp` tools and Anthropic's `mcp_servers` take images too (no call needed).
    chat = vlm_server.client().chat.completions.create(
        model="tiny-vl",
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "image_url", "image_url": {"url": url}},
                    {"type": "text", "text": "Hi"},
                ],
            }
        ],
        tools=[tool],  # type: ignore[list-item]
        max_tokens=2,
    )
    assert chat.usage is not None and chat.usage.prompt_tokens > 6
    anth = anthropic.Anthropic(base_url=vlm_server.url, api_key="unused", max_retries=0)
    block = {
        "type": "image",
        "source": {"type": "base64", "media_type": "image/png", "data": url.split(",")[1]},
    }
    m = anth.beta.messages.create(
        model="tiny-vl",
        max_tokens=2,
        messages=[{"role": "user", "content": [block, {"type": "text", "text": "Hi"}]}],
        mcp_servers=[{"type": "url", "url": "http://unused.invalid/", "name": "local"}],
        betas=["mcp-client-2025-04-04"],
    )
    assert m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) > 6
