"""/metrics and the per-request log line against a real `pippin serve` on a tiny model.

Counters are compared before and after a known load: N requests with fixed token counts
(``ignore_eos``), so every counter and histogram count must move by an exact amount.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from support.server_utils import Server, run_server
from support.waiting import wait_for

from pippin.bench.scrape import Samples, parse_metrics, total
from pippin.kernels.device import on_cuda
from pippin.server.app import create_app
from pippin.serving.state import ServerSettings

KEY = "sk-metrics-test"
PROMPT = "The secret prompt text that must never reach the log"


@pytest.fixture(scope="module")
def server(tiny_models: Callable[..., Path]) -> Iterator[Server]:
    with run_server(
        str(tiny_models("llama")),
        "--served-model-name",
        "tiny",
        "--max-model-len",
        "512",
        "--log-format",
        "json",
        api_key=KEY,
    ) as s:
        yield s


def scrape(server: Server) -> Samples:
    r = httpx.get(f"{server.url}/metrics", headers=server.headers(), timeout=30)
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/plain")
    return parse_metrics(r.text)


def delta(before: Samples, after: Samples, name: str, **labels: str) -> float:
    return (total(after, name, **labels) or 0.0) - (total(before, name, **labels) or 0.0)


def wait_idle(server: Server) -> Samples:
    for _ in range(200):
        s = scrape(server)
        if total(s, "pippin_requests_running") == 0 and total(s, "pippin_requests_waiting") == 0:
            return s
        time.sleep(0.05)
    raise AssertionError("the engine did not go idle")


def test_counters_and_histograms_move_by_exact_amounts(server: Server) -> None:
    client = server.client()
    before = wait_idle(server)
    chats, completions = 3, 2
    prompt_tokens = 0
    for i in range(chats):
        r = client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": f"{PROMPT} {i}"}],
            max_tokens=5,
            extra_body={"ignore_eos": True},
        )
        assert r.usage.completion_tokens == 5
        prompt_tokens += r.usage.prompt_tokens
    for i in range(completions):
        stream = client.completions.create(
            model="tiny",
            prompt=f"counting {i}",
            max_tokens=7,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        usage = [c.usage for c in stream if c.usage is not None][-1]
        assert usage.completion_tokens == 7
        prompt_tokens += usage.prompt_tokens
    after = wait_idle(server)
    n = chats + completions
    generated = chats * 5 + completions * 7

    assert delta(before, after, "pippin_generation_tokens_total") == generated
    assert delta(before, after, "pippin_prompt_tokens_total") == prompt_tokens
    assert 0 <= delta(before, after, "pippin_prompt_tokens_cached_total") <= prompt_tokens
    for hist in (
        "pippin_request_queue_time_seconds",
        "pippin_time_to_first_token_seconds",
        "pippin_time_per_output_token_seconds",
        "pippin_e2e_request_latency_seconds",
    ):
        assert delta(before, after, f"{hist}_count") == n, hist
        assert delta(before, after, f"{hist}_bucket", le="+Inf") == n, hist
        assert delta(before, after, f"{hist}_sum") > 0, hist
    # One gap per token after the first (one token per step, delivered one by one).
    assert delta(before, after, "pippin_inter_token_latency_seconds_count") == generated - n
    assert delta(before, after, "pippin_requests_finished_total", finish_reason="length") == n
    # Buckets reach minutes.
    les = {lab["le"] for lab, _ in after["pippin_e2e_request_latency_seconds_bucket"]}
    assert {"60.0", "300.0", "600.0"} <= les
    # Every request prefilled (at least one prefill step each) and decoded.
    prefill = delta(before, after, "pippin_engine_step_duration_seconds_count", phase="prefill")
    decode = delta(before, after, "pippin_engine_step_duration_seconds_count", phase="decode")
    assert 1 <= prefill <= n and decode >= max(5, 7) - 1
    assert delta(before, after, "pippin_prefix_cache_queries_total") == n
    http = "pippin_http_requests_total"
    assert delta(before, after, http, endpoint="/v1/chat/completions", status="200") == chats
    assert delta(before, after, http, endpoint="/v1/completions", status="200") == completions
    # Engine state: idle, and the KV blocks add up.
    used = total(after, "pippin_kv_blocks", tier="device", state="used")
    free = total(after, "pippin_kv_blocks", tier="device", state="free")
    assert used == 0 and free is not None and free > 0
    assert total(after, "pippin_kv_cache_usage_ratio", tier="device") == 0
    assert total(after, "pippin_preemptions_total") == 0
    # The compiled decode step is CUDA's by default: elsewhere nothing is traced.
    traces = total(after, "pippin_decode_graph_traces_total")
    seconds = total(after, "pippin_decode_graph_trace_seconds_total")
    assert (traces, seconds) == (0, 0) if not on_cuda() else traces and seconds
    for kind in ("out_of_memory", "other"):
        assert total(after, "pippin_engine_failed_steps_total", kind=kind) == 0


def test_errors_by_kind_and_status(server: Server) -> None:
    before = scrape(server)
    bad_model = {"model": "nope", "messages": [{"role": "user", "content": "x"}]}
    with server.http() as h:
        assert h.post("/v1/chat/completions", json=bad_model).status_code == 404
        bad_value = {"model": "tiny", "messages": [], "max_tokens": 1}
        assert h.post("/v1/chat/completions", json=bad_value).status_code == 400
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    after = scrape(server)
    assert delta(before, after, "pippin_request_errors_total", kind="model_not_found") == 1
    assert delta(before, after, "pippin_request_errors_total", kind="invalid_value") == 1
    assert delta(before, after, "pippin_request_errors_total", kind="invalid_api_key") == 1
    http = "pippin_http_requests_total"
    assert delta(before, after, http, endpoint="/v1/chat/completions", status="404") == 1
    assert delta(before, after, http, endpoint="/v1/chat/completions", status="400") == 1
    # Refused before routing, still labelled with the route it was for.
    assert delta(before, after, http, endpoint="/v1/models", method="GET", status="401") == 1


def test_cancelled_stream_is_counted(server: Server) -> None:
    before = wait_idle(server)
    body = {
        "model": "tiny",
        "prompt": "a long one",
        "max_tokens": 400,
        "stream": True,
        "ignore_eos": True,
    }
    with server.http() as h, h.stream("POST", "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if '"text"' in line:
                break  # leave after the first token
    for _ in range(200):
        after = scrape(server)
        if delta(before, after, "pippin_request_cancellations_total") == 1:
            break
        time.sleep(0.05)
    assert delta(before, after, "pippin_request_cancellations_total") == 1
    after = wait_idle(server)
    assert total(after, "pippin_kv_blocks", state="used") == 0


def test_metrics_need_the_key(server: Server) -> None:
    assert httpx.get(f"{server.url}/metrics").status_code == 401


def test_one_json_log_line_per_request(server: Server) -> None:
    client = server.client()
    r = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=6,
        extra_body={"ignore_eos": True},
    )
    lines = []
    for _ in range(100):
        lines = [json.loads(x) for x in server.log().splitlines() if x.startswith("{")]
        if any(x.get("request_id") == r.id for x in lines):
            break
        time.sleep(0.05)
    mine = [x for x in lines if x.get("request_id") == r.id]
    assert len(mine) == 1, mine
    line = mine[0]
    assert line["logger"] == "pippin.request" and line["level"] == "info"
    assert line["endpoint"] == "/v1/chat/completions" and line["method"] == "POST"
    assert line["status"] == 200 and line["finish_reason"] == "length"
    assert line["prompt_tokens"] == r.usage.prompt_tokens
    assert line["completion_tokens"] == 6 and line["cancelled"] is False
    for key in ("queue_s", "ttft_s", "tpot_s", "e2e_s", "duration_s"):
        assert isinstance(line[key], float) and line[key] >= 0, key
    assert line["ttft_s"] <= line["e2e_s"] <= line["duration_s"]
    # Every line of the server's log is JSON, and none has the prompt or the key.
    log = server.log()
    assert all(x.startswith("{") for x in log.splitlines() if x.strip()), log[-2000:]
    assert PROMPT not in log and KEY not in log


def _request_lines(server: Server, endpoint: str) -> list[dict[str, Any]]:
    lines = [json.loads(x) for x in server.log().splitlines() if x.startswith("{")]
    return [x for x in lines if x.get("logger") == "pippin.request" and x["endpoint"] == endpoint]


def test_every_api_logs_its_requests_at_the_default_level(server: Server) -> None:
    """One line per request at INFO for OpenAI's, Anthropic's and Ollama's routes alike
    (Ollama's /api/... went to DEBUG, out of the default log)."""
    hello = [{"role": "user", "content": "hi"}]
    calls: list[tuple[str, str, dict[str, Any] | None]] = [
        ("POST", "/api/chat", {"model": "tiny", "messages": hello, "stream": False}),
        ("POST", "/api/generate", {"model": "tiny", "prompt": "hi", "stream": False}),
        ("GET", "/api/tags", None),
        ("POST", "/v1/messages", {"model": "tiny", "max_tokens": 2, "messages": hello}),
        ("POST", "/v1/chat/completions", {"model": "tiny", "max_tokens": 2, "messages": hello}),
    ]
    before = {path: len(_request_lines(server, path)) for _, path, _ in calls}
    with server.http() as h:
        for method, path, body in calls:
            if body is not None and path.startswith("/api/"):
                body = {**body, "options": {"num_predict": 2}}
            assert h.request(method, path, json=body).status_code == 200, path
    for _, path, _ in calls:
        lines = wait_for(
            lambda path=path: _request_lines(server, path)[before[path] :], f"{path}'s line"
        )
        assert len(lines) == 1, lines
        assert lines[0]["level"] == "info" and lines[0]["status"] == 200, lines


def test_the_page_and_its_icon_count_no_error(server: Server) -> None:
    """A browser loads the page, its files and the site's icon (/favicon.ico, unless the
    page names one): none of it is an error (the icon was a not_found per page load)."""
    before = scrape(server)
    login = ("me", KEY)  # a browser's login: HTTP Basic, the key as the password
    for path in ("/", "/ui/app.js", "/ui/style.css", "/ui/favicon.svg", "/favicon.ico"):
        r = httpx.get(server.url + path, auth=login)
        assert r.status_code == 200, path
    assert r.headers["content-type"].startswith("image/svg+xml") and b"<svg" in r.content
    assert 'rel="icon" href="/ui/favicon.svg"' in httpx.get(server.url + "/", auth=login).text
    after = scrape(server)
    assert delta(before, after, "pippin_request_errors_total") == 0
    assert delta(before, after, "pippin_http_requests_total", endpoint="/favicon.ico") == 1


def test_apps_have_their_own_registries() -> None:
    """Two apps in one process: no clash (the global registry would refuse the second)."""
    a = TestClient(create_app(ServerSettings(), load_model=False))
    b = TestClient(create_app(ServerSettings(), load_model=False))
    a.get("/v1/models")
    text_a, text_b = a.get("/metrics").text, b.get("/metrics").text
    assert total(parse_metrics(text_a), "pippin_http_requests_total", endpoint="/v1/models") == 1
    assert total(parse_metrics(text_b), "pippin_http_requests_total", endpoint="/v1/models") is None


def test_no_metrics_flag() -> None:
    app = create_app(ServerSettings(metrics=False), load_model=False)
    assert TestClient(app).get("/metrics").status_code == 404


def test_vllm_named_gauges_for_routers(server: Server) -> None:
    """Routers built for vLLM balance on these names: they must carry pippin's values,
    per model (`model_name`), and see a request running."""
    idle = wait_idle(server)
    assert total(idle, "vllm:num_requests_running", model_name="tiny") == 0
    assert total(idle, "vllm:num_requests_waiting", model_name="tiny") == 0
    client = server.client()
    stream = client.completions.create(
        model="tiny", prompt="busy", max_tokens=400, stream=True, extra_body={"ignore_eos": True}
    )
    chunks = iter(stream)
    next(chunks)
    busy = scrape(server)
    stream.close()
    assert total(busy, "vllm:num_requests_running", model_name="tiny") == 1
    usage = total(busy, "vllm:kv_cache_usage_perc", model_name="tiny")
    assert usage is not None and 0 < usage <= 1
    assert total(busy, "vllm:gpu_cache_usage_perc", model_name="tiny") == usage
    assert usage == total(busy, "pippin_kv_cache_usage_ratio", model="tiny")
    hit_rate = total(busy, "vllm:gpu_prefix_cache_hit_rate", model_name="tiny")
    assert hit_rate == total(busy, "pippin_prefix_cache_hit_ratio", model="tiny")
