"""Wire format of the OpenAI chat and (legacy) completions requests.

The models list every field of the official API reference plus the vLLM extensions
clients send. Unknown fields are refused (``extra="forbid"``) and types are strict
(``"5"`` is not an integer), so nothing is silently coerced or ignored. Fields that are
parsed here but not supported are refused by the handlers with a 400 naming them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import fields
from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, Tag

from pippin.api.common import Loose, StopSequences, Strict, by_tag, sse
from pippin.api.errors import openai_body
from pippin.serving.errors import ApiError
from pippin.serving.sampling import Sampling
from pippin.serving.streams import guarded

# --- message content parts ---------------------------------------------------


class CacheBreakpoint(Strict):
    mode: Literal["explicit"]
    ttl: Literal["30m", "12h"] | None = None


class TextPart(Strict):
    type: Literal["text"]
    text: str
    # Prefix caching is automatic for every prompt, so breakpoints are always served.
    prompt_cache_breakpoint: CacheBreakpoint | None = None


class RefusalPart(Strict):
    type: Literal["refusal"]
    refusal: str


class ImageURL(Strict):
    url: str
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(Strict):
    type: Literal["image_url"]
    image_url: ImageURL


class VideoURL(Strict):
    url: str


class VideoPart(Strict):
    """vLLM's extension: a video, sampled into frames that the model sees as images."""

    type: Literal["video_url"]
    video_url: VideoURL


class InputAudio(Strict):
    data: str  # base64
    format: Literal["wav", "mp3"]


class AudioPart(Strict):
    """Parsed in full so a malformed part names its field; refused by every model served
    today (no audio-language model runs in the engine yet: docs/architecture.md)."""

    type: Literal["input_audio"]
    input_audio: InputAudio


class FilePart(Loose):
    type: Literal["file"]


UserPart = Annotated[
    Annotated[TextPart, Tag("@text")]
    | Annotated[ImagePart, Tag("@image_url")]
    | Annotated[VideoPart, Tag("@video_url")]
    | Annotated[AudioPart, Tag("@input_audio")]
    | Annotated[FilePart, Tag("@file")],
    by_tag("type", "text", "image_url", "video_url", "input_audio", "file"),
]
AssistantPart = Annotated[
    Annotated[TextPart, Tag("@text")] | Annotated[RefusalPart, Tag("@refusal")],
    by_tag("type", "text", "refusal"),
]

# --- messages ----------------------------------------------------------------


class FunctionCallData(Strict):
    name: str
    arguments: str


class ToolCallData(Strict):
    id: str
    type: Literal["function"]
    function: FunctionCallData


class SystemMessage(Strict):
    role: Literal["system"]
    content: str | list[TextPart]
    name: str | None = None


class DeveloperMessage(Strict):
    role: Literal["developer"]
    content: str | list[TextPart]
    name: str | None = None


class UserMessage(Strict):
    role: Literal["user"]
    content: str | list[UserPart]
    name: str | None = None


class AssistantMessage(Strict):
    role: Literal["assistant"]
    content: str | list[AssistantPart] | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCallData] | None = None
    function_call: FunctionCallData | None = None
    audio: dict[str, Any] | None = None
    # Not in OpenAI's reference, but sent back by clients of reasoning models
    # (vLLM, DeepSeek); chat templates may render it.
    reasoning_content: str | None = None
    reasoning: str | None = None


class ToolMessage(Strict):
    role: Literal["tool"]
    content: str | list[TextPart]
    tool_call_id: str


class FunctionMessage(Strict):
    role: Literal["function"]
    content: str | None
    name: str


Message = Annotated[
    Annotated[SystemMessage, Tag("@system")]
    | Annotated[DeveloperMessage, Tag("@developer")]
    | Annotated[UserMessage, Tag("@user")]
    | Annotated[AssistantMessage, Tag("@assistant")]
    | Annotated[ToolMessage, Tag("@tool")]
    | Annotated[FunctionMessage, Tag("@function")],
    by_tag("role", "system", "developer", "user", "assistant", "tool", "function"),
]

# --- tools and formats -------------------------------------------------------


class FunctionDef(Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class FunctionTool(Strict):
    type: Literal["function"]
    function: FunctionDef


class CustomTool(Loose):
    type: Literal["custom"]


class McpToolFilter(Strict):
    tool_names: list[str] | None = None
    read_only: bool | None = None


class McpApprovalFilter(Strict):
    always: McpToolFilter | None = None
    never: McpToolFilter | None = None


class McpTool(Strict):
    """An MCP server's tools, run by pippin: the Responses API's `mcp` tool, also taken in
    chat completions' `tools` (a pippin extension). The server must be configured
    (`--mcp-config`): named by `server_label`, or by `server_url`."""

    type: Literal["mcp"]
    server_label: str
    server_url: str | None = None
    server_description: str | None = None
    allowed_tools: list[str] | McpToolFilter | None = None
    require_approval: Literal["always", "never"] | McpApprovalFilter | None = None
    headers: dict[str, str] | None = None
    authorization: str | None = None
    # Parsed to be refused by name: OpenAI's connectors and tunnels do not exist here.
    connector_id: str | None = None
    tunnel_id: str | None = None
    defer_loading: bool | None = None
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None


Tool = Annotated[
    Annotated[FunctionTool, Tag("@function")]
    | Annotated[CustomTool, Tag("@custom")]
    | Annotated[McpTool, Tag("@mcp")],
    by_tag("type", "function", "custom", "mcp"),
]


class ResponseFormatText(Strict):
    type: Literal["text"]


class ResponseFormatOther(Loose):
    type: Literal["json_object", "json_schema"]


ResponseFormat = Annotated[
    Annotated[ResponseFormatText, Tag("@text")]
    | Annotated[ResponseFormatOther, Tag("@json_object")]
    | Annotated[ResponseFormatOther, Tag("@json_schema")],
    by_tag("type", "text", "json_object", "json_schema"),
]


class StreamOptions(Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None


class PromptCacheOptions(Strict):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m"] | None = None


# --- requests ----------------------------------------------------------------


class SamplingFields(Strict):
    """Fields shared by chat and completions requests."""

    model: str
    n: int | None = Field(None, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: str | StopSequences | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions.
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    min_tokens: int | None = Field(None, ge=0)
    skip_special_tokens: bool | None = None
    # Each prompt token's logprob, with this many alternatives (not when streaming).
    prompt_logprobs: int | None = Field(None, ge=0, le=20)
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # Keep the prompt's last N tokens; -1: as many as the context holds.
    truncate_prompt_tokens: int | None = Field(None, ge=-1)
    # vLLM's structured output fields (one of them; see api/structured_output.py).
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None
    # Requests with different salts never share cached KV (multi-tenant isolation).
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM's: the order under --scheduling-policy priority (lower first); else only 0.
    priority: int | None = Field(None, ge=-(2**63), le=2**63 - 1)


def sampling_of(req: SamplingFields, logprobs: bool = False, top_logprobs: int = 0) -> Sampling:
    """The request's sampling fields in no API's shape."""
    return Sampling(
        **{f.name: getattr(req, f.name) for f in fields(Sampling) if hasattr(req, f.name)}
        | {"logprobs": logprobs, "top_logprobs": top_logprobs}
    )


class ChatCompletionRequest(SamplingFields):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[FunctionDef] | None = None
    function_call: Literal["none", "auto"] | dict[str, Any] | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    store: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast"] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = (
        None
    )
    verbosity: Literal["low", "medium", "high"] | None = None
    web_search_options: dict[str, Any] | None = None
    moderation: dict[str, Any] | None = None
    safety_identifier: str | None = Field(None, max_length=128)
    prompt_cache_key: str | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    # vLLM extensions.
    chat_template_kwargs: dict[str, Any] | None = None
    # Reasoning tokens after which the model's reasoning section is closed for it.
    thinking_token_budget: int | None = Field(None, ge=0)
    add_generation_prompt: bool | None = None
    continue_final_message: bool | None = None


PromptInput = Union[str, list[str], list[int], list[list[int]]]  # noqa: UP007


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = Field(None, ge=0)
    best_of: int | None = Field(None, ge=1, le=128)
    echo: bool | None = None
    logprobs: int | None = Field(None, ge=0, le=5)
    suffix: str | None = None
    # vLLM extension: add the tokenizer's BOS etc. to string prompts.
    add_special_tokens: bool | None = None


class EmbeddingRequest(Strict):
    model: str
    input: PromptInput
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None


class RerankDocument(BaseModel):
    """A document given as an object (Cohere v1): ranked by ``text``; its other keys are
    the client's own and come back unchanged with ``return_documents``."""

    model_config = ConfigDict(extra="allow", strict=True)
    text: str


class RerankRequest(Strict):
    """Cohere (v1 and v2), Jina and vLLM rerank requests."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = Field(None, ge=1)
    return_documents: bool | None = None
    max_tokens_per_doc: int | None = Field(None, ge=1)
    rank_fields: list[str] | None = None
    max_chunks_per_doc: int | None = None


# --- response side -----------------------------------------------------------


async def framed_stream(
    events: AsyncIterator[str], usage_chunk: Callable[[], dict[str, Any] | None]
) -> AsyncIterator[str]:
    """`events`, then the end every OpenAI stream has: an error event if it failed (the
    status, 200, is already sent), else the usage chunk when one was asked for; then
    [DONE]."""
    failed = False

    def error_event(err: ApiError) -> str:
        nonlocal failed
        failed = True
        return sse(openai_body(err))

    async for event in guarded(events, error_event):
        yield event
    if not failed:
        usage = usage_chunk()
        if usage is not None:
            yield sse(usage)
    yield sse("[DONE]")
