"""The MCP tool loop, one for the three chat-shaped APIs.

A request that enables MCP tools (Responses `mcp` tools, Anthropic `mcp_servers`, chat
`mcp` tools or `--mcp-auto`) gets an `McpTools`: the tools offered, by name, each with its
server. `ToolLoop` then runs turns: it generates, and when the model's calls are all MCP
calls it runs them (`--mcp-call-timeout` each), appends the calls and their results to the
conversation and generates again, up to `--mcp-max-calls` calls; after that the MCP tools
are no longer shown and the model answers. A call of a client's function tool ends the
loop (the client runs it), as does a call that needs the client's approval.

The loop yields the engine's parsed steps as they come and `CallStarted` / `CallFinished`
/ `ApprovalNeeded` between turns; each API turns them into its own stream events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from pippin.chat.tool_parsers.base import ParsedDelta, ToolCall, collect_calls, random_call_id
from pippin.engine.client import EngineClient
from pippin.engine.types import SamplingParams
from pippin.serving.errors import ApiError, bad_request
from pippin.serving.pipeline import (
    NewParser,
    ParsedStep,
    arguments_for_template,
    output_parsing,
    render_media_prompt,
    run_parsed,
)
from pippin.serving.streams import closing

if TYPE_CHECKING:
    from pippin.mcp.manager import CallResult, ServerConn, ToolInfo
    from pippin.serving.live_model import LiveModel
    from pippin.serving.media import MediaParts
    from pippin.serving.state import ServerState

# --- the tools of one request ---------------------------------------------------------


@dataclass(frozen=True)
class OfferedTool:
    label: str  # the server's label as the client named it
    conn: ServerConn
    info: ToolInfo
    approval: bool = False  # the client must approve each call (Responses)


@dataclass
class McpTools:
    """The MCP tools one request offers the model, by name."""

    by_name: dict[str, OfferedTool] = field(default_factory=dict)
    servers: dict[str, ServerConn] = field(default_factory=dict)  # by label, in order

    def add_server(
        self,
        label: str,
        conn: ServerConn,
        keep: Callable[[ToolInfo], bool],
        approval: Callable[[ToolInfo], bool],
        param: str,
    ) -> None:
        if label in self.servers:
            raise bad_request(f"The MCP server label '{label}' is used twice.", param=param)
        self.servers[label] = conn
        for info in conn.tools.values():
            if not keep(info):
                continue
            other = self.by_name.get(info.name)
            if other is not None:
                raise bad_request(
                    f"The MCP servers '{other.label}' and '{label}' both have a tool named "
                    f"'{info.name}'; narrow one's allowed tools.",
                    param=param,
                )
            self.by_name[info.name] = OfferedTool(label, conn, info, approval(info))

    def owns(self, name: str | None) -> bool:
        return name is not None and name in self.by_name

    def needs_approval(self, name: str | None) -> bool:
        tool = self.by_name.get(name or "")
        return tool is not None and tool.approval

    def label(self, name: str) -> str:
        return self.by_name[name].label

    def listed(self, label: str) -> list[ToolInfo]:
        return [t.info for t in self.by_name.values() if t.label == label]

    def functions(self) -> list[dict[str, Any]]:
        return [t.info.function() for t in self.by_name.values()]

    def check_clash(self, client_tools: Iterable[dict[str, Any]] | None, param: str) -> None:
        for t in client_tools or []:
            name = t.get("function", {}).get("name")
            if name in self.by_name:
                raise bad_request(
                    f"The function tool '{name}' has the name of a tool of the MCP server "
                    f"'{self.by_name[name].label}'.",
                    param=param,
                )


def require_manager(state: ServerState, param: str) -> Any:
    manager = state.mcp
    if manager is None:
        raise bad_request(
            "No MCP servers are configured on this server (pippin serve --mcp-config).",
            param=param,
            code="mcp_not_configured",
        )
    return manager


def find_server(
    state: ServerState,
    label: str | None,
    url: str | None,
    param: str,
    keys: tuple[str, str] = ("server_label", "server_url"),
    unconfigured_param: str | None = None,
) -> ServerConn:
    """A configured server, by label or by URL; pippin connects to no other (a request
    cannot make it reach an address the operator did not name). A stdio server has no
    URL: its label alone names it."""
    manager = require_manager(state, unconfigured_param or f"{param}.type")
    conn = manager.get(label) if label else None
    if conn is not None and conn.config.url is None:
        return conn
    if url is not None:
        by_url = manager.by_url(url)
        if by_url is None or (conn is not None and conn is not by_url):
            raise bad_request(
                f"The MCP server at {url!r} is not one of this server's configured servers "
                f"({', '.join(manager.servers) or 'none'}); pippin connects only to those.",
                param=f"{param}.{keys[1]}",
            )
        return by_url
    if conn is None:
        raise bad_request(
            f"There is no configured MCP server named '{label}'; configured: "
            f"{', '.join(manager.servers) or 'none'}.",
            param=f"{param}.{keys[0]}",
        )
    return conn


# --- the loop ---------------------------------------------------------------------------


@dataclass
class McpCall:
    id: str  # the call's id as the parser gave it (the client-visible id)
    label: str
    name: str
    arguments: str
    approval_request_id: str | None = None
    result: CallResult | None = None

    def message_text(self) -> str:
        """The result as the model reads it."""
        assert self.result is not None
        out = self.result.output
        return f"Error: {out}" if self.result.is_error else out


@dataclass
class CallStarted:
    call: McpCall


@dataclass
class CallFinished:
    call: McpCall


@dataclass
class ApprovalNeeded:
    call: McpCall


LoopEvent = ParsedStep | CallStarted | CallFinished | ApprovalNeeded


@dataclass
class Turn:
    prompt_ids: list[int]
    params: SamplingParams
    new_parser: NewParser


@dataclass
class TurnMaker:
    """Renders the conversation so far into the next turn's prompt, with the same
    template arguments and tools as the first (the MCP tools only while calls are left)."""

    live: LiveModel
    tokenizer: Any
    client_tools: list[dict[str, Any]] | None
    mcp_tools: McpTools
    template_kwargs: dict[str, Any]
    base: SamplingParams  # the first turn's settings; max_tokens counts all turns
    thinking_budget: int | None = None
    new_id: Callable[[], str] = random_call_id
    one_call: bool = False
    messages_param: str = "messages"
    # The request's images and videos: their placeholders stay in the messages, so every
    # turn's prompt holds them again (loaded once).
    media: MediaParts | None = None

    def tools(self, offer_mcp: bool) -> list[dict[str, Any]] | None:
        tools = list(self.client_tools or [])
        if offer_mcp:
            tools += self.mcp_tools.functions()
        return tools or None

    async def __call__(
        self, messages: list[dict[str, Any]], offer_mcp: bool, used: int
    ) -> Turn | None:
        """The next turn; None when no room is left for it (the answer is cut off)."""
        tools = self.tools(offer_mcp)
        ids, mm = await render_media_prompt(
            self.live,
            self.tokenizer,
            messages,
            tools,
            self.template_kwargs,
            self.media,
            messages_param=self.messages_param,
        )
        limits = self.live.limits
        assert limits is not None
        room = min(self.base.max_tokens - used, limits.max_model_len - len(ids))
        if room < 1:
            return None
        params = replace(self.base, max_tokens=room, constraint=None, mm=mm)
        new_parser, params = await output_parsing(
            self.live,
            self.tokenizer,
            ids,
            params,
            tools,
            self.thinking_budget,
            new_id=self.new_id,
            one_call=self.one_call,
        )
        return Turn(ids, params, new_parser)


@dataclass
class ToolLoop:
    """Turns of one request until the model answers (see the module's docstring)."""

    engine: EngineClient
    request_id: str
    messages: list[dict[str, Any]]
    first: Turn | None
    next_turn: Callable[[list[dict[str, Any]], bool, int], Awaitable[Turn | None]] | None
    tools: McpTools | None = None
    max_calls: int = 8
    # Calls the client approved (Responses): run before the first turn.
    pending: list[McpCall] = field(default_factory=list)
    # Totals over all turns.
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    reasoning_tokens: int = 0
    calls_made: int = 0
    turns: int = 0
    finish_reason: str | None = None
    last_step: ParsedStep | None = None
    # Takes the first turn's cached prompt tokens once the engine has matched its prefix,
    # before any token (the Anthropic API's `message_start` reports them).
    on_admitted: Callable[[int], None] | None = None

    def owns(self, name: str | None) -> bool:
        return self.tools is not None and self.tools.owns(name)

    def needs_approval(self, name: str | None) -> bool:
        return self.tools is not None and self.tools.needs_approval(name)

    async def events(self, whole: bool = False) -> AsyncIterator[LoopEvent]:
        """`whole`: the answer is sent whole, not streamed (see `NewParser`)."""
        turn = self.first
        if self.pending:
            async for ev in self._run(self.pending, ParsedDelta()):
                yield ev
            turn = await self._next()
        while turn is not None:
            parsed = ParsedDelta()
            done_prompt, done_cached, done_completion = (
                self.prompt_tokens,
                self.cached_tokens,
                self.completion_tokens,
            )
            # One parser per choice (several only without MCP tools: `n`).
            parsers = [turn.new_parser(whole) for _ in range(turn.params.n)]
            admitted = self.on_admitted if self.turns == 0 else None
            steps = run_parsed(
                self.engine,
                turn.prompt_ids,
                replace(turn.params, announce=True) if admitted else turn.params,
                f"{self.request_id}-{self.turns}" if self.turns else self.request_id,
                parsers,
                admitted,
            )
            self.turns += 1
            thinking = [p.in_reasoning for p in parsers]
            async with closing(steps) as it:
                async for step in it:
                    i = step.output.index
                    if thinking[i]:  # a token generated inside the reasoning section
                        self.reasoning_tokens += len(step.output.token_ids)
                    thinking[i] = parsers[i].in_reasoning
                    if i == 0:
                        parsed.merge(step.parsed)
                    self.prompt_tokens = done_prompt + step.prompt_tokens
                    self.cached_tokens = done_cached + step.cached_tokens
                    self.completion_tokens = done_completion + step.completion_tokens
                    self.finish_reason = step.finish_reason or self.finish_reason
                    self.last_step = step
                    yield step
            if self.finish_reason == "length" or self.tools is None:
                return
            calls = collect_calls(parsed.calls)
            mine = [c for c in calls if self.owns(c.name)]
            if not mine:
                return
            theirs = len(mine) < len(calls)
            approvals = [c for c in mine if self.needs_approval(c.name)]
            run = [self._call(c) for c in mine if not self.needs_approval(c.name)]
            async for ev in self._run(run, parsed):
                yield ev
            for c in approvals:
                yield ApprovalNeeded(self._call(c))
            if theirs or approvals:
                # The client's turn: it runs its function calls or answers the approvals.
                self.finish_reason = "tool_calls"
                return
            turn = await self._next()
            if turn is None:
                self.finish_reason = "length"

    def _call(self, c: ToolCall) -> McpCall:
        assert self.tools is not None
        return McpCall(c.id or random_call_id(), self.tools.label(c.name), c.name, c.arguments)

    async def _next(self) -> Turn | None:
        if self.next_turn is None:
            return None
        used = self.completion_tokens
        return await self.next_turn(self.messages, self.calls_made < self.max_calls, used)

    async def _run(self, calls: list[McpCall], parsed: ParsedDelta) -> AsyncIterator[LoopEvent]:
        """Runs the calls (in order) and appends them and their results to the messages."""
        if not calls:
            return
        for call in calls:
            yield CallStarted(call)
            call.result = await self._execute(call)
            yield CallFinished(call)
        msg: dict[str, Any] = {"role": "assistant", "content": parsed.content}
        if parsed.reasoning:
            msg["reasoning_content"] = parsed.reasoning
        msg["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": arguments_for_template(c.arguments)},
            }
            for c in calls
        ]
        self.messages.append(msg)
        for c in calls:
            self.messages.append(
                {"role": "tool", "tool_call_id": c.id, "name": c.name, "content": c.message_text()}
            )

    async def _execute(self, call: McpCall) -> CallResult:
        from pippin.mcp.manager import CallResult

        if self.calls_made >= self.max_calls:
            return CallResult(
                f"Not run: this request reached its limit of {self.max_calls} MCP tool calls.",
                "limit",
            )
        tool = self.tools.by_name.get(call.name) if self.tools is not None else None
        if tool is None:
            return CallResult(f"'{call.name}' is not an MCP tool of this request.", "not_allowed")
        self.calls_made += 1
        return await tool.conn.call(call.name, call.arguments)


def mcp_error(message: str, param: str) -> ApiError:
    return bad_request(message, param=param, code="invalid_value")


def every_server_tools(state: ServerState) -> McpTools:
    """`--mcp-auto`: every configured server's tools, under the server's own name."""
    out = McpTools()
    manager = require_manager(state, "tools")
    for name, conn in manager.servers.items():
        out.add_server(name, conn, lambda _: True, lambda _: False, "tools")
    return out
