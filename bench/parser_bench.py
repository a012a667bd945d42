"""Cost of the output parsers per streamed piece, and that it stays flat with length.

    .venv/bin/python bench/parser_bench.py

Feeds a long answer (plain text, then one tool call with large arguments) to each
parser in 4-character pieces, as a detokenizer hands them out, and prints the mean
microseconds per piece for the first and the last quarter of the output: equal numbers
mean O(1) work per piece, whatever the length so far.
"""

from __future__ import annotations

import json
import time

from pippin.chat.output import OutputParser
from pippin.chat.reasoning import ThinkParser
from pippin.chat.tool_parsers import get_tool_parser

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "write_file",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}, "text": {"type": "string"}},
            },
        },
    }
]
TEXT = "The quick brown fox jumps over the lazy dog. " * 400
ARGS = {"path": "/tmp/a.txt", "text": "lorem ipsum dolor sit amet " * 800}
CALLS = {
    "hermes": '<tool_call>\n{"name": "write_file", "arguments": '
    + json.dumps(ARGS)
    + "}\n</tool_call>",
    "qwen3_coder": "<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.txt\n"
    f"</parameter>\n<parameter=text>\n{ARGS['text']}\n</parameter>\n</function>\n</tool_call>",
    "mistral": f"[TOOL_CALLS]write_file[ARGS]{json.dumps(ARGS)}",
    "llama3_json": "",  # calls only at the start: text alone
}


def run(name: str) -> tuple[float, float, int]:
    reasoning = "<think>\n" + TEXT + "</think>\n\n"
    out = reasoning + TEXT + CALLS[name]
    pieces = [out[i : i + 4] for i in range(0, len(out), 4)]
    parser = OutputParser(ThinkParser(), get_tool_parser(name)(TOOLS))
    times = []
    for p in pieces:
        t0 = time.perf_counter()
        parser.feed(p)
        times.append(time.perf_counter() - t0)
    parser.finish()
    q = len(times) // 4
    return sum(times[:q]) / q * 1e6, sum(times[-q:]) / q * 1e6, len(pieces)


if __name__ == "__main__":
    print(f"{'parser':<14} {'pieces':>7} {'first 1/4 us/piece':>19} {'last 1/4 us/piece':>18}")
    for name in CALLS:
        first, last, n = run(name)
        print(f"{name:<14} {n:>7} {first:>19.1f} {last:>18.1f}")
