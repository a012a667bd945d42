"""The `agent` workload: sessions of a tool-using agent over one long system prompt.

Each session is what a coding agent sends: a system prompt of ``system_tokens`` tokens that
includes OpenAI ``tools`` definitions (the same for every session of a window), a user task
of ``prompt_tokens``, then ``turns`` - 1 more requests, each the conversation so far plus
the model's own previous answer (sent back as an assistant message carrying a tool call)
and that tool's result (a ``tool`` message of ``tool_tokens``). Answers are greedy and
capped at ``output_tokens``. Sessions differ from their first user message on, so they share
only the system prompt, and every request after a session's first extends that session's
previous one: a server that reuses a prefix pays only for the new tail.

The system prompt is drawn per window (from its seed), so each window starts cold: turn 1
prefills it, later turns show what the server reuses.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pippin.bench.workload import Session, Workload

# What a coding agent declares: name, description, parameters (required first).
_TOOLS: list[tuple[str, str, dict[str, str], list[str]]] = [
    (
        "read_file",
        "Read a file from the workspace and return its contents with line numbers. Use "
        "offset and limit to read part of a long file.",
        {"path": "Path of the file, relative to the workspace root.", "offset": "integer"},
        ["path"],
    ),
    (
        "write_file",
        "Create or overwrite a file in the workspace with the given contents.",
        {"path": "Path of the file to write.", "content": "The file's new contents."},
        ["path", "content"],
    ),
    (
        "edit_file",
        "Replace one exact occurrence of a string in a file. Fails if the string is missing "
        "or occurs more than once; include enough context to make it unique.",
        {
            "path": "Path of the file to edit.",
            "old_string": "The exact text to replace.",
            "new_string": "The text to put in its place.",
        },
        ["path", "old_string", "new_string"],
    ),
    (
        "list_directory",
        "List the files and folders under a directory, one per line, folders ending in a slash.",
        {"path": "The directory to list.", "depth": "integer"},
        ["path"],
    ),
    (
        "search_files",
        "Search file contents with a regular expression and return matching lines with their "
        "paths and line numbers.",
        {"pattern": "The regular expression.", "glob": "Only files matching this glob."},
        ["pattern"],
    ),
    (
        "run_command",
        "Run a shell command in the workspace and return its exit status, standard output and "
        "standard error. Long-running commands are stopped after the timeout.",
        {"command": "The command line to run.", "timeout": "integer"},
        ["command"],
    ),
    (
        "web_fetch",
        "Fetch a web page and return its text content, with markup removed.",
        {"url": "The address to fetch.", "max_length": "integer"},
        ["url"],
    ),
    (
        "todo_write",
        "Replace the task list that tracks the steps of the current job. Each item has a "
        "short description and a status.",
        {"items": "The task list, one item per line as STATUS: DESCRIPTION."},
        ["items"],
    ),
]


def tool_definitions() -> list[dict[str, Any]]:
    """All of the agent's tools as OpenAI `tools` entries."""
    out = []
    for name, description, params, required in _TOOLS:
        props = {
            k: {"type": "integer"} if v == "integer" else {"type": "string", "description": v}
            for k, v in params.items()
        }
        out.append(
            {
                "type": "function",
                "function": {
                    "name": name,
                    "description": description,
                    "parameters": {"type": "object", "properties": props, "required": required},
                },
            }
        )
    return out


def tools_within(tokens: int, count: Callable[[str], int]) -> list[dict[str, Any]]:
    """The tools, in order, while their JSON takes at most half of `tokens` (at least one):
    the rest of the system prompt is instructions. `count` gives a text's length in tokens."""
    out: list[dict[str, Any]] = []
    used = 0
    for tool in tool_definitions():
        n = count(json.dumps(tool))
        if out and used + n > tokens / 2:
            break
        out.append(tool)
        used += n
    return out


def _call(
    rng: random.Random,
    tool: dict[str, Any],
    words: Callable[[random.Random, int], str],
    session: int,
    turn: int,
) -> dict[str, Any]:
    """An assistant's call of `tool`: its required arguments filled with made-up values."""
    fn = tool["function"]
    props = fn["parameters"]["properties"]
    args = {
        k: rng.randrange(1, 500) if props[k]["type"] == "integer" else words(rng, 3)
        for k in fn["parameters"]["required"]
    }
    return {
        "id": f"call_{session}_{turn}_{rng.randrange(10**6)}",
        "type": "function",
        "function": {"name": fn["name"], "arguments": json.dumps(args)},
    }


def agent_sessions(w: Workload, n: int, seed: int | str) -> list[Session]:
    """`n` sessions of `w.turns` turns over one system prompt drawn from `seed`."""
    from pippin.bench.workload import Session, Turn, _count_tokens, _words

    rng = random.Random(f"agent|{seed}")
    wpt = w.words_per_token
    tools = tools_within(w.system_tokens, lambda text: _count_tokens(text, w.tokenizer))
    # The tools' JSON plus the template's lines about them (about 70 tokens) count in it.
    tool_tokens = sum(_count_tokens(json.dumps(t), w.tokenizer) for t in tools) + 70
    rest = max(w.system_tokens - tool_tokens, 1)
    system = f"You are a coding agent. Session rules {rng.randrange(10**6)}: " + _words(
        rng, max(round(rest * wpt) - 8, 1)
    )
    sessions = []
    for s in range(n):
        # A random number first: each session's first message differs from its first token.
        words = max(round(w.prompt_tokens.sample(rng) * wpt) - 1, 1)
        task = f"{rng.randrange(10**6)} {_words(rng, words)}"
        turns = [Turn(task, w.output_tokens.sample(rng))]
        for t in range(1, w.turns):
            call = _call(rng, rng.choice(tools), _words, s, t)
            size = max(round(w.tool_tokens.sample(rng) * wpt) - 1, 1)
            result = f"{rng.randrange(10**6)} {_words(rng, size)}"
            turns.append(Turn(result, w.output_tokens.sample(rng), call=call))
        sessions.append(Session(turns, system=system, tools=tools))
    return sessions
