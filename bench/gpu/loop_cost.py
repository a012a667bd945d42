"""CPU time per streamed token of the server's event loop and of its other threads (Linux).

Starts `pippin serve MODEL` with the given extra flags (`pippin.bench.servers`), loads
it with `pippin bench` (streaming chat, 64 clients by default), and over a window in the
middle of the run reads each thread's CPU time from /proc and the tokens generated from
/metrics. The event loop is the main thread; the engine thread and MLX's workers are the
others (with --engine-process, those of the engine process).

    python bench/gpu/loop_cost.py /tmp/pm/micro -- --stream-interval-ms 0
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from checkout import REPO_ROOT  # noqa: F401  (first: src/ on the path)

from pippin.bench.scrape import parse_metrics, total
from pippin.bench.servers import pippin_server

PY = sys.executable


def thread_cpu(pid: int) -> dict[int, float]:
    """CPU seconds (user + system) of each thread of `pid`."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        out[int(task.name)] = (int(fields[11]) + int(fields[12])) / tick
    return out


def metric(url: str, name: str) -> float:
    """The sum over its label sets (pippin labels each series with its model)."""
    text = urllib.request.urlopen(f"{url}/metrics").read().decode()
    return total(parse_metrics(text), name) or 0.0


def generated(url: str) -> float:
    return metric(url, "pippin_generation_tokens_total")


def tree_threads(pid: int) -> dict[int, float]:
    """CPU seconds of each thread of `pid` and of the processes under it (an engine
    process started with --engine-process, a bench's client processes)."""
    out: dict[int, float] = {}
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            out.update(thread_cpu(p))
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except FileNotFoundError:
            pass
    return out


def process_cpu(pid: int) -> float:
    """CPU seconds of `pid` and the processes under it (the bench's client processes)."""
    return sum(tree_threads(pid).values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model")
    ap.add_argument("serve_args", nargs="*", help="extra `pippin serve` flags, after --")
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--window", type=float, default=10.0)
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--output-tokens", type=int, default=400)
    ap.add_argument("--py-spy", type=Path, help="also record the server with py-spy into this file")
    ap.add_argument(
        "--native", action="store_true", help="py-spy --native: MLX's C++ frames too (slower)"
    )
    args = ap.parse_args()
    with pippin_server(*args.serve_args, model=args.model) as server:
        assert server.proc is not None
        return measure(args, server.url, server.proc.pid)


def measure(args: argparse.Namespace, url: str, pid: int) -> int:
    """Load the server at `url` (process `pid`) and read the window."""
    load = None
    try:
        load = subprocess.Popen(
            [
                PY,
                "-m",
                "pippin.cli",
                "bench",
                "--url",
                url,
                "--concurrency",
                str(args.concurrency),
                "--prompt-tokens",
                str(args.prompt_tokens),
                "--output-tokens",
                str(args.output_tokens),
                "--num-requests",
                str(args.concurrency * 5),
                "--warmup",
                "4",
                "--no-progress",
            ],
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # its client processes go with it
        )
        # The window starts once the load is up (the first steps compile kernels).
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if metric(url, "pippin_requests_running") >= 0.9 * args.concurrency:
                break
            time.sleep(1)
        time.sleep(5)
        c0, t0 = tree_threads(pid), generated(url)
        spy = None
        if args.py_spy:
            # Samples every thread (idle ones too): --gil would show only the GIL's holder.
            spy = subprocess.Popen(
                [
                    "py-spy",
                    "record",
                    "-p",
                    str(pid),
                    "-d",
                    str(int(args.window)),
                    "-r",
                    "250",
                    "-f",
                    "raw",
                    "-o",
                    str(args.py_spy),
                    "--threads",
                    "--subprocesses",
                    # py-spy cannot unwind C++ frames of a running process.
                    *(["--native"] if args.native else ["--nonblocking"]),
                ],
                stdout=subprocess.DEVNULL,
            )
        steps0, client0 = metric(url, "pippin_engine_steps_total"), process_cpu(load.pid)
        running = []
        end = time.monotonic() + args.window
        while time.monotonic() < end:
            running.append(metric(url, "pippin_requests_running"))
            time.sleep(2.0)  # a scrape costs the event loop CPU: not too often
        c1, t1 = tree_threads(pid), generated(url)
        steps = metric(url, "pippin_engine_steps_total") - steps0
        client = process_cpu(load.pid) - client0
        if spy is not None:
            spy.wait()
    finally:
        # The window is measured; the rest of the load is not needed.
        if load is not None:
            os.killpg(load.pid, signal.SIGKILL)
            load.wait()
    tokens = t1 - t0
    per = {tid: (c1[tid] - c0.get(tid, 0.0)) / tokens * 1e6 for tid in c1}
    others = sorted((v for tid, v in per.items() if tid != pid), reverse=True)
    print(
        f"{tokens / args.window:.0f} tok/s; CPU µs per token: event loop {per.get(pid, 0):.1f}, "
        f"other threads {', '.join(f'{v:.1f}' for v in others if v >= 0.5)}; "
        f"client {client / tokens * 1e6:.1f}"
    )
    print(
        f"{steps / args.window:.1f} steps/s, {tokens / max(steps, 1):.1f} tokens a step, "
        f"{sum(running) / len(running):.1f} requests running on average"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
