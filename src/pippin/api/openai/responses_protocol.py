"""Wire format of OpenAI Responses requests (`POST /v1/responses`).

Every field of the API reference (the `openai` SDK's `response_create_params.py`) is
parsed here; unknown fields are refused (``extra="forbid"``) and types are strict.
Input items and tools of kinds pippin cannot run (built-in tools and their calls) are
parsed loosely, only so that the handler can refuse them by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag

from pippin.api.common import Loose, Strict, by_tag
from pippin.api.openai.protocol import CacheBreakpoint, McpTool

ItemStatus = Literal["in_progress", "completed", "incomplete"]
Effort = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]

# --- content parts -----------------------------------------------------------


class InputText(Strict):
    type: Literal["input_text"]
    text: str
    prompt_cache_breakpoint: CacheBreakpoint | None = None


class OutputText(Strict):
    type: Literal["output_text"]
    text: str
    # Sent back as we wrote them; nothing in them reaches the model.
    annotations: list[dict[str, Any]] | None = None
    logprobs: list[dict[str, Any]] | None = None


class Refusal(Strict):
    type: Literal["refusal"]
    refusal: str


class InputImage(Strict):
    type: Literal["input_image"]
    image_url: str | None = None
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None


class InputFile(Loose):
    type: Literal["input_file"]


class InputAudio(Loose):
    type: Literal["input_audio"]


ContentPart = Annotated[
    Annotated[InputText, Tag("@input_text")]
    | Annotated[OutputText, Tag("@output_text")]
    | Annotated[Refusal, Tag("@refusal")]
    | Annotated[InputImage, Tag("@input_image")]
    | Annotated[InputFile, Tag("@input_file")]
    | Annotated[InputAudio, Tag("@input_audio")],
    by_tag(
        "type", "input_text", "output_text", "refusal", "input_image", "input_file", "input_audio"
    ),
]

# --- input items -------------------------------------------------------------


class MessageItem(Strict):
    """An easy input message, an input message, or an assistant output message sent back."""

    type: Literal["message"] | None = None
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None
    phase: Literal["commentary", "final_answer"] | None = None


class FunctionCallItem(Strict):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str
    id: str | None = None
    status: ItemStatus | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None
    # `async` on the wire: the call ran in the background of a program.
    async_: bool | None = Field(None, alias="async")


class FunctionCallOutputItem(Strict):
    type: Literal["function_call_output"]
    call_id: str
    output: str | list[ContentPart]
    id: str | None = None
    status: ItemStatus | None = None
    name: str | None = None
    namespace: str | None = None
    caller: dict[str, Any] | None = None


class SummaryText(Strict):
    type: Literal["summary_text"]
    text: str


class ReasoningText(Strict):
    type: Literal["reasoning_text"]
    text: str


class ReasoningItem(Strict):
    type: Literal["reasoning"]
    id: str | None = None
    summary: list[SummaryText] = Field(default_factory=list)
    content: list[ReasoningText] | None = None
    encrypted_content: str | None = None
    status: ItemStatus | None = None


class ItemReference(Strict):
    type: Literal["item_reference"] | None = None
    id: str


class McpListToolsItem(Strict):
    type: Literal["mcp_list_tools"]
    server_label: str
    tools: list[dict[str, Any]]
    id: str | None = None
    error: str | dict[str, Any] | None = None


class McpApprovalRequestItem(Strict):
    type: Literal["mcp_approval_request"]
    id: str
    server_label: str
    name: str
    arguments: str


class McpApprovalResponseItem(Strict):
    type: Literal["mcp_approval_response"]
    approval_request_id: str
    approve: bool
    id: str | None = None
    reason: str | None = None


class McpCallItem(Strict):
    type: Literal["mcp_call"]
    id: str
    server_label: str
    name: str
    arguments: str
    output: str | None = None
    error: str | dict[str, Any] | None = None
    approval_request_id: str | None = None
    status: Literal["in_progress", "completed", "incomplete", "calling", "failed"] | None = None


class OtherItem(Loose):
    """Calls of built-in tools and their outputs: refused by the handler."""

    type: str


# Item types of the API reference that pippin parses only to refuse.
UNSUPPORTED_ITEM_TYPES = (
    "file_search_call",
    "computer_call",
    "computer_call_output",
    "web_search_call",
    "tool_search_call",
    "tool_search_output",
    "additional_tools",
    "configuration_update",
    "compaction",
    "compaction_trigger",
    "image_generation_call",
    "code_interpreter_call",
    "local_shell_call",
    "local_shell_call_output",
    "shell_call",
    "shell_call_output",
    "apply_patch_call",
    "apply_patch_call_output",
    "custom_tool_call",
    "custom_tool_call_output",
    "program",
    "program_output",
)
_ITEM_TYPES = (
    "message",
    "function_call",
    "function_call_output",
    "reasoning",
    "item_reference",
    "mcp_list_tools",
    "mcp_approval_request",
    "mcp_approval_response",
    "mcp_call",
    *UNSUPPORTED_ITEM_TYPES,
)


def _item_tag(v: Any) -> str | None:
    """`type` picks the item; without one, a `role` makes a message, an `id` a reference."""
    get = v.get if isinstance(v, dict) else lambda k: getattr(v, k, None)
    kind = get("type")
    if kind is None:
        kind = "message" if get("role") is not None else "item_reference" if get("id") else None
    if kind in UNSUPPORTED_ITEM_TYPES:
        return "@other"
    return f"@{kind}" if isinstance(kind, str) else None


InputItem = Annotated[
    Annotated[MessageItem, Tag("@message")]
    | Annotated[FunctionCallItem, Tag("@function_call")]
    | Annotated[FunctionCallOutputItem, Tag("@function_call_output")]
    | Annotated[ReasoningItem, Tag("@reasoning")]
    | Annotated[ItemReference, Tag("@item_reference")]
    | Annotated[McpListToolsItem, Tag("@mcp_list_tools")]
    | Annotated[McpApprovalRequestItem, Tag("@mcp_approval_request")]
    | Annotated[McpApprovalResponseItem, Tag("@mcp_approval_response")]
    | Annotated[McpCallItem, Tag("@mcp_call")]
    | Annotated[OtherItem, Tag("@other")],
    Discriminator(
        _item_tag,
        custom_error_type="invalid_tag_type",
        custom_error_message="'type' must be one of " + ", ".join(f"'{t}'" for t in _ITEM_TYPES),
    ),
]

# --- tools -------------------------------------------------------------------


class FunctionTool(Strict):
    type: Literal["function"]
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    allowed_callers: list[Literal["direct", "programmatic"]] | None = None
    defer_loading: bool | None = None
    output_schema: dict[str, Any] | None = None


class NamespaceTool(Strict):
    """A named group of function tools (the Codex CLI sends its sub-agent tools so)."""

    type: Literal["namespace"]
    name: str
    description: str | None = None
    tools: list[FunctionTool]


class BuiltinTool(Loose):
    """A tool that runs on OpenAI's side: refused by the handler, by type."""

    type: str


BUILTIN_TOOL_TYPES = (
    "file_search",
    "computer",
    "computer_use_preview",
    "web_search",
    "web_search_2025_08_26",
    "web_search_preview",
    "web_search_preview_2025_03_11",
    "code_interpreter",
    "programmatic_tool_calling",
    "image_generation",
    "local_shell",
    "shell",
    "custom",
    "tool_search",
    "apply_patch",
)


def _tool_tag(v: Any) -> str | None:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    if not isinstance(kind, str):  # a dict or list is no key (and no tool type)
        return None
    if kind in BUILTIN_TOOL_TYPES:
        return "@builtin"
    return {"function": "@function", "namespace": "@namespace", "mcp": "@mcp"}.get(kind)


ResponsesTool = Annotated[
    Annotated[FunctionTool, Tag("@function")]
    | Annotated[NamespaceTool, Tag("@namespace")]
    | Annotated[McpTool, Tag("@mcp")]
    | Annotated[BuiltinTool, Tag("@builtin")],
    Discriminator(
        _tool_tag,
        custom_error_type="invalid_tag_type",
        custom_error_message="'type' must be one of "
        + ", ".join(f"'{t}'" for t in ("function", "namespace", "mcp", *BUILTIN_TOOL_TYPES)),
    ),
]

# --- other settings ----------------------------------------------------------


class TextFormat(Loose):
    """`text`, `json_schema` (name, schema, strict at this level) or `json_object`."""

    type: Literal["text", "json_schema", "json_object"]


class TextConfig(Strict):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(Strict):
    effort: Effort | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None
    generate_summary: Literal["auto", "concise", "detailed"] | None = None
    context: Literal["auto", "current_turn", "all_turns"] | None = None
    mode: str | None = None


class StreamOptions(Strict):
    include_obfuscation: bool | None = None


class ResponsesPromptCacheOptions(Strict):
    mode: Literal["implicit", "explicit"] | None = None
    ttl: Literal["30m", "12h"] | None = None
    comparison_response_id: str | None = None
    prewarm: bool | None = None


Includable = Literal[
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
    "reasoning.encrypted_content",
    "message.output_text.logprobs",
]


class ResponsesRequest(Strict):
    model: str
    input: str | list[InputItem] | None = None
    instructions: str | None = None
    tools: list[ResponsesTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    max_tool_calls: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, ge=0, le=1)
    top_logprobs: int | None = Field(None, ge=0, le=20)
    store: bool | None = None
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    # Codex CLI's client identification (installation and session ids); not used here.
    client_metadata: dict[str, Any] | None = None
    user: str | None = None
    safety_identifier: str | None = Field(None, max_length=128)
    truncation: Literal["auto", "disabled"] | None = None
    include: list[Includable] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    service_tier: (
        Literal["auto", "default", "flex", "scale", "priority", "fast", "ultrafast"] | None
    ) = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: ResponsesPromptCacheOptions | None = None
    # vLLM's: the order under --scheduling-policy priority (lower first); else only 0.
    priority: int | None = Field(None, ge=-(2**63), le=2**63 - 1)
    # Parsed to be refused by name (see `reject_unsupported` in openai_responses).
    background: bool | None = None
    background_options: dict[str, Any] | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    context_management: list[dict[str, Any]] | None = None
    moderation: dict[str, Any] | None = None
    access_programs: dict[str, Any] | None = None
    image: dict[str, Any] | None = None
