"""Request fields + defaults -> SamplingParams, max_tokens rules, and CLI -> settings."""

from __future__ import annotations

from typing import Any

import pytest

from pippin.api.errors import loc_to_param
from pippin.api.openai.protocol import ChatCompletionRequest, sampling_of
from pippin.cli.main import build_parser
from pippin.cli.settings import settings_from_args
from pippin.engine.config import BATCHED_TOKENS_CUDA
from pippin.kernels import device
from pippin.serving.errors import ApiError
from pippin.serving.limits import Limits, merge_defaults
from pippin.serving.sampling import build_sampling_params, resolve_max_tokens

LIMITS = Limits(max_model_len=100, vocab_size=50, max_tokens_cap=None)


def req(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], **fields}
    )


def params(defaults: dict[str, Any] | None = None, **fields: Any) -> Any:
    r = req(**fields)
    return build_sampling_params(
        sampling_of(r, bool(r.logprobs), r.top_logprobs or 0),
        max_tokens=10,
        limits=LIMITS,
        defaults=merge_defaults(defaults or {}, {}),
    )


def test_builtin_defaults() -> None:
    p = params()
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.repetition_penalty) == (
        1.0,
        1.0,
        0,
        0.0,
        1.0,
    )
    assert p.n == 1 and p.stop == [] and p.seed is None and p.skip_special_tokens


def test_model_defaults_then_overrides_then_request() -> None:
    model = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "unrelated": 1}
    d = merge_defaults(model, {"top_p": 0.5})
    assert d["temperature"] == 0.6 and d["top_p"] == 0.5 and d["top_k"] == 20
    assert "unrelated" not in d
    p = build_sampling_params(
        sampling_of(req(temperature=0.1)), max_tokens=5, limits=LIMITS, defaults=d
    )
    assert p.temperature == 0.1 and p.top_p == 0.5 and p.top_k == 20


def test_request_fields_map() -> None:
    p = params(
        stop="END",
        seed=7,
        n=3,
        top_k=-1,
        logit_bias={"3": 5, "4": -100},
        stop_token_ids=[1, 2],
        logprobs=True,
        top_logprobs=4,
        ignore_eos=True,
        min_tokens=2,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        min_p=0.05,
    )
    assert p.stop == ["END"] and p.seed == 7 and p.n == 3 and p.top_k == 0
    assert p.logit_bias == {3: 5.0, 4: -100.0} and p.stop_token_ids == [1, 2]
    assert p.logprobs and p.top_logprobs == 4 and p.ignore_eos and p.min_tokens == 2
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.min_p) == (
        0.5,
        -0.5,
        1.2,
        0.05,
    )


def test_top_p_zero_is_greedy() -> None:
    p = params(top_p=0, temperature=0.8)
    assert p.temperature == 0.0 and p.top_p == 1.0


def test_empty_stop_strings_are_dropped() -> None:
    assert params(stop=["", "a"]).stop == ["a"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"50": 1}}, "logit_bias"),
        ({"logit_bias": {"1": 101}}, "logit_bias"),
        ({"stop_token_ids": [50]}, "stop_token_ids"),
        ({"min_tokens": 11}, "min_tokens"),
    ],
)
def test_bad_values_need_the_model(fields: dict[str, Any], param: str) -> None:
    with pytest.raises(ApiError) as info:
        params(**fields)
    assert info.value.status == 400 and info.value.param == param


def test_max_tokens_default_is_the_rest_of_the_context() -> None:
    assert resolve_max_tokens(None, 30, LIMITS, None, None, "messages") == 70
    assert resolve_max_tokens(None, 30, LIMITS, 20, None, "messages") == 20
    assert resolve_max_tokens(None, 30, LIMITS, None, 16, "prompt") == 16
    capped = Limits(100, 50, max_tokens_cap=8)
    assert resolve_max_tokens(None, 30, capped, None, None, "messages") == 8
    assert resolve_max_tokens(70, 30, LIMITS, None, None, "messages") == 70


def test_prompt_past_the_context() -> None:
    with pytest.raises(ApiError) as info:
        resolve_max_tokens(None, 100, LIMITS, None, None, "messages")
    err = info.value
    assert err.code == "context_length_exceeded" and err.param == "messages"
    assert "100" in err.message


def test_prompt_plus_max_tokens_past_the_context() -> None:
    with pytest.raises(ApiError) as info:
        resolve_max_tokens(71, 30, LIMITS, None, None, "messages")
    err = info.value
    assert err.code == "context_length_exceeded"
    assert "101" in err.message and "30" in err.message and "71" in err.message


def test_max_tokens_over_the_server_cap() -> None:
    with pytest.raises(ApiError) as info:
        resolve_max_tokens(9, 1, Limits(100, 50, max_tokens_cap=8), None, None, "messages")
    assert info.value.param == "max_tokens"


def test_loc_to_param() -> None:
    assert loc_to_param(
        ("messages", 0, "@user", "content", "list[tagged-union[A,B]]", 1, "@text", "text")
    ) == ("messages[0].content[1].text")
    assert loc_to_param(("stop", "str")) == "stop"
    assert loc_to_param(()) is None


def test_cli_settings_and_aliases() -> None:
    parser = build_parser()
    args = parser.parse_args(
        [
            "serve",
            "some/model",
            "--served-model-name",
            "a",
            "b",
            "--max-num-batched-tokens",
            "512",
            "--max-cache-blocks",
            "99",
            "--paged-cache-block-size",
            "32",
            "--max-request-tokens",
            "64",
            "--cache-memory-percent",
            "30",
            "--continuous-batching",
            "--disable-prefix-cache",
            "--dtype",
            "float16",
            "--default-temperature",
            "0.3",
            "--default-chat-template-kwargs",
            '{"enable_thinking": false}',
            "--max-request-body-mb",
            "2",
        ]
    )
    s = settings_from_args(args)
    assert s.model == "some/model" and s.served_model_names == ["a", "b"]
    e = s.engine
    assert (e.max_num_batched_tokens, e.num_blocks, e.block_size, e.max_tokens_cap) == (
        512,
        99,
        32,
        64,
    )
    assert e.cache_memory_percent == pytest.approx(0.3) and not e.enable_prefix_caching
    assert s.dtype == "float16" and s.sampling_overrides == {"temperature": 0.3}
    assert s.default_chat_template_kwargs == {"enable_thinking": False}
    assert s.max_request_body_bytes == 2 * 1024 * 1024
    assert s.api_key is None and s.trust_remote_code is False


def test_cache_memory_mb_sizes_the_pool() -> None:
    argv = ["serve", "--cache-memory-mb", "64", "--buffer-cache-mb", "512", "--offline"]
    args = build_parser().parse_args(argv)
    e = settings_from_args(args).engine
    assert e.cache_memory_bytes == 64 * 1024 * 1024 and e.buffer_cache_bytes == 512 * 1024 * 1024
    assert args.offline


def test_cli_defaults() -> None:
    s = settings_from_args(build_parser().parse_args(["serve", "--model", "x", "--dtype", "auto"]))
    assert s.model == "x" and s.dtype is None
    e = s.engine
    # A step reads 8192 prompt tokens on CUDA, 2048 elsewhere.
    batched = BATCHED_TOKENS_CUDA if device.on_cuda() else 2048
    assert (e.max_num_seqs, e.max_num_batched_tokens, e.block_size) == (256, batched, 16)
    assert e.kernels.enabled
    assert e.enable_prefix_caching and e.max_tokens_cap is None and e.num_blocks is None
    assert e.buffer_cache_bytes is None


@pytest.mark.parametrize(
    "argv",
    [
        ["serve", "--port", "70000"],
        ["serve", "--max-num-seqs", "0"],
        ["serve", "--cache-memory-percent", "0"],
        ["serve", "--dtype", "int3"],
        ["serve", "--default-chat-template-kwargs", "[1]"],
    ],
)
def test_cli_rejects_bad_values(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["--port", "1", "--port", "2"], "--port given more than once"),
        (["--served-model-name", "a", "b", "--served-model-name", "c"], "--served-model-name"),
        (["--max-num-batched-tokens", "8", "--prefill-step-size", "9"], "set the same value"),
        (["--embedding-model", "e", "--embedding-model", "f"], "--embedding-model"),
    ],
)
def test_cli_refuses_a_repeated_single_value_flag(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # argparse would keep the last one: `--model A --model B` served only B.
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert said in err
    several = "serving several models is not supported yet" in err
    assert several == (argv[0] == "--embedding-model")
    # Flags that take no value, and a model named twice the same way, are fine.
    args = build_parser().parse_args(["serve", "m", "--model", "m", "--offline", "--offline"])
    assert settings_from_args(args).model == "m"


def test_cli_serves_several_models() -> None:
    """`--model` repeated: every model served, the first loaded at start-up (not pinned: a
    request's keep_alive 0 may unload it) and named by --served-model-name, the others on
    demand with --idle-ttl; --models is the other way."""
    argv = ["serve", "A", "--model", "B", "--model", "C", "--served-model-name", "a"]
    args = build_parser().parse_args([*argv, "--idle-ttl", "60", "--memory-budget", "2GB"])
    s = settings_from_args(args)
    assert s.model is None and [m.model for m in s.models] == ["A", "B", "C"]
    assert [(m.preload, m.pinned, m.names, m.idle_ttl) for m in s.models] == [
        (True, False, ["a"], None), (False, False, [], 60.0), (False, False, [], 60.0)
    ]  # fmt: skip
    assert s.memory_budget == 2 * 10**9 and s.model_specs() == s.models
    with pytest.raises(SystemExit, match="either as MODEL/--model or --models"):
        settings_from_args(build_parser().parse_args(["serve", "A", "--models", "m.yaml"]))


def test_cli_help_documents_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    out = capsys.readouterr().out
    for flag in (
        "--host",
        "--port",
        "--api-key",
        "--served-model-name",
        "--max-num-seqs",
        "--max-model-len",
        "--max-tokens",
        "--prefill-step-size",
        "--cache-memory-percent",
        "--num-kv-blocks",
        "--block-size",
        "--dtype",
        "--trust-remote-code",
        "--log-level",
        "--max-request-body-mb",
        "--revision",
        "--continuous-batching",
        "--max-num-batched-tokens",
        "--model",
    ):
        assert flag in out
    parser = build_parser()
    serve = next(a for a in parser._subparsers._group_actions[0].choices.values())  # type: ignore[union-attr]
    for action in serve._actions:
        assert action.help, action.option_strings
