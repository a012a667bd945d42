"""`pippin serve`'s chat output flags (tool-call and reasoning parsers) and sampling
defaults."""

from __future__ import annotations

import argparse
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from pippin.argtypes import json_object
from pippin.serving.limits import BUILTIN_DEFAULTS
from pippin.store.default_model import (
    DEFAULT_MODEL_NAME,
    DEFAULT_MODEL_SAMPLING,
    describe_sampling,
)

if TYPE_CHECKING:
    from pippin.serving.model_specs import ModelSpec


def add_chat_flags(p: argparse.ArgumentParser) -> None:
    o = p.add_argument_group("chat output")
    o.add_argument(
        "--tool-call-parser",
        default="auto",
        metavar="NAME",
        help="format of the model's tool calls: 'auto' (from the chat template and model "
        "type), 'none', or a parser name such as hermes, qwen3_coder, llama3_json, "
        "mistral, deepseek_v3, kimi_k2, glm45, gemma4, gpt_oss; vLLM's and vllm-mlx's names "
        "are accepted ('qwen' reads both Qwen forms: hermes JSON and <function=...> XML) "
        "(default: %(default)s)",
    )
    o.add_argument(
        "--reasoning-parser",
        default="auto",
        metavar="NAME",
        help="format of the model's reasoning: 'auto', 'none', or one of think, qwen3, "
        "deepseek_r1, glm45, mistral, granite, gemma4; vLLM's and vllm-mlx's names are "
        "accepted (default: %(default)s)",
    )
    o.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="accepted for vLLM compatibility; tool calls are always parsed when a "
        "request has tools",
    )

    d = p.add_argument_group(
        "sampling defaults",
        "used when a request leaves a field out; they take precedence over the model's "
        "generation_config.json (vllm-mlx names). Without either: for the default model "
        f"{DEFAULT_MODEL_NAME}, {describe_sampling(DEFAULT_MODEL_SAMPLING)}; otherwise "
        f"{describe_sampling(_builtin())}. Each model's effective values are "
        "logged when it loads and listed in /v1/models (sampling_defaults)",
    )
    for name, kind, what in (
        ("temperature", float, "sampling temperature"),
        ("top-p", float, "nucleus sampling mass"),
        ("top-k", int, "top-k cutoff (0 = off)"),
        ("min-p", float, "min-p cutoff"),
        ("presence-penalty", float, "presence penalty"),
        ("repetition-penalty", float, "repetition penalty"),
    ):
        d.add_argument(f"--default-{name}", type=kind, metavar="X", help=f"default {what}")
    d.add_argument(
        "--default-chat-template-kwargs",
        type=json_object,
        metavar="JSON",
        help='extra chat template arguments for every request, e.g. \'{"enable_thinking": '
        "false}'; a request's chat_template_kwargs override them key by key",
    )


def _builtin() -> dict[str, Any]:
    return {k: BUILTIN_DEFAULTS[k] for k in ("temperature", "top_p", "top_k")}


def sampling_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The --default-* sampling values given (a request's own fields still win)."""
    overrides = {
        "temperature": args.default_temperature,
        "top_p": args.default_top_p,
        "top_k": args.default_top_k,
        "min_p": args.default_min_p,
        "presence_penalty": args.default_presence_penalty,
        "repetition_penalty": args.default_repetition_penalty,
    }
    return {k: v for k, v in overrides.items() if v is not None}


def resolve_parsers(args: argparse.Namespace, specs: list[ModelSpec]) -> None:
    """Check the parser names of the flags and of each --models entry (an unknown one stops
    `pippin serve`); vllm-mlx's harmony names become "auto", in ``args`` and in ``specs``."""
    from pippin.chat.reasoning import HARMONY_NAMES, REASONING_PARSERS
    from pippin.chat.tool_parsers import registry

    special = ("auto", "none")
    # gpt-oss's harmony parser reads its reasoning: vllm-mlx's harmony names mean "auto".
    if args.reasoning_parser in HARMONY_NAMES:
        args.reasoning_parser = "auto"
    for i, spec in enumerate(specs):
        if spec.reasoning_parser in HARMONY_NAMES:
            specs[i] = replace(spec, reasoning_parser="auto")
    tools = [("--tool-call-parser", args.tool_call_parser)]
    reasoning = [("--reasoning-parser", args.reasoning_parser)]
    for i, spec in enumerate(specs):
        tools.append((f"models[{i}].tool_call_parser", spec.tool_call_parser or "auto"))
        reasoning.append((f"models[{i}].reasoning_parser", spec.reasoning_parser or "auto"))
    for what, name in tools:
        if name not in special and name not in registry():
            raise SystemExit(
                f"pippin serve: unknown {what} {name!r}; choose "
                f"one of {', '.join([*special, *sorted(registry())])}"
            )
    for what, name in reasoning:
        if name not in special and name not in REASONING_PARSERS:
            raise SystemExit(
                f"pippin serve: unknown {what} {name!r}; choose "
                f"one of {', '.join([*special, *sorted(REASONING_PARSERS)])}"
            )
