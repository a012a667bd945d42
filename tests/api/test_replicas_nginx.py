"""The replicas example of docs/deployment.md, as written: two `pippin serve` processes
behind NGINX with `docs/deployment/nginx.conf` (only its ports changed), driven with the
openai SDK through NGINX.

A session (its X-Session-ID) stays on one replica, so its second turn finds its first
turn's KV in that replica's prefix cache; sessions spread over both replicas; when the
session's replica goes away, its requests are served by the other one. Skipped when no
`nginx` binary is installed (Debian: `apt-get install nginx-light`).
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from support.server_utils import Server, free_port, run_server

from pippin.bench.scrape import parse_metrics, total

CONF = Path(__file__).parents[2] / "docs" / "deployment" / "nginx.conf"
NGINX = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)

pytestmark = pytest.mark.skipif(
    NGINX is None, reason="no nginx binary (Debian: apt-get install nginx-light)"
)


@pytest.fixture(scope="module")
def replicas(tiny_models: Callable[..., Path]) -> Iterator[list[Server]]:
    model = str(tiny_models("llama"))
    args = (model, "--served-model-name", "tiny", "--max-model-len", "512")
    with run_server(*args) as a, run_server(*args) as b:
        yield [a, b]


@pytest.fixture(scope="module")
def router(replicas: list[Server], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    assert NGINX is not None
    work = tmp_path_factory.mktemp("nginx")
    port = free_port()
    text = CONF.read_text()
    for old, server in zip(("127.0.0.1:8001", "127.0.0.1:8002"), replicas):
        assert old in text
        text = text.replace(old, server.url.removeprefix("http://"))
    assert "listen 127.0.0.1:8000;" in text
    text = text.replace("listen 127.0.0.1:8000;", f"listen 127.0.0.1:{port};")
    # Temporary files under the test's folder, not the system's.
    text = text.replace(
        "http {",
        "http {\n"
        + "".join(
            f"    {kind}_temp_path {work / kind};\n"
            for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
        ),
        1,
    )
    conf = work / "nginx.conf"
    conf.write_text(text)
    proc = subprocess.Popen(
        [
            NGINX,
            "-p",
            str(work),
            "-c",
            str(conf),
            "-g",
            f"daemon off; pid {work / 'nginx.pid'}; error_log {work / 'error.log'};",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        for _ in range(100):
            try:
                httpx.get(f"{url}/health", timeout=2)
                break
            except httpx.HTTPError:
                assert proc.poll() is None, (work / "error.log").read_text()
                time.sleep(0.1)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _served(server: Server) -> float:
    r = httpx.get(f"{server.url}/metrics", timeout=10)
    samples = parse_metrics(r.text)
    return total(samples, "pippin_http_requests_total", endpoint="/v1/chat/completions") or 0.0


def _chat(router: str, session: str, messages: list[dict[str, str]]) -> dict:
    import openai

    client = openai.OpenAI(
        base_url=f"{router}/v1",
        api_key="none",
        default_headers={"X-Session-ID": session},
        max_retries=0,
    )
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0)
    return r.model_dump()


def test_a_session_stays_on_one_replica_and_hits_its_prefix_cache(
    replicas: list[Server], router: str
) -> None:
    before = [_served(s) for s in replicas]
    turn1 = [{"role": "user", "content": "a long first question about caching " * 8}]
    first = _chat(router, "alice", turn1)
    turn2 = [
        *turn1,
        {"role": "assistant", "content": first["choices"][0]["message"]["content"]},
        {"role": "user", "content": "and a follow-up"},
    ]
    second = _chat(router, "alice", turn2)
    for _ in range(3):
        _chat(router, "alice", turn1)
    moved = [_served(s) - b for s, b in zip(replicas, before)]
    assert sorted(moved) == [0, 5]  # every turn on one replica
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0


def test_sessions_spread_over_both_replicas(replicas: list[Server], router: str) -> None:
    before = [_served(s) for s in replicas]
    for i in range(16):
        _chat(router, f"session-{i}", [{"role": "user", "content": "hi"}])
    moved = [_served(s) - b for s, b in zip(replicas, before)]
    assert sum(moved) == 16 and min(moved) > 0


def test_a_replica_gone_sends_its_sessions_to_the_other(
    replicas: list[Server], router: str
) -> None:
    before = [_served(s) for s in replicas]
    _chat(router, "bob", [{"role": "user", "content": "hello"}])
    home = 0 if _served(replicas[0]) > before[0] else 1
    gone, other = replicas[home], replicas[1 - home]
    gone.proc.terminate()
    gone.proc.wait(30)
    n = _served(other)
    for _ in range(3):
        r = _chat(router, "bob", [{"role": "user", "content": "hello again"}])
        assert r["choices"][0]["message"]["content"] is not None
    assert _served(other) - n == 3
