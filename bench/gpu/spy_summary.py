"""Summarise a py-spy raw profile (`py-spy record -f raw --threads [--subprocesses]`), as
`bench/gpu/loop_cost.py --py-spy` writes: samples per thread, then each busy thread's top
lines by own samples (the innermost frame: where the time went, C calls included).

    python bench/gpu/spy_summary.py $OUT/spy-server.txt [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import re
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--threads", type=int, default=3, help="how many of the busiest threads")
    ap.add_argument(
        "--inclusive",
        type=int,
        default=0,
        help="also each busy thread's top N functions by "
        "samples anywhere in the stack (time in them and what they call)",
    )
    args = ap.parse_args()
    per_thread: collections.Counter[str] = collections.Counter()
    lines: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    within: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    with open(args.path) as f:
        for row in f:
            stack, _, n = row.rstrip("\n").rpartition(" ")
            frames = stack.split(";")
            # "process PID:cmdline" frames (with --subprocesses) name the process.
            procs = [fr.split(":", 1)[0] for fr in frames if fr.startswith("process ")]
            frames = [fr for fr in frames if not fr.startswith("process ")]
            if not frames:
                continue
            thread = " / ".join([*procs[-1:], frames[0]])
            per_thread[thread] += int(n)
            lines[thread][frames[-1]] += int(n)
            for fn in {_function(fr) for fr in frames[1:]}:
                within[thread][fn] += int(n)
    total = sum(per_thread.values())
    print(f"{total} samples")
    for thread, n in per_thread.most_common():
        print(f"{n:7d}  {thread}")
    for thread, n in per_thread.most_common(args.threads):
        print(f"\n== {thread}: {n} samples")
        for frame, k in lines[thread].most_common(args.top):
            print(f"{k:7d} {k / n:6.1%}  {frame}")
        if args.inclusive:
            print(f"-- {thread}: samples within each function")
            for fn, k in within[thread].most_common(args.inclusive):
                print(f"{k:7d} {k / n:6.1%}  {fn}")
    return 0


def _function(frame: str) -> str:
    """A frame without its line number: `name (file:line)` -> `name (file)`."""
    return re.sub(r":\d+\)$", ")", frame)


if __name__ == "__main__":
    sys.exit(main())
