"""pippin against mlx_vlm.server on image requests: tokens/s, TTFT, and a second turn's TTFT.

Each server starts as a subprocess on a free port (one at a time, the other not running),
gets `--requests` streaming chat requests at `--concurrency`, each with its own image
(Pillow-made, 1024x768 by default, the same bytes for every server; each server resizes it
as its processor does), and then a two-turn conversation about one fresh image: the second
turn's TTFT over the first's shows what a cached image saves.

pippin gets ``ignore_eos``; mlx_vlm.server has no such field, so it gets a ``logit_bias`` of
-100 on the model's end-of-sequence ids, which makes it run to ``max_tokens`` too. The table
reports the tokens each server actually produced. The model is a random-weight Qwen2.5-VL
with Qwen's real vocabulary (`pippin.bench.vlm_models`: `--build-tiny` for the CPU,
`--build-shape qwen2.5-vl-3b` for the GPU) or any Qwen2.5-VL-family folder (`--model`).
Results: docs/benchmarks.md.

  CPU:  python bench/vision_bench.py --build-tiny --concurrency 4 --requests 16 --output-tokens 64
  GPU:  python bench/vision_bench.py --build-shape qwen2.5-vl-3b --concurrency 1 16 64 \\
            --requests 64 --output-tokens 256
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pippin.bench.client import RequestResult, stream_request
from pippin.bench.servers import Server, ServerSpec, make_server, package_version, resolve_blas
from pippin.bench.stats import percentile
from pippin.bench.vlm_models import build_qwen25_vl


def make_image(seed: int, size: tuple[int, int] = (1024, 768)) -> bytes:
    """A PNG: seeded 32x24 colour blocks scaled up (distinct per seed, small to send)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    small = rng.integers(0, 256, size=(24, 32, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize(size, Image.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def image_part(png: bytes) -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    return {"type": "image_url", "image_url": {"url": url}}


def eos_ids(model: Path) -> list[int]:
    cfg = json.loads((model / "config.json").read_text())
    ids: set[int] = set()
    for src in (cfg, cfg.get("text_config") or {}):
        e = src.get("eos_token_id")
        ids.update(e if isinstance(e, list) else [e] if e is not None else [])
    gen = model / "generation_config.json"
    if gen.exists():
        e = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(e if isinstance(e, list) else [e] if e is not None else [])
    return sorted(ids)


def body(kind: str, messages: list[dict[str, Any]], tokens: int, eos: list[int]) -> dict:
    b: dict[str, Any] = {
        "model": "default",
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if kind == "pippin":
        b["ignore_eos"] = True
    else:
        b["logit_bias"] = {str(i): -100.0 for i in eos}
    return b


def make_vision_server(kind: str, model: Path, log_dir: Path) -> Server:
    """pippin or mlx_vlm.server on `model`, as `pippin bench --serve` starts servers (the
    same BLAS for both on Linux, pippin's MLX settings not passed to the peer)."""
    if kind == "pippin":
        spec = ServerSpec(kind, "pippin", str(model), ["--served-model-name", "default"])
    elif kind == "mlx_vlm":
        # A local folder is loaded as is (no Hub look-up); the model field must name it.
        args = ["-m", "mlx_vlm.server", "--model", str(model), "--host", "127.0.0.1"]
        spec = ServerSpec(kind, "cmd", sys.executable, [*args, "--port", "{port}"])
    else:
        raise SystemExit(f"unknown server {kind!r} (pippin, mlx_vlm)")
    server = make_server(spec, log_dir, blas=resolve_blas("auto"))
    if kind == "mlx_vlm":
        server.version = package_version("mlx-vlm", sys.executable)
        server.model = str(model)
    return server


@dataclass
class Row:
    server: str
    concurrency: int
    requests: int
    failed: int
    out_tokens: int
    out_tokens_min: int
    tok_s: float
    ttft_p50: float | None
    ttft_p99: float | None
    prompt_tokens: int | None
    turn1_ttft: float | None = None
    turn2_ttft: float | None = None
    turn2_cached: int | None = None


async def _load(
    url: str, model_field: str, bodies: list[dict], concurrency: int
) -> tuple[list[RequestResult], float]:
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0), limits=limits) as client:

        async def one(b: dict) -> RequestResult:
            async with sem:
                return await stream_request(client, url, {**b, "model": model_field})

        t0 = time.perf_counter()
        res = await asyncio.gather(*(one(b) for b in bodies))
        return list(res), time.perf_counter() - t0


async def _two_turns(
    url: str, model_field: str, kind: str, png: bytes, tokens: int, eos: list[int]
) -> tuple[RequestResult, RequestResult]:
    first = [{"role": "user", "content": [image_part(png), {"type": "text", "text": "What?"}]}]
    async with httpx.AsyncClient(timeout=httpx.Timeout(3600.0)) as client:
        b1 = {**body(kind, first, tokens, eos), "model": model_field}
        r1 = await stream_request(client, url, b1)
        second = [
            *first,
            {"role": "assistant", "content": r1.text or "ok"},
            {"role": "user", "content": "And the colours?"},
        ]
        b2 = {**body(kind, second, tokens, eos), "model": model_field}
        r2 = await stream_request(client, url, b2)
    return r1, r2


def model_field_of(server: Server) -> str:
    if server.spec.kind == "pippin":
        return "default"
    return str(server.model)


def run_server(
    kind: str,
    model: Path,
    log_dir: Path,
    levels: list[int],
    n_requests: int,
    tokens: int,
    images: list[bytes],
    turn_image: bytes,
    warmup: bytes,
) -> list[Row]:
    eos = eos_ids(model)
    server = make_vision_server(kind, model, log_dir)
    server.start(timeout=600)
    rows: list[Row] = []
    try:
        url = server.url + "/v1/chat/completions"
        mf = model_field_of(server)
        # One warm-up request (compiles, first allocations) on an image no one else uses.
        warm = [{"role": "user", "content": [image_part(warmup), {"type": "text", "text": "Hi"}]}]
        w = asyncio.run(_load(url, mf, [body(kind, warm, 4, eos)], 1))[0][0]
        if not w.ok:
            raise RuntimeError(f"{kind} warm-up failed: {w.error}\n{server.log_tail()}")
        for li, conc in enumerate(levels):
            bodies = []
            for i in range(n_requests):
                text = f"Describe picture {li}-{i} in detail."
                png = images[(li * n_requests + i) % len(images)]
                msgs = [
                    {"role": "user", "content": [image_part(png), {"type": "text", "text": text}]}
                ]
                bodies.append(body(kind, msgs, tokens, eos))
            results, wall = asyncio.run(_load(url, mf, bodies, conc))
            ok = [r for r in results if r.ok]
            ttfts = [r.ttft for r in ok if r.ttft is not None]
            counts = [r.output_tokens for r in ok]
            prompts = [r.prompt_tokens for r in ok if r.prompt_tokens is not None]
            errs = {r.error for r in results if r.error}
            if errs:
                print(f"{kind} c={conc}: errors {sorted(errs)[:3]}", file=sys.stderr)
            rows.append(
                Row(
                    server=kind,
                    concurrency=conc,
                    requests=len(results),
                    failed=len(results) - len(ok),
                    out_tokens=sum(counts),
                    out_tokens_min=min(counts) if counts else 0,
                    tok_s=sum(counts) / wall,
                    ttft_p50=percentile(ttfts, 50),
                    ttft_p99=percentile(ttfts, 99),
                    prompt_tokens=round(statistics.mean(prompts)) if prompts else None,
                )
            )
        r1, r2 = asyncio.run(_two_turns(url, mf, kind, turn_image, tokens, eos))
        for row in rows:
            row.turn1_ttft, row.turn2_ttft, row.turn2_cached = r1.ttft, r2.ttft, r2.cached_tokens
    finally:
        server.stop()
    return rows


def build_model(args: argparse.Namespace, root: Path) -> Path:
    if args.model:
        return Path(args.model)
    return build_qwen25_vl(root / "qwen2_5_vl", args.build_shape or "tiny")


def markdown(rows: list[Row]) -> str:
    ms = lambda x: "-" if x is None else f"{x * 1000:,.0f}"  # noqa: E731
    lines = [
        "| server | conc | requests (failed) | prompt tok | out tok (min/req) | tok/s "
        "| TTFT p50 / p99 ms | turn 2 / turn 1 TTFT ms | turn-2 cached |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = (
            f"{ms(r.turn2_ttft)} / {ms(r.turn1_ttft)} = {r.turn2_ttft / r.turn1_ttft:.2f}"
            if r.turn1_ttft and r.turn2_ttft
            else "-"
        )
        lines.append(
            f"| {r.server} | {r.concurrency} | {r.requests} ({r.failed}) | {r.prompt_tokens} "
            f"| {r.out_tokens} ({r.out_tokens_min}) | {r.tok_s:,.1f} "
            f"| {ms(r.ttft_p50)} / {ms(r.ttft_p99)} | {ratio} | {r.turn2_cached} |"
        )
    by = {(r.server, r.concurrency): r for r in rows}
    for (s, c), r in by.items():
        other = by.get(("mlx_vlm", c))
        if s == "pippin" and other and other.tok_s:
            lines.append(f"\npippin / mlx_vlm tok/s at {c}: **{r.tok_s / other.tok_s:.2f}x**")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--model", help="a local Qwen2.5-VL-family checkpoint folder")
    g.add_argument("--build-tiny", action="store_true", help="a tiny random-weight Qwen2.5-VL")
    g.add_argument(
        "--build-shape",
        choices=["qwen2.5-vl-3b"],
        help="random bf16 weights of this model's configuration",
    )
    p.add_argument("--concurrency", type=int, nargs="+", default=[4])
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--servers", default="pippin,mlx_vlm")
    p.add_argument("--image-size", default="1024x768")
    p.add_argument("--json", help="write the rows here too")
    args = p.parse_args(argv)
    size = tuple(int(x) for x in args.image_size.split("x"))
    with tempfile.TemporaryDirectory(prefix="vision-bench-") as tmp:
        root = Path(tmp)
        model = build_model(args, root)
        n = args.requests * len(args.concurrency)
        images = [make_image(i, size) for i in range(n)]
        turn_image, warmup = make_image(10**6, size), make_image(10**6 + 1, size)
        rows: list[Row] = []
        for kind in args.servers.split(","):
            rows += run_server(
                kind,
                model,
                root,
                args.concurrency,
                args.requests,
                args.output_tokens,
                images,
                turn_image,
                warmup,
            )
    print(markdown(rows))
    if args.json:
        Path(args.json).write_text(json.dumps([r.__dict__ for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
