"""POST /v1/chat/completions: OpenAI chat requests in, chat.completion objects out."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from pippin.api.chat_pipeline import (
    NewParser,
    ParsedStep,
    arguments_for_template,
    effort_kwargs,
    engine_failure,
    output_parsing,
    render_media_prompt,
    verbosity_kwargs,
)
from pippin.api.common import (
    SSE_HEADERS,
    cancel_on_disconnect,
    closing,
    obfuscation,
    parse_request,
    sse,
)
from pippin.api.errors import (
    bad_request,
    unsupported_param,
    unsupported_value,
)
from pippin.api.logprobs import TokenRenderer, clamp_logprob
from pippin.api.mcp_loop import (
    CallFinished,
    McpTools,
    ToolLoop,
    Turn,
    call_summary,
    every_server_tools,
    openai_mcp_tools,
    request_loop,
)
from pippin.api.media_parts import MediaParts
from pippin.api.openai.protocol import (
    AssistantMessage,
    AudioPart,
    ChatCompletionRequest,
    CustomTool,
    DeveloperMessage,
    FunctionMessage,
    ImagePart,
    McpTool,
    RefusalPart,
    SystemMessage,
    TextPart,
    ToolMessage,
    UserMessage,
    VideoPart,
    framed_stream,
)
from pippin.api.openai.sampling import build_sampling_params, resolve_max_tokens
from pippin.api.openai.structured_output import chat_spec, forced_tool
from pippin.api.openapi import openai_route
from pippin.api.state import check_model, get_state, require_engine, use_model
from pippin.chat.output import OutputParser
from pippin.chat.tool_parsers.base import ParsedDelta, collect_calls
from pippin.engine.client import EngineClient, EngineError
from pippin.engine.types import SamplingParams, TokenLogprob

router = APIRouter()
log = logging.getLogger(__name__)


# --- request -> prompt -------------------------------------------------------


def _join_text(content: str | list[Any] | None, param: str) -> str:
    """Message content as one string; non-text parts are refused by name."""
    out = _content(content, param, None)
    assert isinstance(out, str)
    return out


def _content(
    content: str | list[Any] | None, param: str, media: MediaParts | None
) -> str | list[dict[str, Any]]:
    """Message content for the template: one string, or (with images or videos, which
    `media` collects) a list of text and image parts. Other parts are refused by name."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if isinstance(part, TextPart):
            texts.append(part.text)
            parts.append({"type": "text", "text": part.text})
        elif isinstance(part, RefusalPart):
            texts.append(part.refusal)
            parts.append({"type": "text", "text": part.refusal})
        elif isinstance(part, ImagePart) and media is not None:
            url = part.image_url
            parts.append(media.image(url.url, f"{param}[{j}]", url.detail))
        elif isinstance(part, VideoPart) and media is not None:
            parts.append(media.video(part.video_url.url, f"{param}[{j}]"))
        elif isinstance(part, AudioPart) and media is not None:
            audio = part.input_audio
            parts.append(media.audio(audio.data, audio.format, f"{param}[{j}]"))
        else:
            kind = {
                "image_url": "Image",
                "video_url": "Video",
                "input_audio": "Audio",
                "file": "File",
            }[part.type]
            raise unsupported_value(
                f"{param}[{j}]",
                f"{kind} input ('{part.type}' content parts) is not supported "
                + ("in this message." if kind in ("Image", "Video") else "by this model."),
            )
    if len(parts) > len(texts):  # images among them
        return parts
    # As vLLM joins text parts, so prompts match across the two servers.
    return "\n".join(texts)


def template_messages(
    req: ChatCompletionRequest, media: MediaParts | None = None
) -> list[dict[str, Any]]:
    """OpenAI messages -> the plain dicts Hugging Face chat templates take; the user
    messages' images and videos are collected in `media` (refused without it)."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        p = f"messages[{i}]"
        msg: dict[str, Any]
        if isinstance(m, SystemMessage | DeveloperMessage):
            # Templates know 'system'; 'developer' is OpenAI's new name for it.
            msg = {"role": "system", "content": _join_text(m.content, f"{p}.content")}
        elif isinstance(m, UserMessage):
            msg = {"role": "user", "content": _content(m.content, f"{p}.content", media)}
        elif isinstance(m, AssistantMessage):
            if m.audio is not None:
                raise unsupported_param(f"{p}.audio", "Audio is not supported.")
            content = _join_text(m.content, f"{p}.content")
            msg = {"role": "assistant", "content": content or (m.refusal or "")}
            calls = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {
                        "name": c.function.name,
                        "arguments": arguments_for_template(c.function.arguments),
                    },
                }
                for c in m.tool_calls or []
            ]
            if m.function_call is not None:  # deprecated form of one tool call
                fc = m.function_call
                calls.append(
                    {
                        "id": f"call_{i}",
                        "type": "function",
                        "function": {
                            "name": fc.name,
                            "arguments": arguments_for_template(fc.arguments),
                        },
                    }
                )
            if calls:
                msg["tool_calls"] = calls
            reasoning = m.reasoning_content or m.reasoning
            if reasoning:
                msg["reasoning_content"] = reasoning
        elif isinstance(m, ToolMessage):
            msg = {
                "role": "tool",
                "content": _join_text(m.content, f"{p}.content"),
                "tool_call_id": m.tool_call_id,
            }
        else:
            assert isinstance(m, FunctionMessage)
            msg = {"role": "tool", "content": m.content or "", "name": m.name}
        name = getattr(m, "name", None)
        if name and "name" not in msg:
            msg["name"] = name
        out.append(msg)
    return out


def template_tools(req: ChatCompletionRequest) -> list[dict[str, Any]] | None:
    """Tools for the template, honouring tool_choice / function_call."""
    if req.tools is not None and req.functions is not None:
        raise bad_request("Use 'tools' or the deprecated 'functions', not both.", param="functions")
    choice: Any = req.tool_choice
    choice_param = "tool_choice"
    if req.function_call is not None:
        if req.tool_choice is not None:
            raise bad_request(
                "Use 'tool_choice' or the deprecated 'function_call', not both.",
                param="function_call",
            )
        choice, choice_param = req.function_call, "function_call"
    if req.tool_choice is not None and not req.tools:
        # As OpenAI: a tool choice means nothing without tools.
        raise bad_request(
            "'tool_choice' is only allowed when 'tools' are specified.", param="tool_choice"
        )
    forced_tool(choice, choice_param)  # refuses kinds that cannot be forced
    tools: list[dict[str, Any]] = []
    for j, t in enumerate(req.tools or []):
        if isinstance(t, McpTool):
            continue  # run by pippin: see `mcp_tools`
        if isinstance(t, CustomTool):
            raise unsupported_value(f"tools[{j}].type", "Custom tools are not supported.")
        tools.append({"type": "function", "function": t.function.model_dump(exclude_none=True)})
    for f in req.functions or []:
        tools.append({"type": "function", "function": f.model_dump(exclude_none=True)})
    if choice == "none":
        return None  # "the model will not call any tool": it is not shown any
    return tools or None


def mcp_tools(req: ChatCompletionRequest, state: Any) -> McpTools | None:
    """The MCP tools pippin runs for this request: its `mcp` tools (a pippin extension of
    chat completions, shaped as the Responses API's), else every server's with --mcp-auto."""
    specs = [(t, f"tools[{j}]") for j, t in enumerate(req.tools or []) if isinstance(t, McpTool)]
    if req.tool_choice == "none" or req.function_call == "none":
        return None
    if specs:
        tools = openai_mcp_tools(state, specs, approvals=False)
    elif state.settings.mcp.auto and state.mcp is not None:
        tools = every_server_tools(state)
    else:
        return None
    if req.n is not None and req.n > 1:
        raise unsupported_value("n", "MCP tools run for one choice only; 'n' must be 1.")
    return tools


def template_kwargs(
    req: ChatCompletionRequest, defaults: dict[str, Any], reasoning_kwarg: str | None
) -> dict[str, Any]:
    kwargs = {**defaults, **(req.chat_template_kwargs or {})}
    if req.reasoning_effort is not None:
        kwargs |= effort_kwargs(req.reasoning_effort, reasoning_kwarg, "reasoning_effort")
    return kwargs


def reject_unsupported(req: ChatCompletionRequest) -> None:
    """Fields of the API reference that pippin cannot honour (yet) -> 400 by name."""
    if req.audio is not None:
        raise unsupported_param("audio", "Audio output is not supported.")
    if req.modalities is not None and any(m != "text" for m in req.modalities):
        raise unsupported_value("modalities", "Only the 'text' output modality is supported.")
    if req.prediction is not None:
        raise unsupported_param("prediction", "Predicted outputs are not supported.")
    if req.web_search_options is not None:
        raise unsupported_param("web_search_options", "Web search is not available.")
    if req.moderation is not None:
        raise unsupported_param("moderation", "Moderation is not available.")
    if req.store:
        raise unsupported_value("store", "Completions are not stored; 'store' must be false.")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("'top_logprobs' requires 'logprobs' to be true.", param="top_logprobs")
    if req.stream_options is not None and not req.stream:
        raise bad_request(
            "'stream_options' is only allowed when 'stream' is true.", param="stream_options"
        )
    if (
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and req.max_tokens != req.max_completion_tokens
    ):
        raise bad_request(
            "Set 'max_completion_tokens' or 'max_tokens', not both with different values.",
            param="max_tokens",
        )
    if req.add_generation_prompt and req.continue_final_message:
        raise bad_request(
            "'continue_final_message' and 'add_generation_prompt' cannot both be true.",
            param="continue_final_message",
        )
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise bad_request(
            "'continue_final_message' needs the last message to be from the assistant.",
            param="continue_final_message",
        )


# --- engine outputs -> response ----------------------------------------------


def format_logprobs(lps: list[TokenLogprob], render: TokenRenderer) -> list[dict[str, Any]]:
    out = []
    for lp in lps:
        text, raw = render(lp.token_id)
        top = []
        for tid, val in lp.top:
            t, b = render(tid)
            top.append({"token": t, "logprob": clamp_logprob(val), "bytes": b})
        out.append(
            {"token": text, "logprob": clamp_logprob(lp.logprob), "bytes": raw, "top_logprobs": top}
        )
    return out


def usage_dict(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


@dataclass
class _Choice:
    parser: OutputParser
    parsed: ParsedDelta = field(default_factory=ParsedDelta)
    tokens: int = 0
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None


def finish_reason(reason: str | None, parser: OutputParser) -> str:
    # As OpenAI: a turn that ends in tool calls says so; a cut-off one stays "length".
    if reason in (None, "stop") and parser.called:
        return "tool_calls"
    return reason or "stop"


def message_body(parsed: ParsedDelta, parser: OutputParser) -> dict[str, Any]:
    calls = collect_calls(parsed.calls)
    content: str | None = parsed.content
    if calls and not content.strip():
        content = None  # as OpenAI: a message of tool calls only has no content
    msg: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
    if parser.reasoning is not None or parsed.reasoning:
        # vLLM's field and the newer name clients read; both, for either kind of client.
        msg["reasoning_content"] = parsed.reasoning or None
        msg["reasoning"] = parsed.reasoning or None
    if calls:
        msg["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments},
            }
            for c in calls
        ]
    return msg


def delta_body(parsed: ParsedDelta) -> dict[str, Any]:
    delta: dict[str, Any] = {}
    if parsed.reasoning:
        delta["reasoning_content"] = parsed.reasoning
        delta["reasoning"] = parsed.reasoning
    if parsed.content:
        delta["content"] = parsed.content
    if parsed.calls:
        out = []
        for c in parsed.calls:
            if c.name is not None:  # a call's first delta: its id and name
                fn = {"name": c.name, "arguments": c.arguments}
                out.append({"index": c.index, "id": c.id, "type": "function", "function": fn})
            else:
                out.append({"index": c.index, "function": {"arguments": c.arguments}})
        delta["tool_calls"] = out
    return delta


@dataclass
class ChatRun:
    """Everything needed to run one validated chat request and answer it."""

    engine: EngineClient
    prompt_ids: list[int]
    params: SamplingParams
    request_id: str
    model: str
    fingerprint: str
    render: TokenRenderer
    # One output parser per choice: reasoning, content and tool calls.
    new_parser: NewParser
    include_usage: bool = False
    obfuscate: bool = False
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    # The MCP tool loop, when the request enabled MCP tools (one choice).
    loop: ToolLoop | None = None
    _mcp_index: dict[int, bool] = field(default_factory=dict)  # call index -> MCP's

    def header(self, obj: str) -> dict[str, Any]:
        head = {
            "id": self.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }
        if self.service_tier is not None:
            head["service_tier"] = self.service_tier
        return head

    async def collect(self) -> dict[str, Any]:
        if self.loop is not None:
            return await self._collect_loop(self.loop)
        choices = [_Choice(self.new_parser(whole=True)) for _ in range(self.params.n)]
        prompt_tokens, cached = len(self.prompt_ids), 0
        gen = self.engine.generate(self.prompt_ids, self.params, self.request_id)
        async with closing(gen) as outputs:
            async for out in outputs:
                prompt_tokens, cached = out.prompt_tokens, out.cached_tokens
                err = engine_failure(out)
                if err:
                    raise err
                for c in out.outputs:
                    err = engine_failure(out, c)
                    if err:
                        raise err
                    ch = choices[c.index]
                    ch.parsed.merge(ch.parser.feed(c.text, c.token_ids))
                    ch.tokens += len(c.token_ids)
                    if c.logprobs:
                        ch.logprobs.extend(format_logprobs(c.logprobs, self.render))
                    if c.finish_reason is not None:
                        ch.finish_reason = c.finish_reason
                        ch.parsed.merge(ch.parser.finish())
        body = self.header("chat.completion")
        body["choices"] = [
            {
                "index": i,
                "message": message_body(ch.parsed, ch.parser),
                "logprobs": {"content": ch.logprobs, "refusal": None}
                if self.params.logprobs
                else None,
                "finish_reason": finish_reason(ch.finish_reason, ch.parser),
            }
            for i, ch in enumerate(choices)
        ]
        body["usage"] = usage_dict(prompt_tokens, sum(c.tokens for c in choices), cached)
        if self.metadata is not None:
            body["metadata"] = self.metadata
        return body

    def _chunk(self, choices: list[dict[str, Any]]) -> str:
        body = self.header("chat.completion.chunk")
        body["choices"] = choices
        if self.include_usage:
            body["usage"] = None  # as OpenAI: null on every chunk but the last
        if self.obfuscate:
            body["obfuscation"] = obfuscation()
        return sse(body)

    def stream(self) -> AsyncIterator[str]:
        tally = {"prompt": len(self.prompt_ids), "cached": 0, "completion": 0}

        def usage() -> dict[str, Any] | None:
            if not self.include_usage:
                return None
            body = self.header("chat.completion.chunk")
            body["choices"] = []
            body["usage"] = usage_dict(tally["prompt"], tally["completion"], tally["cached"])
            return body

        return framed_stream(self._events(tally), usage)

    async def _collect_loop(self, loop: ToolLoop) -> dict[str, Any]:
        """One choice through the MCP loop: the text of every turn, the client's own
        calls of the last, and pippin's calls in `mcp_calls`."""
        parsed = ParsedDelta()
        mcp_calls: list[dict[str, Any]] = []
        async for ev in loop.events(whole=True):
            if isinstance(ev, CallFinished):
                mcp_calls.append(call_summary(ev.call))
                parsed.calls = []  # the next turn's calls are numbered anew
            elif not isinstance(ev, ParsedStep):
                continue
            else:
                d = ev.parsed
                parsed.merge(ParsedDelta(d.content, d.reasoning, self._client_calls(loop, d)))
        parser = self.new_parser(whole=True)
        msg = message_body(parsed, parser)
        if mcp_calls:
            msg["mcp_calls"] = mcp_calls
        reason = loop.finish_reason or "stop"
        if reason == "tool_calls" and "tool_calls" not in msg:
            reason = "stop"  # only pippin's calls were made: the model answered
        body = self.header("chat.completion")
        body["choices"] = [{"index": 0, "message": msg, "logprobs": None, "finish_reason": reason}]
        body["usage"] = usage_dict(loop.prompt_tokens, loop.completion_tokens, loop.cached_tokens)
        if self.metadata is not None:
            body["metadata"] = self.metadata
        return body

    def _client_calls(self, loop: ToolLoop, d: ParsedDelta) -> list[Any]:
        """The call deltas of the client's own tools (MCP calls are pippin's to run)."""
        out = []
        for c in d.calls:
            if c.name is not None:
                self._mcp_index[c.index] = loop.owns(c.name)
            if not self._mcp_index.get(c.index, False):
                out.append(c)
        return out

    async def _loop_events(self, loop: ToolLoop, tally: dict[str, int]) -> AsyncIterator[str]:
        first = {"role": "assistant", "content": ""}
        yield self._chunk([{"index": 0, "delta": first, "logprobs": None, "finish_reason": None}])
        client_called = False
        async for ev in loop.events():
            tally["prompt"], tally["cached"] = loop.prompt_tokens, loop.cached_tokens
            tally["completion"] = loop.completion_tokens
            if isinstance(ev, CallFinished):
                self._mcp_index.clear()  # the next turn numbers its calls anew
                delta = {"mcp_calls": [call_summary(ev.call)]}
                yield self._chunk(
                    [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
                )
                continue
            if not isinstance(ev, ParsedStep):
                continue
            d = ev.parsed
            calls = self._client_calls(loop, d)
            client_called = client_called or any(c.name is not None for c in calls)
            delta = delta_body(ParsedDelta(d.content, d.reasoning, calls))
            if delta:
                yield self._chunk(
                    [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]
                )
        reason = loop.finish_reason or "stop"
        if reason == "tool_calls" and not client_called:
            reason = "stop"
        yield self._chunk([{"index": 0, "delta": {}, "logprobs": None, "finish_reason": reason}])

    async def _events(self, tally: dict[str, int]) -> AsyncIterator[str]:
        if self.loop is not None:
            async for chunk in self._loop_events(self.loop, tally):
                yield chunk
            return
        parsers = [self.new_parser() for _ in range(self.params.n)]
        for i in range(self.params.n):
            first = {"role": "assistant", "content": ""}
            yield self._chunk(
                [{"index": i, "delta": first, "logprobs": None, "finish_reason": None}]
            )
        gen = self.engine.generate(self.prompt_ids, self.params, self.request_id)
        async with closing(gen) as outputs:
            async for out in outputs:
                tally["prompt"], tally["cached"] = out.prompt_tokens, out.cached_tokens
                choices = []
                finals = []
                for c in out.outputs:
                    tally["completion"] += len(c.token_ids)
                    failed = engine_failure(out, c)
                    if failed:
                        raise failed
                    parser = parsers[c.index]
                    parsed = parser.feed(c.text, c.token_ids)
                    if c.finish_reason is not None:
                        parsed.merge(parser.finish())
                    delta = delta_body(parsed)
                    lp = (
                        {"content": format_logprobs(c.logprobs, self.render), "refusal": None}
                        if c.logprobs
                        else None
                    )
                    if delta or lp is not None:
                        choices.append(
                            {
                                "index": c.index,
                                "delta": delta,
                                "logprobs": lp,
                                "finish_reason": None,
                            }
                        )
                    if c.finish_reason is not None:
                        # As OpenAI: the finish reason comes in a chunk of its own, with
                        # an empty delta, after the last text.
                        finals.append(
                            {
                                "index": c.index,
                                "delta": {},
                                "logprobs": None,
                                "finish_reason": finish_reason(c.finish_reason, parser),
                            }
                        )
                failed = engine_failure(out)
                if failed:
                    raise failed
                if choices:
                    yield self._chunk(choices)
                if finals:
                    yield self._chunk(finals)


@router.post(
    "/v1/chat/completions", response_model=None, **openai_route(ChatCompletionRequest, stream=True)
)
async def create_chat_completion(request: Request) -> Any:
    req = await parse_request(ChatCompletionRequest, await request.body())
    state = get_state(request)
    check_model(state, req.model)
    # Everything that can be refused without the model is refused first.
    reject_unsupported(req)
    media = MediaParts()
    messages = template_messages(req, media)
    tools = template_tools(req)
    client_tools = tools
    mcp = mcp_tools(req, state)  # the server's MCP servers, before the model is chosen
    if mcp is not None:
        mcp.check_clash(tools, "tools")
        tools = [*(tools or []), *mcp.functions()] or None
    state = await use_model(state, req.model)
    engine, loaded = require_engine(state)
    info = state.template
    assert info is not None and state.limits is not None
    verbosity = verbosity_kwargs(req.verbosity, state.template_source, "verbosity")
    kwargs = template_kwargs(req, state.settings.default_chat_template_kwargs, info.reasoning_kwarg)
    kwargs |= verbosity
    add_gen = (
        not req.continue_final_message
        if req.add_generation_prompt is None
        else req.add_generation_prompt
    )
    prompt_ids, mm = await render_media_prompt(
        state,
        loaded.tokenizer,
        messages,
        tools,
        kwargs,
        media,
        add_generation_prompt=add_gen,
        continue_final_message=bool(req.continue_final_message),
    )

    requested = (
        req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    )
    max_tokens = resolve_max_tokens(
        requested,
        len(prompt_ids),
        state.limits,
        state.defaults.get("max_tokens"),
        None,
        "messages",
        "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens",
    )
    params = build_sampling_params(
        req,
        max_tokens=max_tokens,
        limits=state.limits,
        defaults=state.defaults,
        logprobs=bool(req.logprobs),
        top_logprobs=req.top_logprobs or 0,
    )
    params.mm = mm
    assert state.grammars is not None
    new_parser, params = await output_parsing(
        state,
        loaded.tokenizer,
        prompt_ids,
        params,
        tools,
        req.thinking_token_budget,
        spec=chat_spec(req, state, state.grammars, tools),
        one_call=req.parallel_tool_calls is False,
    )
    try:
        engine.check(prompt_ids, params)
    except EngineError as exc:
        raise bad_request(str(exc), param="messages") from None

    run = ChatRun(
        engine=engine,
        prompt_ids=prompt_ids,
        params=params,
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        model=req.model,
        fingerprint=state.fingerprint,
        render=state.token_renderer,
        new_parser=new_parser,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        obfuscate=bool(req.stream_options and req.stream_options.include_obfuscation),
        # There is one tier; it is reported when asked about, as OpenAI does.
        service_tier="default" if req.service_tier is not None else None,
        metadata=req.metadata,
    )
    if mcp is not None:
        run.loop = request_loop(
            state,
            engine,
            loaded.tokenizer,
            run.request_id,
            messages,
            Turn(prompt_ids, params, new_parser),
            client_tools,
            mcp,
            kwargs,
            thinking_budget=req.thinking_token_budget,
            one_call=req.parallel_tool_calls is False,
            media=media,
        )
    if req.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream", headers=SSE_HEADERS)
    # JSONResponse directly: FastAPI's generic encoder is slow on big logprobs bodies.
    return JSONResponse(await cancel_on_disconnect(request.receive, run.collect()))
