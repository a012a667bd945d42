"""One chat request in no API's shape, and the one path that prepares and runs it.

Every chat-shaped API (OpenAI chat completions and Responses, Anthropic Messages, Ollama's
chat and generate) turns its wire request into a `ChatJob`: messages in the chat
template's shape, the client's tools, MCP tools, sampling, limits and output format.
`prepare` turns a job into what the engine runs on a live model (prompt ids through the
template, sampling settings, output parsers, the grammar) and a `ToolLoop` that runs it:
one turn without MCP tools, as many as the model's MCP calls need with them. Each API
then only formats the loop's events (`ParsedStep`, `CallStarted`, ...) as its own.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pippin.chat.tool_parsers.base import random_call_id
from pippin.engine.client import EngineClient, EngineError
from pippin.engine.types import SamplingParams
from pippin.serving.errors import ApiError, bad_request
from pippin.serving.limits import truncate_prompt
from pippin.serving.live_model import LiveModel
from pippin.serving.pipeline import NewParser, output_parsing, render_media_prompt
from pippin.serving.sampling import Sampling, build_sampling_params, resolve_max_tokens
from pippin.serving.state import require_engine
from pippin.serving.tool_loop import McpCall, McpTools, ToolLoop, Turn, TurnMaker

if TYPE_CHECKING:
    from pippin.serving.limits import Limits
    from pippin.serving.media import MediaParts
    from pippin.structured.spec import GrammarSpec
    from pippin.vision.inputs import MultiModal


def _no_kwargs(live: LiveModel) -> dict[str, Any]:
    return {}


@dataclass
class ChatJob:
    """A chat request as every API asks it. The `*_param` fields name the request's own
    fields in errors ("messages" or "input"; "max_tokens" or "options.num_predict")."""

    model: str
    request_id: str
    messages: list[dict[str, Any]]  # in the chat template's shape
    media: MediaParts | None = None  # the messages' images, videos and audio
    tools: list[dict[str, Any]] | None = None  # the client's function tools
    mcp: McpTools | None = None  # the tools pippin runs (`ToolLoop`)
    sampling: Sampling = field(default_factory=Sampling)
    max_tokens: int | None = None
    max_tokens_param: str = "max_tokens"
    # The API's own rule for a requested max_tokens, where it is not OpenAI's (one the
    # context cannot hold is refused, naming `max_tokens_param`): (requested, prompt
    # length, limits) -> what the engine may generate, or the API's refusal raised.
    # Anthropic's cuts it to the rest of the context, as the hosted API does.
    max_tokens_rule: Callable[[int, int, Limits], int] | None = None
    messages_param: str = "messages"
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    thinking_budget: int | None = None
    budget_param: str = "thinking_token_budget"
    # Drop the budget for a model without a reasoning parser (its template's switch is
    # all it has) rather than refuse it.
    budget_if_possible: bool = False
    one_call: bool = False  # answer only the model's first tool call
    new_id: Callable[[], str] = random_call_id  # ids of the model's tool calls
    max_calls: int | None = None  # of MCP tools, below --mcp-max-calls
    pending: list[McpCall] = field(default_factory=list)  # approved MCP calls (Responses)
    # What depends on the model's template and grammar compiler, asked once it is live:
    # the template's arguments (above --default-chat-template-kwargs) and the output's
    # grammar, given the tools offered.
    template_kwargs: Callable[[LiveModel], dict[str, Any]] = _no_kwargs
    output_spec: Callable[[LiveModel, list[dict[str, Any]] | None], GrammarSpec | None] | None = (
        None
    )
    # A context overflow as the API words it (Responses' truncation), else as it is.
    overflow: Callable[[ApiError], ApiError] | None = None
    # vLLM's: keep the prompt's last N tokens (-1: what the context holds).
    truncate_prompt_tokens: int | None = None

    def offered_tools(self) -> list[dict[str, Any]] | None:
        """The tools the model is shown: the client's, then the MCP tools."""
        if self.mcp is None:
            return self.tools
        self.mcp.check_clash(self.tools, "tools")
        return [*(self.tools or []), *self.mcp.functions()] or None


@dataclass
class Rendered:
    """A job's prompt: its token ids and its media's data for the engine."""

    ids: list[int]
    mm: MultiModal | None = None


@dataclass
class PreparedJob:
    """A job ready for the engine on its live model."""

    job: ChatJob
    live: LiveModel
    engine: EngineClient
    prompt_ids: list[int]
    params: SamplingParams
    new_parser: NewParser
    loop: ToolLoop


def template_kwargs(live: LiveModel, job: ChatJob) -> dict[str, Any]:
    return {**live.settings.default_chat_template_kwargs, **job.template_kwargs(live)}


async def render(live: LiveModel, job: ChatJob) -> Rendered:
    """The job's prompt through the model's chat template (400s name the job's fields)."""
    return await _render(live, job, job.offered_tools(), template_kwargs(live, job))


async def _render(
    live: LiveModel, job: ChatJob, tools: list[dict[str, Any]] | None, kwargs: dict[str, Any]
) -> Rendered:
    _, loaded = require_engine(live)
    ids, mm = await render_media_prompt(
        live,
        loaded.tokenizer,
        job.messages,
        tools,
        kwargs,
        job.media,
        add_generation_prompt=job.add_generation_prompt,
        continue_final_message=job.continue_final_message,
        messages_param=job.messages_param,
    )
    return Rendered(ids, mm)


def max_tokens(live: LiveModel, job: ChatJob, prompt_len: int) -> int:
    """How many tokens the job may generate, by the job's own rule if it has one, else
    OpenAI's (400 when the request cannot fit)."""
    limits = live.limits
    assert limits is not None
    if job.max_tokens_rule is not None and job.max_tokens is not None:
        return job.max_tokens_rule(job.max_tokens, prompt_len, limits)
    try:
        return resolve_max_tokens(
            job.max_tokens,
            prompt_len,
            limits,
            live.defaults.get("max_tokens"),
            None,
            job.messages_param,
            job.max_tokens_param,
        )
    except ApiError as exc:
        if job.overflow is not None and exc.code == "context_length_exceeded":
            raise job.overflow(exc) from None
        raise


async def prepare(live: LiveModel, job: ChatJob, rendered: Rendered | None = None) -> PreparedJob:
    """`job` ready for `live`'s engine: its prompt (`rendered` when the API rendered it
    itself), sampling settings, output parsers and grammar, checked by the engine, and the
    loop that runs it."""
    engine, loaded = require_engine(live)
    tools = job.offered_tools()
    kwargs = template_kwargs(live, job)
    if rendered is None:
        rendered = await _render(live, job, tools, kwargs)
    ids = rendered.ids
    assert live.limits is not None
    if job.truncate_prompt_tokens is not None:
        ids = truncate_prompt(ids, job.truncate_prompt_tokens, live.limits)
        if len(ids) < len(rendered.ids) and rendered.mm is not None:
            # The media's positions in the prompt would no longer hold.
            raise bad_request(
                "'truncate_prompt_tokens' cannot cut a prompt with images or videos.",
                param="truncate_prompt_tokens",
            )
    params = build_sampling_params(
        job.sampling,
        max_tokens=max_tokens(live, job, len(ids)),
        limits=live.limits,
        defaults=live.defaults,
        tokenizer=loaded.tokenizer,
    )
    params.mm = rendered.mm
    budget = job.thinking_budget
    if budget is not None and job.budget_if_possible:
        if live.parsers is None or live.parsers.reasoning is None:
            budget = None
    spec = job.output_spec(live, tools) if job.output_spec is not None else None
    new_parser, params = await output_parsing(
        live,
        loaded.tokenizer,
        ids,
        params,
        tools,
        budget,
        spec=spec,
        budget_param=job.budget_param,
        new_id=job.new_id,
        one_call=job.one_call,
    )
    try:
        engine.check(ids, params)
    except EngineError as exc:
        raise bad_request(str(exc), param=job.messages_param) from None
    first = Turn(ids, params, new_parser)
    if job.mcp is None:
        loop = ToolLoop(engine, job.request_id, [], first, None)
    else:
        maker = TurnMaker(
            live,
            loaded.tokenizer,
            job.tools,
            job.mcp,
            kwargs,
            params,
            thinking_budget=budget,
            new_id=job.new_id,
            one_call=job.one_call,
            messages_param=job.messages_param,
            media=job.media,
        )
        limit = live.settings.mcp.max_calls
        loop = ToolLoop(
            engine,
            job.request_id,
            list(job.messages),
            first,
            maker,
            job.mcp,
            limit if job.max_calls is None else min(limit, job.max_calls),
            list(job.pending),
        )
    return PreparedJob(job, live, engine, ids, params, new_parser, loop)
