"""The API fuzzed from its own OpenAPI document (schemathesis) against a real server.

Every operation of /openapi.json gets generated requests, valid and not: no response may be a
5xx, none may hang, every error must be in the route's own format (OpenAI's
`{"error": {...}}`, Anthropic's `{"type": "error", "error": {...}}` on /v1/messages*, Ollama's
`{"error": "..."}` on /api/*) and every
status and content type must be one the document declares. Bounded here (12 random
requests per operation); by hand, longer, with schemathesis' coverage phase too (the
boundary values of every field, and every other HTTP method):

    PIPPIN_FUZZ_EXAMPLES=500 PIPPIN_FUZZ_COVERAGE=1 PYTHONPATH=$PWD/src \
        pytest -q tests/api/test_api_fuzz.py -s

The cases run per operation are printed at the end (`-s`).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from support.errors import api_of_path, assert_api_error
from support.fake_hub import fake_hub
from support.server_utils import Server, run_server

from pippin.server.app import create_app
from pippin.serving.state import ServerSettings

HANG_S = 60.0  # a request that takes longer than this is a hang (the model is tiny)
CASES: Counter[str] = Counter()
STATUSES: Counter[str] = Counter()


@pytest.fixture(scope="module")
def server(
    tiny_models: Callable[..., Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    # The model-management routes write to a library of the test's own, and pull from an
    # empty fake hub (every name a quick 404, never the real Hub).
    library = tmp_path_factory.mktemp("fuzz-library")
    with fake_hub() as hub, pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_ENDPOINT", hub.url)
        # A short context keeps every generation short, whatever max_tokens the fuzzer sends.
        with run_server(
            str(tiny_models("llama")),
            "--served-model-name",
            "tiny",
            "--max-model-len",
            "128",
            "--models-dir",
            str(library),
        ) as s:
            yield s


@pytest.fixture(scope="module", autouse=True)
def report_cases(pytestconfig: pytest.Config) -> Iterator[None]:
    yield
    report = pytestconfig.pluginmanager.get_plugin("terminalreporter")
    if report is not None and CASES:
        report.write_line("\nfuzz cases per operation:   cases    2xx    4xx  >=500")
        for op in sorted(CASES):
            n = [STATUSES[f"{op} {k}"] for k in ("2xx", "4xx", "5xx")]
            report.write_line(f"  {op:34s} {CASES[op]:6d} {n[0]:6d} {n[1]:6d} {n[2]:6d}")
        total = [
            sum(v for k, v in STATUSES.items() if k.endswith(s)) for s in ("2xx", "4xx", "5xx")
        ]
        report.write_line(
            f"  {'total':34s} {sum(CASES.values()):6d} " + " ".join(f"{t:6d}" for t in total)
        )


def error_format(ctx: Any, response: Any, case: Any) -> bool | None:
    """Every error is in the format of its route's API, with a message."""
    if response.status_code < 400:
        return None
    api = api_of_path(case.operation.path)
    assert_api_error(response, response.status_code, api=api)
    return True


def no_server_error(ctx: Any, response: Any, case: Any) -> bool | None:
    assert response.status_code < 500, f"{response.status_code}: {response.text[:500]}"
    return True


# The document the server serves, built without a model (test_openapi_is_what_is_served
# holds the two equal).
DOC = create_app(ServerSettings(), load_model=False).openapi()
# POST /sleep would leave the server asleep, every later generation a 503 (test_api_sleep).
schema = schemathesis.openapi.from_dict(DOC).exclude(path="/sleep")
schema.config.generation.update(max_examples=int(os.environ.get("PIPPIN_FUZZ_EXAMPLES", "12")))
schema.config.phases.coverage.enabled = os.environ.get("PIPPIN_FUZZ_COVERAGE") == "1"


def test_openapi_is_what_is_served(server: Server) -> None:
    assert httpx.get(f"{server.url}/openapi.json").json() == DOC


@schema.parametrize()
@settings(deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzz_every_operation(case: Any, server: Server) -> None:
    label = f"{case.method} {case.operation.path}"
    CASES[label] += 1
    if isinstance(case.body, dict) and isinstance(case.body.get("model"), str):
        case.body["model"] = "tiny"  # the one served model: other names are a plain 404
    # A hang raises (requests' ReadTimeout).
    response = case.call(base_url=server.url, timeout=HANG_S)
    STATUSES[f"{label} {min(response.status_code // 100, 5)}xx"] += 1
    case.validate_response(
        response,
        checks=[
            no_server_error,
            error_format,
            status_code_conformance,
            content_type_conformance,
            response_schema_conformance,
        ],
    )
