"""Chat messages -> prompt token ids through the model's own chat template.

Rendering runs Jinja and the tokenizer, which can take milliseconds for long
conversations, so the async entry point runs it in a worker thread.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from jinja2 import TemplateError

# Arguments of `apply_chat_template` that pippin sets itself; a request's
# chat_template_kwargs may not override them.
RESERVED_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "sanitize_control_tokens",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered (bad roles, order, missing template...)."""


@dataclass(frozen=True)
class TemplateInfo:
    has_template: bool
    # How the template takes a reasoning switch: "reasoning_effort" (passed as is),
    # "enable_thinking" (on/off), or None when the model has no reasoning mode.
    reasoning_kwarg: str | None


def _template_source(tokenizer: Any) -> str:
    tmpl = getattr(tokenizer, "chat_template", None)
    if isinstance(tmpl, dict):  # named templates ("default", "tool_use", ...)
        return "\n".join(str(v) for v in tmpl.values())
    return tmpl if isinstance(tmpl, str) else ""


def inspect_template(tokenizer: Any) -> TemplateInfo:
    source = _template_source(tokenizer)
    if "reasoning_effort" in source:
        kwarg: str | None = "reasoning_effort"
    elif "enable_thinking" in source:
        kwarg = "enable_thinking"
    else:
        kwarg = None
    return TemplateInfo(has_template=bool(source), reasoning_kwarg=kwarg)


def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Render with the model's template and tokenize (the template adds BOS etc.)."""
    text = render_chat_text(
        tokenizer,
        messages,
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def render_chat_text(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    *,
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """The prompt as the model's template writes it (image parts as its placeholders)."""
    if not _template_source(tokenizer):
        raise ChatTemplateError(
            "This model has no chat template; use /v1/completions with a plain prompt."
        )
    kwargs = dict(template_kwargs or {})
    clash = sorted(RESERVED_KWARGS & kwargs.keys())
    if clash:
        raise ChatTemplateError(f"chat_template_kwargs may not set {', '.join(clash)}")
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=False,
            **kwargs,
        )
    except TemplateError as exc:
        # Templates raise on conversations they refuse (e.g. roles out of order).
        raise ChatTemplateError(f"The chat template rejected the messages: {exc}") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise ChatTemplateError(f"Could not apply the chat template: {exc}") from None
    if not isinstance(text, str):
        raise ChatTemplateError("The chat template did not render to text.")
    return text


async def render_chat_async(tokenizer: Any, messages: list[dict[str, Any]], **kw: Any) -> list[int]:
    return await asyncio.to_thread(render_chat, tokenizer, messages, **kw)


async def render_chat_text_async(tokenizer: Any, messages: list[dict[str, Any]], **kw: Any) -> str:
    return await asyncio.to_thread(render_chat_text, tokenizer, messages, **kw)
