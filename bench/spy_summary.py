"""Summarise a py-spy raw profile (`py-spy record -f raw --threads [--subprocesses]`), as
`bench/loop_cost.py --py-spy` writes: samples per thread, then each busy thread's top
lines by own samples (the innermost frame: where the time went, C calls included).

    python bench/spy_summary.py $OUT/spy-server.txt [--top 20]
"""

from __future__ import annotations

import argparse
import collections
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("path")
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--threads", type=int, default=3, help="how many of the busiest threads")
    args = ap.parse_args()
    per_thread: collections.Counter[str] = collections.Counter()
    lines: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
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
    total = sum(per_thread.values())
    print(f"{total} samples")
    for thread, n in per_thread.most_common():
        print(f"{n:7d}  {thread}")
    for thread, n in per_thread.most_common(args.threads):
        print(f"\n== {thread}: {n} samples")
        for frame, k in lines[thread].most_common(args.top):
            print(f"{k:7d} {k / n:6.1%}  {frame}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
