"""What every chat-shaped API shares: the prompt from the template, the output parsers,
and a run that yields parsed deltas.

The OpenAI chat, Anthropic Messages and OpenAI Responses fronts each turn their wire
format into template messages and tools, then call these; only the formatting of the
answer differs between them.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Protocol

from pippin.chat import generic_tools
from pippin.chat.output import OutputParser, ParserChoice
from pippin.chat.template import ChatTemplateError, render_chat_async, render_chat_text_async
from pippin.chat.tool_parsers.base import ParsedDelta, ToolParser, random_call_id
from pippin.engine.client import EngineClient
from pippin.engine.constraint import Constraint
from pippin.engine.types import CompletionOutput, RequestOutput, SamplingParams, TokenLogprob
from pippin.serving import media as media_parts
from pippin.serving.errors import (
    ApiError,
    bad_request,
    server_error,
    unsupported_param,
    unsupported_value,
)
from pippin.serving.streams import closing
from pippin.structured.constraint import after_reasoning
from pippin.structured.spec import GrammarSpec, StructuredOutputError

if TYPE_CHECKING:
    from pippin.serving.live_model import LiveModel
    from pippin.serving.media import MediaParts
    from pippin.vision.inputs import MultiModal


async def render_media_prompt(
    live: LiveModel,
    tokenizer: Any,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    template_kwargs: dict[str, Any],
    media: MediaParts | None,
    *,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    messages_param: str = "messages",
) -> tuple[list[int], MultiModal | None]:
    """Prompt token ids through the model's own chat template; 400s name the field.
    Tools the template cannot show go into the system prompt (`chat.generic_tools`).
    Images and videos (`media` collected their parts) are loaded, checked against the
    limits and expanded by the model's processor into the prompt's tokens and the
    engine's `MultiModal`."""
    messages = live.with_preset(messages)  # a library model's SYSTEM and MESSAGE
    if generic_tools_for(live, tools):
        assert tools is not None
        messages, tools = generic_tools.with_tools(messages, tools), None
    kw: dict[str, Any] = dict(
        tools=tools,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        template_kwargs=template_kwargs,
    )
    try:
        if not media:
            return await render_chat_async(tokenizer, messages, **kw), None
        pictures = await media_parts.load(live, media, live.settings.media)
        text = await render_chat_text_async(tokenizer, media_parts.expand_frames(messages), **kw)
    except ChatTemplateError as exc:
        param = "chat_template_kwargs" if "chat_template_kwargs" in str(exc) else messages_param
        raise bad_request(str(exc), param=param) from None
    return await media_parts.build_prompt(live, text, pictures, messages_param, media.clips())


def generic_tools_for(live: LiveModel, tools: list[dict[str, Any]] | None) -> bool:
    """Whether a request's tools take the generic format: its template has no tools."""
    return bool(tools) and "tools" not in live.template_source


def parsers_for(live: LiveModel, tools: list[dict[str, Any]] | None) -> ParserChoice:
    """The output parsers of a request with these tools."""
    choice = live.generic_parsers if generic_tools_for(live, tools) else live.parsers
    assert choice is not None
    return choice


def tool_parser(live: LiveModel, tools: list[dict[str, Any]] | None) -> type[ToolParser] | None:
    """The tool-call format of a request with these tools (for a forced call's grammar)."""
    return parsers_for(live, tools).tool


def arguments_for_template(raw: str) -> Any:
    # HF chat templates expect tool-call arguments as a mapping (they `tojson` them).
    try:
        return json.loads(raw)
    except ValueError:
        return raw


def effort_kwargs(effort: str, reasoning_kwarg: str | None, param: str) -> dict[str, Any]:
    """A reasoning effort as the model's template takes it (see `inspect_template`)."""
    if reasoning_kwarg == "reasoning_effort":
        return {"reasoning_effort": effort}
    if reasoning_kwarg == "enable_thinking":
        return {"enable_thinking": effort != "none"}
    raise unsupported_param(param, "This model's chat template has no reasoning mode.")


def verbosity_kwargs(verbosity: str | None, template_source: str, param: str) -> dict[str, Any]:
    """`verbosity` for templates that read it; others take only the default, "medium"."""
    if verbosity is None:
        return {}
    if "verbosity" in template_source:
        return {"verbosity": verbosity}
    if verbosity != "medium":
        raise unsupported_value(
            param, "This model cannot be steered by 'verbosity'; only 'medium' is accepted."
        )
    return {}


class NewParser(Protocol):
    def __call__(self, whole: bool = False) -> OutputParser:
        """A parser for one output; `whole` when it is answered whole, not streamed."""
        ...


async def output_parsing(
    live: LiveModel,
    tokenizer: Any,
    prompt_ids: list[int],
    params: SamplingParams,
    tools: list[dict[str, Any]] | None,
    thinking_budget: int | None = None,
    *,
    spec: GrammarSpec | None = None,
    budget_param: str = "thinking_token_budget",
    new_id: Callable[[], str] = random_call_id,
    one_call: bool = False,
) -> tuple[NewParser, SamplingParams]:
    """Output parsers for a chat request, and the sampling settings they need: the
    special tokens they read, a thinking budget, and the grammar of `spec` (compiled
    to start after the model's reasoning)."""
    choice = parsers_for(live, tools)
    # Enough of the prompt's end to see whether the template opened a reasoning section.
    tail = tokenizer.decode(prompt_ids[-32:])
    thinking = None
    if thinking_budget is not None:
        thinking = choice.thinking_budget(thinking_budget, tail)
        if thinking is None:
            raise unsupported_param(budget_param, "This model has no reasoning section to limit.")
    params = replace(params, keep_special_ids=choice.keep_token_ids, thinking=thinking)
    if spec is not None:
        params = replace(params, constraint=await compile_spec(live, spec, tail))
    return (lambda whole=False: choice.make(tools, tail, new_id, whole, one_call)), params


def engine_failure(out: RequestOutput, c: CompletionOutput | None = None) -> ApiError | None:
    """The error a failed or server-aborted output stands for, if any."""
    if out.error_kind == "timeout":  # --request-timeout
        return server_error(f"The request timed out: {out.error}.", "request_timeout", 504)
    if out.error_kind == "slow_reader":
        return server_error(f"The stream was ended: {out.error}.", "stream_not_read", 500)
    if out.error is not None or (c is not None and c.finish_reason == "error"):
        return server_error(
            f"The engine failed this request: {out.error or 'unknown error'}", "engine_error"
        )
    if c is not None and c.finish_reason == "abort":
        return server_error("The request was aborted by the server.", "request_aborted", 503)
    return None


def raise_failure(out: RequestOutput) -> None:
    """Raises the error that a failed or server-aborted output (or one of its sequences')
    stands for, if any."""
    for err in (engine_failure(out), *(engine_failure(out, c) for c in out.outputs)):
        if err is not None:
            raise err


@dataclass
class ParsedStep:
    """One engine output of one of a request's sequences (`output.index`), parsed."""

    parsed: ParsedDelta
    output: CompletionOutput
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # so far, in all
    finish_reason: str | None  # "stop", "length" or "tool_calls" on the last step
    stop_reason: str | int | None
    # The prompt's logprobs (`SamplingParams.prompt_logprobs`), on the first step.
    prompt_logprobs: list[TokenLogprob | None] | None = None


async def run_parsed(
    engine: EngineClient,
    prompt_ids: list[int],
    params: SamplingParams,
    request_id: str,
    parsers: list[OutputParser],
    admitted: Callable[[int], None] | None = None,
) -> AsyncIterator[ParsedStep]:
    """Generate the request's sequences (one parser each, by choice index) and parse them
    as they come; engine failures raise. `admitted` takes the prompt's cached tokens from
    an output without tokens (`SamplingParams.announce`)."""
    completion = 0
    gen = engine.generate(prompt_ids, params, request_id)
    async with closing(gen) as outputs:
        async for out in outputs:
            raise_failure(out)
            if not out.outputs and admitted is not None:
                admitted(out.cached_tokens)
            for c in out.outputs:
                parser = parsers[c.index]
                completion += len(c.token_ids)
                parsed = parser.feed(c.text, c.token_ids)
                reason = c.finish_reason
                if reason is not None:
                    parsed.merge(parser.finish())
                    if reason == "stop" and parser.called:
                        reason = "tool_calls"
                yield ParsedStep(
                    parsed,
                    c,
                    out.prompt_tokens,
                    out.cached_tokens,
                    completion,
                    reason,
                    c.stop_reason,
                    out.prompt_logprobs,
                )


def grammar_error(exc: StructuredOutputError) -> ApiError:
    return bad_request(exc.message, param=exc.param, code="invalid_value")


async def compile_spec(
    live: LiveModel, spec: GrammarSpec, prompt_text: str | None = None
) -> Constraint:
    """`spec` compiled for the served model; with `prompt_text`, it starts after the
    model's reasoning section (chat)."""
    compiler = live.grammars
    assert compiler is not None
    choice = live.parsers
    if choice is not None and choice.tool is not None and choice.tool.handles_reasoning:
        raise unsupported_value(
            spec.param, "Structured output is not supported for this model's output format."
        )
    try:
        constraint = await compiler.constraint(spec)
    except StructuredOutputError as exc:
        raise grammar_error(exc) from None
    if prompt_text is not None:
        constraint = after_reasoning(constraint, choice, prompt_text)
    return constraint
