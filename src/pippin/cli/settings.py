"""`pippin serve`'s parsed flags into `ServerSettings`, each group through its own module.

The order of the steps is the order their errors are reported in: the models, their
aliases and budget, the engine, the metrics switch, the parsers, then the files named
by --api-keys and --mcp-config.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from pippin.cli.admission_flags import api_keys
from pippin.cli.audio_flags import stt_settings
from pippin.cli.chat_flags import resolve_parsers, sampling_overrides
from pippin.cli.embed_flags import embed_settings
from pippin.cli.engine_flags import engine_config, engine_process
from pippin.cli.mcp_flags import mcp_settings
from pippin.cli.media_flags import limits_from_args
from pippin.cli.model_flags import model_management, model_routing, model_specs
from pippin.cli.server_flags import cors_settings, metrics_on

if TYPE_CHECKING:
    from pippin.serving.settings import ServerSettings


def settings_from_args(args: argparse.Namespace) -> ServerSettings:
    # Imported here: `pippin --help` and `pippin bench` do without the serving layer.
    from pippin.serving.settings import MIB, ServerSettings

    model, specs = model_specs(args)
    aliases, budget = model_routing(args)
    engine = engine_config(args)
    metrics = metrics_on(args)
    resolve_parsers(args, specs)
    return ServerSettings(
        model=model,
        models=specs,
        model_aliases=aliases,
        memory_budget=budget,
        model_load_timeout=args.model_load_timeout,
        idle_ttl=args.idle_ttl,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        served_model_names=list(args.served_model_name or []),
        api_key=args.api_key or None,
        dtype=None if args.dtype == "auto" else args.dtype,
        trust_remote_code=args.trust_remote_code,
        revision=args.revision,
        max_request_body_bytes=int(args.max_request_body_mb * MIB),
        engine=engine,
        engine_process=engine_process(args),
        sampling_overrides=sampling_overrides(args),
        default_chat_template_kwargs=args.default_chat_template_kwargs or {},
        metrics=metrics,
        embed=embed_settings(args),
        stt=stt_settings(args),
        warm_prompts=args.warm_prompts,
        cors=cors_settings(args),
        log_prompts=args.log_prompts,
        max_queue=args.max_queue,
        api_keys=api_keys(args.api_keys),
        drain_timeout_s=args.drain_timeout,
        mcp=mcp_settings(args),
        media=limits_from_args(args),
        tts_model=args.tts_model,
        tts_names=list(args.tts_served_model_name or []),
        **model_management(args),  # type: ignore[arg-type]
    )
