"""OpenAI requests -> the constraint their structured output asks for.

Chat: `response_format`, a forced `tool_choice` / `function_call`, or vLLM's `guided_*` /
`structured_outputs` fields (at most one of these kinds). Completions: the vLLM fields.
Errors become OpenAI 400s naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pippin.api.openai.protocol import ChatCompletionRequest, SamplingFields
from pippin.engine.constraint import Constraint
from pippin.serving.errors import bad_request, unsupported_value
from pippin.serving.pipeline import compile_spec, grammar_error, tool_parser
from pippin.structured.formats import guided_grammar, response_format_grammar
from pippin.structured.spec import GrammarSpec, StructuredOutputError
from pippin.structured.tool_calls import forced_tool_grammar

if TYPE_CHECKING:
    from pippin.serving.live_model import LiveModel


@dataclass(frozen=True)
class ForcedTool:
    name: str | None  # None: any of the tools
    param: str


def forced_tool(choice: Any, param: str) -> ForcedTool | None:
    """The call a `tool_choice` (or deprecated `function_call`) forces; None if none."""
    if choice in (None, "none", "auto"):
        return None
    if choice == "required":
        return ForcedTool(None, param)
    if isinstance(choice, dict):
        kind = choice.get("type")
        fn = choice.get("function")
        if param == "function_call" and isinstance(choice.get("name"), str) and len(choice) == 1:
            return ForcedTool(choice["name"], param)
        if kind == "function" and isinstance(fn, dict) and isinstance(fn.get("name"), str):
            return ForcedTool(fn["name"], param)
        if kind in ("custom", "allowed_tools"):
            raise unsupported_value(param, f"tool_choice type '{kind}' is not supported.")
    raise bad_request(
        f"Invalid {param}: use 'none', 'auto', 'required' or a function by name.",
        param=param,
        code="invalid_value",
    )


def guided_spec(req: SamplingFields) -> GrammarSpec | None:
    """vLLM's `guided_*` fields or `structured_outputs` (one of them)."""
    guided = {
        "json": req.guided_json,
        "regex": req.guided_regex,
        "choice": req.guided_choice,
        "grammar": req.guided_grammar,
    }
    try:
        spec = guided_grammar(guided)
        if req.structured_outputs is not None:
            other = guided_grammar(req.structured_outputs, "", "structured_outputs")
            if spec is not None and other is not None:
                raise StructuredOutputError(
                    "structured_outputs", "Use 'structured_outputs' or the 'guided_*' fields."
                )
            spec = spec or other
    except StructuredOutputError as exc:
        raise grammar_error(exc) from None
    return spec


def chat_spec(
    req: ChatCompletionRequest, live: LiveModel, tools: list[dict[str, Any]] | None
) -> GrammarSpec | None:
    """What a chat request constrains: a forced tool call, else the format asked for."""
    choice, choice_param = req.tool_choice, "tool_choice"
    if req.function_call is not None:
        choice, choice_param = req.function_call, "function_call"
    forced = forced_tool(choice, choice_param)
    guided = guided_spec(req)
    try:
        fmt = response_format_grammar(
            req.response_format.model_dump() if req.response_format is not None else None
        )
        if fmt is not None and guided is not None:
            raise StructuredOutputError(
                guided.param, f"Use 'response_format' or '{guided.param}', not both."
            )
        if forced is not None:
            # The answer is the call: a response format has no text to apply to.
            return forced_tool_grammar(
                tool_parser(live, tools),
                tools or [],
                forced.name,
                parallel=req.parallel_tool_calls is not False,
                vocab=live.grammars,
                param=forced.param,
            )
    except StructuredOutputError as exc:
        raise grammar_error(exc) from None
    return fmt or guided


async def completion_constraint(live: LiveModel, req: SamplingFields) -> Constraint | None:
    spec = guided_spec(req)
    return None if spec is None else await compile_spec(live, spec)
