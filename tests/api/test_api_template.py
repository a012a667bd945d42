"""Messages -> template dicts -> prompt ids, and the reasoning switch."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.utils import load_tokenizer

from pippin.api.openai.chat import template_kwargs, template_messages, template_tools
from pippin.api.openai.protocol import ChatCompletionRequest
from pippin.chat.template import ChatTemplateError, TemplateInfo, inspect_template, render_chat
from pippin.serving.errors import ApiError
from pippin.serving.job import ChatJob
from pippin.serving.job import template_kwargs as job_template_kwargs
from pippin.serving.live_model import LiveModel
from pippin.serving.logprobs import TokenRenderer
from pippin.serving.settings import ServerSettings


class FakeTokenizer:
    def __init__(self, template: str | None) -> None:
        self.chat_template = template


def req(**fields: Any) -> ChatCompletionRequest:
    fields.setdefault("messages", [{"role": "user", "content": "x"}])
    return ChatCompletionRequest.model_validate({"model": "m", **fields})


def test_inspect_template() -> None:
    assert inspect_template(FakeTokenizer(None)).has_template is False
    assert inspect_template(FakeTokenizer("{{ messages }}")).reasoning_kwarg is None
    assert inspect_template(FakeTokenizer("{% if enable_thinking %}")).reasoning_kwarg == (
        "enable_thinking"
    )
    info = inspect_template(FakeTokenizer("{{ reasoning_effort }}"))
    assert info.has_template and info.reasoning_kwarg == "reasoning_effort"


def live_model(reasoning_kwarg: str | None, defaults: dict[str, Any] | None = None) -> LiveModel:
    """A chat model as far as templating needs: its template's reasoning switch and the
    server's --default-chat-template-kwargs."""
    settings = ServerSettings(default_chat_template_kwargs=defaults or {})
    info = TemplateInfo(has_template=True, reasoning_kwarg=reasoning_kwarg)
    return LiveModel(settings, template=info)


def test_reasoning_effort_maps_to_the_template() -> None:
    effort = live_model("reasoning_effort")
    switch = live_model("enable_thinking")
    assert template_kwargs(req(reasoning_effort="high"), effort) == {"reasoning_effort": "high"}
    assert template_kwargs(req(reasoning_effort="none"), switch) == {"enable_thinking": False}
    assert template_kwargs(req(reasoning_effort="low"), switch) == {"enable_thinking": True}
    with pytest.raises(ApiError) as info:
        template_kwargs(req(reasoning_effort="low"), live_model(None))
    assert info.value.param == "reasoning_effort"


def test_template_kwargs_merge() -> None:
    """The request's own arguments over the server's defaults, as the job renders them."""
    r = req(chat_template_kwargs={"a": 2, "b": 3})
    live = live_model(None, {"a": 1, "c": 4})
    job = ChatJob("m", "x", [], template_kwargs=lambda live: template_kwargs(r, live))
    assert job_template_kwargs(live, job) == {"a": 2, "b": 3, "c": 4}


def test_messages_normalised_for_templates() -> None:
    r = req(
        messages=[
            {"role": "developer", "content": "dev"},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
                "name": "u",
            },
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "thought",
                "tool_calls": [
                    {
                        "id": "c",
                        "type": "function",
                        "function": {"name": "f", "arguments": '{"x": 1}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c", "content": [{"type": "text", "text": "1"}]},
            {"role": "function", "name": "g", "content": None},
        ]
    )
    out = template_messages(r)
    assert out[0] == {"role": "system", "content": "dev"}
    assert out[1] == {"role": "user", "content": "a\nb", "name": "u"}
    assert out[2]["content"] == "" and out[2]["reasoning_content"] == "thought"
    assert out[2]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert out[3] == {"role": "tool", "content": "1", "tool_call_id": "c"}
    assert out[4] == {"role": "tool", "content": "", "name": "g"}


def test_tools_and_tool_choice() -> None:
    tool = {"type": "function", "function": {"name": "f", "description": "d"}}
    assert template_tools(req(tools=[tool])) == [tool]
    assert template_tools(req(tools=[tool], tool_choice="none")) is None
    fn = {"name": "g", "parameters": {"type": "object"}}
    assert template_tools(req(functions=[fn], function_call="auto")) == [
        {"type": "function", "function": fn}
    ]
    # Forced calls are honoured (tests/test_api_structured.py); these kinds are not.
    for bad in ({"tool_choice": {"type": "allowed_tools"}}, {"tool_choice": {"type": "x"}}):
        with pytest.raises(ApiError):
            template_tools(req(tools=[tool], **bad))


def test_render_with_a_real_tokenizer(tiny_models: Callable[..., Path]) -> None:
    tok = load_tokenizer(tiny_models("llama"))
    msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]
    ids = render_chat(tok, msgs)
    text = tok.decode(ids)
    assert text.endswith("<|im_start|>assistant\n") and "<|im_start|>user\nhi<|im_end|>" in text
    cont = render_chat(
        tok,
        [*msgs, {"role": "assistant", "content": "Once"}],
        add_generation_prompt=False,
        continue_final_message=True,
    )
    assert tok.decode(cont).endswith("Once")
    with pytest.raises(ChatTemplateError):
        render_chat(tok, msgs, template_kwargs={"tokenize": True})
    with pytest.raises(ChatTemplateError):
        render_chat(FakeTokenizer(None), msgs)


def test_token_renderer_bytes(tiny_models: Callable[..., Path]) -> None:
    tok = load_tokenizer(tiny_models("llama"))
    render = TokenRenderer(tok)
    ids = tok.encode("héllo wörld", add_special_tokens=False)
    joined = b"".join(bytes(render(i)[1]) for i in ids)
    assert joined.decode() == "héllo wörld"
