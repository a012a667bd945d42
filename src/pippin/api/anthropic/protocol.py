"""Wire format of Anthropic's Messages API requests (`/v1/messages`, `count_tokens`).

Every field of the API reference is modelled; unknown fields are refused, as Anthropic
does ("Extra inputs are not permitted"), with a 400 that names them. Fields that are
parsed but not supported are refused by the handler.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from pippin.api.common import StopSequences, by_tag


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[dict[str, Any]] | None = None


class ImageBlock(_Strict):
    type: Literal["image"]
    source: dict[str, Any]
    cache_control: CacheControl | None = None


class DocumentBlock(_Strict):
    type: Literal["document"]
    source: dict[str, Any]
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None
    cache_control: CacheControl | None = None


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None
    # Programmatic tool calling: who made the call, and the toolset of the tool.
    caller: dict[str, Any] | None = None
    toolset_name: str | None = None


class ToolReferenceBlock(_Strict):
    """A client-side tool search's answer, in a tool result: loads that deferred tool."""

    type: Literal["tool_reference"]
    tool_name: str
    cache_control: CacheControl | None = None


ToolResultPart = TextBlock | ImageBlock | DocumentBlock | ToolReferenceBlock


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[Annotated[ToolResultPart, Field()]] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None
    toolset_name: str | None = None


class McpToolUseBlock(_Strict):
    """A call pippin made to an MCP server's tool (sent back in a later turn)."""

    type: Literal["mcp_tool_use"]
    id: str
    name: str
    server_name: str
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class McpToolResultBlock(_Strict):
    type: Literal["mcp_tool_result"]
    tool_use_id: str
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Strict):
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None


class RedactedThinkingBlock(_Strict):
    type: Literal["redacted_thinking"]
    data: str


class OtherBlock(BaseModel):
    """Server-tool and search blocks: parsed only to be refused by name."""

    model_config = ConfigDict(extra="allow")
    type: str


ContentBlock = Annotated[
    Union[  # noqa: UP007
        Annotated[TextBlock, Tag("@text")],
        Annotated[ImageBlock, Tag("@image")],
        Annotated[DocumentBlock, Tag("@document")],
        Annotated[ToolUseBlock, Tag("@tool_use")],
        Annotated[ToolResultBlock, Tag("@tool_result")],
        Annotated[ThinkingBlock, Tag("@thinking")],
        Annotated[RedactedThinkingBlock, Tag("@redacted_thinking")],
        Annotated[McpToolUseBlock, Tag("@mcp_tool_use")],
        Annotated[McpToolResultBlock, Tag("@mcp_tool_result")],
    ],
    by_tag(
        "type",
        "text",
        "image",
        "document",
        "tool_use",
        "tool_result",
        "thinking",
        "redacted_thinking",
        "mcp_tool_use",
        "mcp_tool_result",
    ),
]


class OutputConfig(_Strict):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: dict[str, Any] | None = None


class InputMessage(_Strict):
    # "system": instructions in the middle of a conversation (Claude Code sends them).
    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]
    # Per-turn control: the effort for the turns that follow (advisory, as effort is).
    output_config: OutputConfig | None = None


class Tool(_Strict):
    name: str = Field(min_length=1, max_length=128, pattern=r"^[a-zA-Z0-9_-]{1,128}$")
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: CacheControl | None = None
    strict: bool | None = None
    # Tool search: a deferred tool is hidden from the model until a tool result's
    # `tool_reference` block names it (see messages.template_tools).
    defer_loading: bool | None = None
    # Programmatic calling: the tool is shown to the model as usual.
    input_examples: list[dict[str, Any]] | None = None
    allowed_callers: list[str] | None = None
    eager_input_streaming: bool | None = None


class ServerTool(BaseModel):
    """Anthropic-hosted tools (bash, text editor, web search, ...): refused by name."""

    model_config = ConfigDict(extra="allow")
    type: str
    name: str | None = None


def _tool_kind(v: Any) -> str:
    t = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return "@custom" if t in (None, "custom") else "@server"


AnyTool = Annotated[
    Union[Annotated[Tool, Tag("@custom")], Annotated[ServerTool, Tag("@server")]],  # noqa: UP007
    Discriminator(_tool_kind),
]


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingEnabled(_Strict):
    type: Literal["enabled"]
    budget_tokens: int = Field(ge=1)
    display: Literal["summarized", "omitted"] | None = None


class ThinkingDisabled(_Strict):
    type: Literal["disabled"]


class ThinkingAdaptive(_Strict):
    type: Literal["adaptive"]
    display: Literal["summarized", "omitted"] | None = None


class ThinkingBetweenTools(_Strict):
    type: Literal["between_tools"]


Thinking = Annotated[
    Union[  # noqa: UP007
        Annotated[ThinkingEnabled, Tag("@enabled")],
        Annotated[ThinkingDisabled, Tag("@disabled")],
        Annotated[ThinkingAdaptive, Tag("@adaptive")],
        Annotated[ThinkingBetweenTools, Tag("@between_tools")],
    ],
    by_tag("type", "enabled", "disabled", "adaptive", "between_tools"),
]


class ThinkingTurns(_Strict):
    type: Literal["thinking_turns"]
    value: int = Field(ge=0)


class ClearThinking(_Strict):
    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | ThinkingTurns | None = None


class InputTokens(_Strict):
    type: Literal["input_tokens"]
    value: int = Field(ge=1)


class ToolUses(_Strict):
    type: Literal["tool_uses"]
    value: int = Field(ge=0)


class ClearToolUses(_Strict):
    type: Literal["clear_tool_uses_20250919"]
    trigger: InputTokens | ToolUses | None = None
    keep: ToolUses | None = None
    clear_at_least: InputTokens | None = None
    exclude_tools: list[str] | None = None
    clear_tool_inputs: bool | list[str] | None = None


ContextEdit = Annotated[
    Union[  # noqa: UP007
        Annotated[ClearThinking, Tag("@clear_thinking_20251015")],
        Annotated[ClearToolUses, Tag("@clear_tool_uses_20250919")],
    ],
    by_tag("type", "clear_thinking_20251015", "clear_tool_uses_20250919"),
]


class ContextManagement(_Strict):
    edits: list[ContextEdit] = Field(default_factory=list)


class Diagnostics(_Strict):
    previous_message_id: str | None = None


class McpToolConfiguration(_Strict):
    enabled: bool | None = None
    allowed_tools: list[str] | None = None


class McpServerDef(_Strict):
    """`mcp_servers[]` (the mcp-client beta): a server pippin runs tools on for the model.
    It must be one of `--mcp-config`'s: named by `name`, or by `url`."""

    type: Literal["url"]
    url: str
    name: str
    authorization_token: str | None = None
    tool_configuration: McpToolConfiguration | None = None


class Metadata(_Strict):
    user_id: str | None = Field(None, max_length=512)


class MessagesRequest(_Strict):
    model: str
    messages: list[InputMessage]
    max_tokens: int = Field(ge=1)
    system: str | list[TextBlock] | None = None
    metadata: Metadata | None = None
    stop_sequences: StopSequences | None = None
    stream: bool | None = None
    temperature: float | None = Field(None, ge=0.0, le=1.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    top_k: int | None = Field(None, ge=0)
    tools: list[AnyTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    # Prompt caching is automatic here (the prefix cache); the marker is accepted.
    cache_control: CacheControl | None = None
    speed: Literal["standard", "fast"] | None = None
    inference_geo: str | None = None
    diagnostics: Diagnostics | None = None
    user_profile_id: str | None = None
    workspace_id: str | None = None
    # Parsed so they can be refused by name.
    container: Any = None
    mcp_servers: list[McpServerDef] | None = None
    context_management: ContextManagement | None = None
    output_format: dict[str, Any] | None = None


class CountTokensRequest(_Strict):
    model: str
    messages: list[InputMessage]
    system: str | list[TextBlock] | None = None
    tools: list[AnyTool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None
    mcp_servers: list[McpServerDef] | None = None
    context_management: ContextManagement | None = None
    output_format: dict[str, Any] | None = None
