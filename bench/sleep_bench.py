"""Sleep mode: how long waking takes (level 1 and level 2) against a cold start, and the
engine's memory before and after sleeping, over HTTP.

- **cold start**: `pippin serve` started until /health answers 200 (process start,
  imports, model load, KV pool), then the first answer.
- **wake (level N)**: POST /sleep?level=N, then the time POST /wake_up takes, then the
  first answer after it.

Memory is the engine's `mlx_active_bytes` (MLX's allocator, `mx.get_active_memory()`)
from /v1/engine/stats, awake and asleep (level 2 unloads the model: no engine to ask).
Run by hand, never as a test:

    .venv/bin/python bench/sleep_bench.py --reps 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import httpx

from pippin.bench.servers import Server, pippin_server
from pippin.store.loader import default_model_path

MODEL = "m"


def answer(server: Server) -> tuple[float, str]:
    """(seconds, text) of one short greedy chat answer."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_tokens": 8,
        "temperature": 0,
    }
    t0 = time.perf_counter()
    r = httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=600)
    r.raise_for_status()
    return time.perf_counter() - t0, r.json()["choices"][0]["message"]["content"]


def post(server: Server, path: str, **params: str) -> float:
    t0 = time.perf_counter()
    httpx.post(f"{server.url}{path}", params=params, timeout=600).raise_for_status()
    return time.perf_counter() - t0


def stats(server: Server) -> dict[str, Any]:
    return httpx.get(f"{server.url}/v1/engine/stats", params={"model": MODEL}).json()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=str(default_model_path()))
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--engine-process", action="store_true")
    args = p.parse_args()
    extra = ["--served-model-name", MODEL]
    extra.append("--engine-process" if args.engine_process else "--no-engine-process")
    cold: list[float] = []
    first_cold: list[float] = []
    wake: dict[int, list[float]] = {1: [], 2: []}
    first_after: dict[int, list[float]] = {1: [], 2: []}
    memory: dict[str, int] = {}
    for _ in range(args.reps):
        t0 = time.perf_counter()
        with pippin_server(*extra, model=args.model) as server:
            cold.append(time.perf_counter() - t0)
            seconds, text = answer(server)
            first_cold.append(seconds)
            for level in (1, 2):
                before = stats(server)
                post(server, "/sleep", level=str(level))
                asleep = stats(server)
                if level == 1 or not memory:
                    memory.update(
                        {
                            "awake_active_bytes": before["mlx_active_bytes"],
                            "awake_kv_bytes": before["kv_bytes"],
                            "awake_weight_bytes": before["weight_bytes"],
                        }
                    )
                if level == 1:
                    memory["level1_active_bytes"] = asleep["mlx_active_bytes"]
                    memory["level1_kv_bytes"] = asleep["kv_bytes"]
                wake[level].append(post(server, "/wake_up"))
                seconds, again = answer(server)
                first_after[level].append(seconds)
                assert again == text, (again, text)

    def med(xs: list[float]) -> float:
        return round(statistics.median(xs), 3)

    print(
        json.dumps(
            {
                "model": args.model,
                "engine_process": args.engine_process,
                "reps": args.reps,
                "cold_start_s": med(cold),
                "first_answer_after_cold_s": med(first_cold),
                "wake_level1_s": med(wake[1]),
                "first_answer_after_level1_s": med(first_after[1]),
                "wake_level2_s": med(wake[2]),
                "first_answer_after_level2_s": med(first_after[2]),
                **memory,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
