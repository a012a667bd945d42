"""`pippin serve`'s model flags: what to serve (one model, several, or a --models file),
under which names, and how to load it."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pippin.argtypes import positive_float

if TYPE_CHECKING:
    from pippin.serving.model_specs import ModelSpec

DTYPES = ("auto", "float32", "float16", "bfloat16")


def add_model_flags(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    m.add_argument(
        "model",
        nargs="?",
        metavar="MODEL",
        help="model to serve: a local folder (MLX or Hugging Face safetensors), a GGUF file, "
        "or a Hugging Face Hub id; default: the bundled SmolLM2-135M-Instruct",
    )
    m.add_argument(
        "--model",
        dest="model_flag",
        metavar="MODEL",
        action="append",
        help="the same as the positional MODEL (vLLM spelling); repeat it to serve several "
        "models: the first is loaded at start-up and is the 'default' model, the others "
        "load on their first request (see --idle-ttl, --memory-budget)",
    )
    m.add_argument(
        "--models",
        metavar="FILE",
        help="a YAML file of the chat models to serve, each with its path or Hub id, names "
        "and aliases, parsers, chat template, sampling defaults, context length, pinned or "
        "on demand, idle TTL (see docs/architecture.md#several-models); instead of MODEL",
    )
    m.add_argument(
        "--served-model-name",
        nargs="+",
        metavar="NAME",
        help="name(s) clients use in the 'model' field; default: the model's own name. The "
        "path or Hub id as given, its basename and 'default' are accepted too. With several "
        "--model, names the first",
    )
    m.add_argument(
        "--model-alias",
        metavar="PATTERN=MODEL",
        action="append",
        default=[],
        help="send requests whose model name matches the shell-style PATTERN to MODEL (a "
        "served name), e.g. 'gpt-*=coder'; repeatable. claude* goes to the default model "
        "unless a pattern says otherwise",
    )
    m.add_argument(
        "--memory-budget",
        metavar="SIZE",
        help="most memory the loaded chat models may take together (weights and KV pools), "
        "e.g. 16GB: loading one past it unloads the least recently used idle on-demand "
        "models. Default: no budget",
    )
    m.add_argument(
        "--idle-ttl",
        type=positive_float,
        metavar="SECONDS",
        help="unload an on-demand model after this long without requests (default: never; "
        "--models entries may set their own idle_ttl)",
    )
    m.add_argument(
        "--model-load-timeout",
        type=positive_float,
        metavar="SECONDS",
        default=300.0,
        help="how long a request waits for its model to load before a 503 with Retry-After "
        "(the load goes on) (default: %(default)s)",
    )
    m.add_argument(
        "--dtype",
        choices=DTYPES,
        default="auto",
        help="dtype of the weights that are not quantised; auto keeps the checkpoint's",
    )
    m.add_argument("--revision", help="branch, tag or commit to download for a Hub id")
    m.add_argument(
        "--offline",
        action="store_true",
        help="never contact the Hugging Face Hub: Hub ids must already be in the local cache "
        "(sets HF_HUB_OFFLINE=1, as vllm-mlx's flag of that name)",
    )
    m.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="allow a model's own Python code to run while loading (off by default)",
    )
    g = p.add_argument_group("model management (docs/models.md)")
    g.add_argument(
        "--models-dir",
        metavar="DIR",
        action="append",
        default=[],
        help="a folder models and LoRA adapters may be read from by path in requests; the "
        "first also holds the models pulled and created through the server (default: "
        "models in pippin's cache folder, $PIPPIN_CACHE_DIR or ~/.cache/pippin). Repeatable",
    )
    g.add_argument(
        "--disable-model-management",
        action="store_true",
        help="refuse (403) /api/pull, /api/create, /api/copy, /api/delete, /api/blobs and "
        "the LoRA adapter routes; with --api-keys they need a key marked admin otherwise",
    )
    g.add_argument(
        "--lora-modules",
        metavar="NAME=PATH",
        nargs="+",
        action="extend",
        default=[],
        help="LoRA adapters (mlx-lm or PEFT safetensors) served as models named NAME on the "
        "base model (vLLM's flag); requests for different adapters share batches",
    )


def model_specs(args: argparse.Namespace) -> tuple[str | None, list[ModelSpec]]:
    """(the one model, or None) and the specs of several (empty for one model)."""
    from pippin.serving.model_specs import ModelSpec, SpecError, load_specs

    given = ([args.model] if args.model else []) + list(args.model_flag or [])
    given = list(dict.fromkeys(given))  # `serve M --model M` is one model
    if args.models:
        if given:
            raise SystemExit("pippin serve: give the models either as MODEL/--model or --models")
        try:
            specs = load_specs(args.models)
        except SpecError as e:
            raise SystemExit(f"pippin serve: --models: {e}") from None
        for spec in specs:
            if spec.idle_ttl is None and not spec.pinned:
                spec.idle_ttl = args.idle_ttl
        return None, specs
    if len(given) <= 1:
        return (given[0] if given else None), []
    names = list(args.served_model_name or [])
    return None, [
        ModelSpec(
            model=m,
            names=names if i == 0 else [],
            preload=i == 0,
            idle_ttl=None if i == 0 else args.idle_ttl,
        )
        for i, m in enumerate(given)
    ]


def model_management(args: argparse.Namespace) -> dict[str, object]:
    """The ServerSettings fields of the model-management group."""
    modules = []
    for item in args.lora_modules:
        if item.lstrip().startswith("{"):
            modules.append(("", item))  # vLLM's JSON form: `serving.adapters.parse_module`
            continue
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise SystemExit(f"pippin serve: --lora-modules {item!r}: expected NAME=PATH")
        modules.append((name, path))
    return {
        "models_dirs": list(args.models_dir),
        "model_management": not args.disable_model_management,
        "lora_modules": modules,
    }


def model_routing(args: argparse.Namespace) -> tuple[list[tuple[str, str]], int | None]:
    """The --model-alias patterns and the --memory-budget in bytes (None: no budget)."""
    from pippin.serving.model_specs import SpecError, parse_alias, parse_size

    try:
        aliases = [parse_alias(a) for a in args.model_alias]
        budget = parse_size(args.memory_budget) if args.memory_budget else None
    except SpecError as e:
        raise SystemExit(f"pippin serve: {e}") from None
    return aliases, budget
