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

from pippin.api.common import (
    SSE_HEADERS,
    cancel_on_disconnect,
    get_state,
    obfuscation,
    parse_request,
    sse,
)
from pippin.api.openai.mcp import call_summary, openai_mcp_tools
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
    sampling_of,
)
from pippin.api.openai.structured_output import chat_spec, forced_tool
from pippin.api.openapi import openai_route
from pippin.chat.output import OutputParser
from pippin.chat.tool_parsers.base import ParsedDelta, collect_calls
from pippin.engine.types import TokenLogprob
from pippin.serving.errors import bad_request, unsupported_param, unsupported_value
from pippin.serving.job import ChatJob, PreparedJob, prepare
from pippin.serving.live_model import LiveModel
from pippin.serving.logprobs import TokenRenderer, prompt_logprobs_body, token_logprobs
from pippin.serving.media import MediaParts
from pippin.serving.pipeline import (
    ParsedStep,
    arguments_for_template,
    effort_kwargs,
    verbosity_kwargs,
)
from pippin.serving.state import ServerState, check_model, use_model
from pippin.serving.streams import closing
from pippin.serving.tool_loop import CallFinished, McpTools, ToolLoop, every_server_tools

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


def mcp_tools(req: ChatCompletionRequest, state: ServerState) -> McpTools | None:
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


def template_kwargs(req: ChatCompletionRequest, live: LiveModel) -> dict[str, Any]:
    """The template's arguments the request asks for: its own, reasoning effort, verbosity."""
    verbosity = verbosity_kwargs(req.verbosity, live.template_source, "verbosity")
    kwargs = dict(req.chat_template_kwargs or {})
    if req.reasoning_effort is not None:
        assert live.template is not None
        kwargs |= effort_kwargs(
            req.reasoning_effort, live.template.reasoning_kwarg, "reasoning_effort"
        )
    return kwargs | verbosity


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
    if req.prompt_logprobs is not None and req.stream:
        # As vLLM: they come only in the whole response.
        raise bad_request(
            "'prompt_logprobs' is not available when 'stream' is true.", param="prompt_logprobs"
        )
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


def usage_dict(prompt_tokens: int, completion_tokens: int, cached: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


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


def chat_job(req: ChatCompletionRequest, server: ServerState) -> ChatJob:
    """The request as the one chat job; what can be refused without the model is."""
    reject_unsupported(req)
    media = MediaParts()
    messages = template_messages(req, media)
    tools = template_tools(req)
    return ChatJob(
        model=req.model,
        request_id=f"chatcmpl-{uuid.uuid4().hex}",
        messages=messages,
        media=media,
        tools=tools,
        mcp=mcp_tools(req, server),  # the server's MCP servers, before the model is chosen
        sampling=sampling_of(req, bool(req.logprobs), req.top_logprobs or 0),
        max_tokens=(
            req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        ),
        max_tokens_param=(
            "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        ),
        add_generation_prompt=(
            not req.continue_final_message
            if req.add_generation_prompt is None
            else req.add_generation_prompt
        ),
        continue_final_message=bool(req.continue_final_message),
        thinking_budget=req.thinking_token_budget,
        one_call=req.parallel_tool_calls is False,
        template_kwargs=lambda live: template_kwargs(req, live),
        output_spec=lambda live, offered: chat_spec(req, live, offered),
        truncate_prompt_tokens=req.truncate_prompt_tokens,
    )


@dataclass
class ChatRun:
    """A prepared chat request, answered whole or streamed."""

    prepared: PreparedJob
    model: str
    fingerprint: str
    render: TokenRenderer
    include_usage: bool = False
    obfuscate: bool = False
    service_tier: str | None = None
    metadata: dict[str, str] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _mcp_index: dict[int, bool] = field(default_factory=dict)  # call index -> MCP's

    @property
    def loop(self) -> ToolLoop:
        return self.prepared.loop

    @property
    def n(self) -> int:
        return self.prepared.params.n

    def header(self, obj: str) -> dict[str, Any]:
        head = {
            "id": self.prepared.job.request_id,
            "object": obj,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": self.fingerprint,
        }
        if self.service_tier is not None:
            head["service_tier"] = self.service_tier
        return head

    def _usage(self) -> dict[str, Any]:
        loop = self.loop
        prompt = loop.prompt_tokens or len(self.prepared.prompt_ids)
        return usage_dict(prompt, loop.completion_tokens, loop.cached_tokens)

    def _client_calls(self, d: ParsedDelta) -> list[Any]:
        """The call deltas of the client's own tools (MCP calls are pippin's to run)."""
        out = []
        for c in d.calls:
            if c.name is not None:
                self._mcp_index[c.index] = self.loop.owns(c.name)
            if not self._mcp_index.get(c.index, False):
                out.append(c)
        return out

    def _reason(self, reason: str | None, client_called: bool) -> str:
        """A choice's finish reason: its last step's, or with MCP tools the loop's (whose
        last turn may be cut off); calls of pippin's tools alone do not make it
        "tool_calls", the model answered after them."""
        if self.loop.tools is not None:
            reason = self.loop.finish_reason
        reason = reason or "stop"
        return "stop" if reason == "tool_calls" and not client_called else reason

    async def collect(self) -> dict[str, Any]:
        parsed = [ParsedDelta() for _ in range(self.n)]
        logprobs: list[list[dict[str, Any]]] = [[] for _ in range(self.n)]
        reasons: list[str | None] = [None] * self.n
        called = [False] * self.n
        mcp_calls: list[dict[str, Any]] = []
        prompt_lps: list[TokenLogprob | None] | None = None
        async with closing(self.loop.events(whole=True)) as events:
            async for ev in events:
                if isinstance(ev, CallFinished):
                    mcp_calls.append(call_summary(ev.call))
                    self._mcp_index.clear()  # the next turn numbers its calls anew
                    parsed[0].calls = []
                if not isinstance(ev, ParsedStep):
                    continue
                i, d = ev.output.index, ev.parsed
                prompt_lps = prompt_lps or ev.prompt_logprobs  # the first turn's prompt
                calls = self._client_calls(d)
                called[i] = called[i] or any(c.name is not None for c in calls)
                parsed[i].merge(ParsedDelta(d.content, d.reasoning, calls))
                if ev.output.logprobs:
                    logprobs[i].extend(token_logprobs(ev.output.logprobs, self.render))
                reasons[i] = ev.finish_reason or reasons[i]
        parser = self.prepared.new_parser(whole=True)  # what its messages show
        choices = []
        for i in range(self.n):
            msg = message_body(parsed[i], parser)
            if mcp_calls and i == 0:
                msg["mcp_calls"] = mcp_calls
            choices.append(
                {
                    "index": i,
                    "message": msg,
                    "logprobs": {"content": logprobs[i], "refusal": None}
                    if self.prepared.params.logprobs
                    else None,
                    "finish_reason": self._reason(reasons[i], called[i]),
                }
            )
        body = self.header("chat.completion")
        body["choices"] = choices
        body["usage"] = self._usage()
        if self.prepared.params.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_body(prompt_lps or [], self.render)
        if self.metadata is not None:
            body["metadata"] = self.metadata
        return body

    def _chunk(self, index: int, delta: dict[str, Any], **fields: Any) -> str:
        body = self.header("chat.completion.chunk")
        choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}
        body["choices"] = [choice | fields]
        if self.include_usage:
            body["usage"] = None  # as OpenAI: null on every chunk but the last
        if self.obfuscate:
            body["obfuscation"] = obfuscation()
        return sse(body)

    def stream(self) -> AsyncIterator[str]:
        def usage() -> dict[str, Any] | None:
            if not self.include_usage:
                return None
            body = self.header("chat.completion.chunk")
            body["choices"] = []
            body["usage"] = self._usage()
            return body

        return framed_stream(self._events(), usage)

    async def _events(self) -> AsyncIterator[str]:
        for i in range(self.n):
            yield self._chunk(i, {"role": "assistant", "content": ""})
        called = [False] * self.n
        async with closing(self.loop.events()) as events:
            async for ev in events:
                if isinstance(ev, CallFinished):
                    self._mcp_index.clear()  # the next turn numbers its calls anew
                    yield self._chunk(0, {"mcp_calls": [call_summary(ev.call)]})
                if not isinstance(ev, ParsedStep):
                    continue
                i, d = ev.output.index, ev.parsed
                calls = self._client_calls(d)
                called[i] = called[i] or any(c.name is not None for c in calls)
                delta = delta_body(ParsedDelta(d.content, d.reasoning, calls))
                lps = ev.output.logprobs
                lp = {"content": token_logprobs(lps, self.render), "refusal": None} if lps else None
                if delta or lp is not None:
                    yield self._chunk(i, delta, logprobs=lp)
                if ev.finish_reason is not None and self.loop.tools is None:
                    # As OpenAI: the finish reason comes in a chunk of its own, with an
                    # empty delta, after the last text.
                    reason = self._reason(ev.finish_reason, called[i])
                    yield self._chunk(i, {}, finish_reason=reason)
        if self.loop.tools is not None:
            yield self._chunk(0, {}, finish_reason=self._reason(None, called[0]))


@router.post(
    "/v1/chat/completions", response_model=None, **openai_route(ChatCompletionRequest, stream=True)
)
async def create_chat_completion(request: Request) -> Any:
    req = await parse_request(ChatCompletionRequest, await request.body())
    server = get_state(request)
    check_model(server, req.model)
    job = chat_job(req, server)
    live = await use_model(server, req.model)
    run = ChatRun(
        await prepare(live, job),
        model=req.model,
        fingerprint=live.fingerprint,
        render=live.token_renderer,
        include_usage=bool(req.stream_options and req.stream_options.include_usage),
        obfuscate=bool(req.stream_options and req.stream_options.include_obfuscation),
        # There is one tier; it is reported when asked about, as OpenAI does.
        service_tier="default" if req.service_tier is not None else None,
        metadata=req.metadata,
    )
    if req.stream:
        return StreamingResponse(run.stream(), media_type="text/event-stream", headers=SSE_HEADERS)
    # JSONResponse directly: FastAPI's generic encoder is slow on big logprobs bodies.
    return JSONResponse(await cancel_on_disconnect(request.receive, run.collect()))
