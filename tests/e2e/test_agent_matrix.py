"""Seven coding agents, each installed from its registry at a pinned version, against one
pippin serving the real Qwen2.5-Coder-0.5B GGUF, greedy: Claude Code (Anthropic Messages),
Codex CLI (Responses), and OpenCode, Qwen Code, Aider, Cline and Continue (OpenAI chat
completions), configured as docs/clients.md says.

Each agent gets one small task in its own scratch folder, reading a file and copying a
line of it (Codex, Aider, Cline, Continue) or writing a file with given content (Claude
Code, OpenCode, Qwen Code), with only the one tool the task needs, its turns and answers
bounded (its own turn bound where it has one, MAX_TOKENS), nothing to approve outside that
folder and nothing phoning home. Every request goes through a recording proxy (one path
prefix per agent): each must be answered 200 with a well-formed body (a stream framed and
ended as its API ends one); a failure names the agent, the request and the response. The
agents run side by side, so the module takes about as long as the slowest agent: under
3 minutes on 2 CPU cores (the server's start included). A task that fails side by side
(and is not a known limit of the model) runs again alone, whose outcome counts: see
`matrix`.

The time goes to reading prompts and writing answers, seven at once on 2 cores (alone the
0.5B model reads about 250 prompt tokens/s and writes 5-6 tokens/s): so each agent's own
system prompt and tool list, which run to 1-9k tokens (Qwen Code's twenty tools 9.3k,
Cline's twenty-five 4.5k, Codex's skills and tools 2.1k), are cut through its own options
to 0.15-1k tokens, every answer is bounded, and later turns reuse the earlier turns'
prefix from the cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.npm_tools import CLAUDE_CODE, CODEX, npm_bin, pip_bin
from support.recording_proxy import RecordingProxy, recording_proxy
from support.server_utils import run_server

OPENCODE = "opencode-ai@1.18.33"
QWEN_CODE = "@qwen-code/qwen-code@0.24.4"
CLINE = "cline@3.0.65"
CONTINUE = "@continuedev/cli@1.5.47"
AIDER = "aider-chat==0.86.2"

KEY = "sk-agents"
MODEL = "qwen"
# Enough for each agent's prompt and its answers, well under the model's 32k.
CONTEXT = 32768
# Each answer's bound: set through the agent where it lets it be set, and the server's cap
# (--max-tokens) for those that send none (Codex, Cline, Aider). These tasks' tool calls (a
# file name, one short line) fit; more only lengthens the answers of an agent the model
# loops with (at 192 both of Codex's answers ran to the bound; Codex and Continue took 387 s
# and 472 s in the whole suite, sharing its 2 cores).
MAX_TOKENS = 128
TURNS = 2  # the agent's own turn bound, where it has one: the tool call, then the answer
SYSTEM = "You are a coding agent. Use the tools to read and write files in the current folder."

NOTES = "red fox\ngreen tree\nblue whale 7\nyellow sun\n"
THIRD_LINE = "blue whale 7"
# The 0.5B model answers "Read notes.txt and ..." from its imagination more often than it
# reads the file; told which tool to use, it uses it.
READ = "Use the {tool} tool on notes.txt, then copy its third line."
WRITE = "Use the {tool} tool to create hello.txt containing exactly: pippin"
# A safety net, not the bound: each agent's own turn bound and MAX_TOKENS end its task
# (about 1-5 minutes with all seven side by side on 2 cores). Codex, Cline and Continue
# have no turn bound; with this model they end by themselves within three requests.
TASK_TIMEOUT = 480

# Tasks the 0.5B model itself fails with an agent, greedy, while pippin answers every
# request well: what it does instead. The protocol checks still hold for these agents; a
# task here that passes is no failure.
MODEL_LIMITS: dict[tuple[str, str], str] = {
    ("codex", "read"): "codex: the model asks exec_command for require_escalated sandbox "
    "permissions, which Codex refuses, and repeats it",
    ("cline", "read"): "cline: after read_files the model calls it again instead of answering",
    ("continue", "read"): "continue: after Read the model repeats the call as text",
}


@dataclass
class Spec:
    """How one agent is installed and run: `command(exe, base, home, work, prompt)` gives
    the argv and the environment additions; `answer(stdout, home)` its final reply; its one
    task ("read" or "write") and the prompt for it, which names the agent's own tool."""

    name: str
    install: Callable[[], Path]
    command: Callable[[Path, str, Path, Path, str], tuple[list[str], dict[str, str]]]
    answer: Callable[[str, Path], str]
    task: str
    prompt: str


@dataclass
class Outcome:
    task: str  # "read" or "write"
    seconds: float
    returncode: int | None
    answer: str
    output: str  # the end of stdout and stderr
    problem: str | None = None  # what the check found wrong, None: the task was done
    killed_at: float | None = None  # time.monotonic() when TASK_TIMEOUT stopped the agent


@dataclass
class AgentRun:
    spec: Spec
    skipped: str | None = None
    outcome: Outcome | None = None
    beside: Outcome | None = None  # the failed side-by-side run, where it ran again alone


def _json_lines(out: str) -> Iterator[dict[str, object]]:
    for line in out.splitlines():
        try:
            obj = json.loads(line)
        except ValueError:
            continue
        if isinstance(obj, dict):
            yield obj


# --- Claude Code: Anthropic Messages ------------------------------------------------------


def claude(exe: Path, base: str, home: Path, work: Path, task: str) -> tuple[list[str], dict]:
    env = {
        "ANTHROPIC_BASE_URL": base,
        "ANTHROPIC_API_KEY": KEY,
        "DISABLE_TELEMETRY": "1",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "CLAUDE_CODE_MAX_OUTPUT_TOKENS": str(MAX_TOKENS),
    }
    argv = [str(exe), "-p", task, "--output-format", "json", "--system-prompt", SYSTEM]
    argv += ["--tools", "Write", "--permission-mode", "acceptEdits", "--max-turns", str(TURNS)]
    return argv, env


def claude_answer(out: str, home: Path) -> str:
    return str(next((o.get("result", "") for o in _json_lines(out) if "result" in o), ""))


# --- Codex CLI: Responses -----------------------------------------------------------------

CODEX_CONFIG = """model = "{model}"
model_provider = "pippin"
model_context_window = {context}
model_instructions_file = "{instructions}"
web_search = "disabled"
check_for_update_on_startup = false

[model_providers.pippin]
name = "pippin"
base_url = "{base}/v1"
env_key = "PIPPIN_API_KEY"
wire_api = "responses"
"""


def codex(exe: Path, base: str, home: Path, work: Path, task: str) -> tuple[list[str], dict]:
    codex_home = home / ".codex"
    codex_home.mkdir(exist_ok=True)
    (home / "instructions.md").write_text(SYSTEM)
    (codex_home / "config.toml").write_text(
        CODEX_CONFIG.format(
            model=MODEL, context=CONTEXT, instructions=home / "instructions.md", base=base
        )
    )
    argv = [str(exe), "exec", "--skip-git-repo-check", "-s", "workspace-write"]
    # Tools the tasks do not need (sub-agents alone are 11 kB of JSON Schema), and the
    # skills' instructions (2.9 kB): 950 prompt tokens where there were 2,150.
    for feature in ("multi_agent", "goals", "image_generation", "apps", "plugins", "view_image"):
        argv += ["--disable", feature]
    argv += ["-c", "skills.include_instructions=false"]
    argv += ["-c", "tools.experimental_request_user_input.enabled=false"]
    argv += ["-o", str(home / "last-message.txt"), task]
    return argv, {"CODEX_HOME": str(codex_home), "PIPPIN_API_KEY": KEY}


# --- OpenCode: chat completions -----------------------------------------------------------


def opencode(exe: Path, base: str, home: Path, work: Path, task: str) -> tuple[list[str], dict]:
    tools = ("bash", "glob", "grep", "skill", "task", "todowrite", "webfetch")
    config = {
        "provider": {
            "pippin": {
                "npm": "@ai-sdk/openai-compatible",
                "name": "pippin",
                "options": {"baseURL": f"{base}/v1", "apiKey": KEY},
                "models": {
                    MODEL: {"name": MODEL, "limit": {"context": CONTEXT, "output": MAX_TOKENS}}
                },
            }
        },
        "model": f"pippin/{MODEL}",
        "small_model": f"pippin/{MODEL}",
        "autoupdate": False,
        "share": "disabled",
        "tools": dict.fromkeys(tools, False),
        # Its write tool (and edit, which goes with it) but not read: the task's one tool.
        "permission": {"read": "deny", "edit": "allow", "external_directory": "deny"},
        # Its last step is one without tools, asked to sum up.
        "agent": {"build": {"prompt": SYSTEM, "steps": TURNS}},
    }
    env = {
        "OPENCODE_CONFIG_CONTENT": json.dumps(config),
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_SHARE": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
    }
    argv = [str(exe), "run", "--dir", str(work), "--format", "json", "--title", "matrix"]
    argv += ["-m", f"pippin/{MODEL}"]
    return [*argv, task], env


def opencode_answer(out: str, home: Path) -> str:
    texts = [o.get("part", {}) for o in _json_lines(out) if o.get("type") == "text"]
    return "\n".join(str(p.get("text", "")) for p in texts if isinstance(p, dict))


# --- Qwen Code: chat completions ----------------------------------------------------------


def qwen_code(exe: Path, base: str, home: Path, work: Path, task: str) -> tuple[list[str], dict]:
    settings = {
        "telemetry": {"enabled": False},
        "privacy": {"usageStatisticsEnabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
        "memory": {"enableManagedAutoMemory": False},
        "skills": {"disabledLevels": ["project", "user", "extension", "bundled"]},
        "model": {
            "generationConfig": {
                "contextWindowSize": CONTEXT,
                "samplingParams": {"max_tokens": MAX_TOKENS},
            }
        },
    }
    (home / ".qwen").mkdir(exist_ok=True)
    (home / ".qwen" / "settings.json").write_text(json.dumps(settings))
    env = {"OPENAI_BASE_URL": f"{base}/v1", "OPENAI_API_KEY": KEY, "OPENAI_MODEL": MODEL}
    argv = [str(exe), task, "--auth-type", "openai", "-m", MODEL, "-o", "json"]
    argv += ["--system-prompt", SYSTEM, "--approval-mode", "auto-edit"]
    # Only the tool the task needs (its 20 tools are 9k tokens of JSON Schema): the core
    # tools by allowlist, the others by name.
    unused = ("agent", "list_agents", "skill", "get_goal", "update_goal", "tool_call")
    unused += ("tool_search", "enter_worktree", "exit_worktree", "record_artifact")
    unused += ("report_findings", "send_message", "task_stop")
    argv += ["--core-tools", "write_file", "--exclude-tools", *unused]
    return [*argv, "--max-session-turns", str(TURNS)], env


def qwen_answer(out: str, home: Path) -> str:
    try:
        events = json.loads(out)
    except ValueError:
        return ""
    results = [e for e in events if isinstance(e, dict) and e.get("type") == "result"]
    return str(results[-1].get("result", "")) if results else ""


# --- Aider: chat completions (LiteLLM) ----------------------------------------------------


def aider(exe: Path, base: str, home: Path, work: Path, task: str) -> tuple[list[str], dict]:
    env = {
        "OPENAI_API_BASE": f"{base}/v1",
        "OPENAI_API_KEY": KEY,
        "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # else it fetches prices from GitHub
    }
    argv = [str(exe), "--model", f"openai/{MODEL}", "--no-git", "--no-auto-commits"]
    argv += ["--no-check-update", "--analytics-disable", "--no-show-model-warnings"]
    argv += ["--no-show-release-notes", "--map-tokens", "0", "--yes-always", "--no-pretty"]
    argv += ["--no-fancy-input", "--no-detect-urls", "--no-suggest-shell-commands"]
    # Aider reads only the files it is given: the one to quote read-only, in its ask mode
    # (a question, not an edit); the one to write as an editable file.
    if "notes.txt" in task:
        return [*argv, "--chat-mode", "ask", "--read", "notes.txt", "--message", task], env
    return [*argv, "--edit-format", "whole", "--message", task, "hello.txt"], env


# --- Cline CLI: chat completions ----------------------------------------------------------

CLINE_TEAM = ("spawn_teammate", "shutdown_teammate", "status", "task", "run_task", "cancel_run")
CLINE_TEAM += ("list_runs", "await_runs", "send_message", "broadcast", "read_mailbox")
CLINE_TEAM += ("mission_log", "cleanup", "create_outcome", "attach_outcome_fragment")
CLINE_TEAM += ("review_outcome_fragment", "finalize_outcome", "list_outcomes")
CLINE_UNUSED = ("search_codebase", "run_commands", "fetch_web_content", "editor", "ask_question")
CLINE_UNUSED += ("spawn_agent", *(f"team_{t}" for t in CLINE_TEAM))


def cline(exe: Path, base: str, home: Path, work: Path, task: str) -> tuple[list[str], dict]:
    config = str(home / ".cline")
    # `cline auth` writes the provider (openai-compatible: key, model, base URL) that later
    # runs use; a local session leaves no hub daemon running after it.
    env = {"CLINE_NO_AUTO_UPDATE": "1", "CLINE_SESSION_BACKEND_MODE": "local"}
    auth = [str(exe), "auth", "-p", "openai", "-k", KEY, "-m", MODEL, "-b", f"{base}/v1"]
    subprocess.run(
        [*auth, "--config", config],
        env={**os.environ, "HOME": str(home), **env},
        capture_output=True,
        timeout=120,
        check=True,
    )
    # Only the tool the task needs (its 25 tools, agent teams among them, are 4.5k tokens
    # of JSON Schema): the others are its global settings' disabledTools.
    settings = home / ".cline" / "data" / "settings" / "global-settings.json"
    known = json.loads(settings.read_text()) if settings.exists() else {}
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(json.dumps({**known, "disabledTools": list(CLINE_UNUSED)}))
    argv = [str(exe), "--config", config, "-c", str(work), "--json", "-s", SYSTEM]
    return [*argv, "--retries", "2", task], env


def cline_answer(out: str, home: Path) -> str:
    ends = [o for o in _json_lines(out) if o.get("type") == "run_result"]
    return str(ends[-1].get("text", "")) if ends else ""


# --- Continue CLI: chat completions -------------------------------------------------------

CONTINUE_CONFIG = """name: pippin
version: 1.0.0
schema: v1
models:
  - name: {model}
    provider: openai
    model: {model}
    apiBase: {base}/v1
    apiKey: {key}
    roles: [chat, edit, apply]
    defaultCompletionOptions:
      contextLength: {context}
      maxTokens: {max_tokens}
"""


def cont(exe: Path, base: str, home: Path, work: Path, task: str) -> tuple[list[str], dict]:
    config = home / "config.yaml"
    config.write_text(
        CONTINUE_CONFIG.format(
            model=MODEL, base=base, key=KEY, context=CONTEXT, max_tokens=MAX_TOKENS
        )
    )
    env = {"CONTINUE_GLOBAL_DIR": str(home / ".continue"), "CONTINUE_CLI_ENABLE_TELEMETRY": "0"}
    argv = [str(exe), "-p", "--config", str(config), "--allow", "Read"]
    unused = ("Write", "List", "Bash", "Fetch", "Search", "Subagent", "Skills", "Checklist", "Diff")
    for tool in (*unused, "CheckBackgroundJob", "AskQuestion", "Exit"):
        argv += ["--exclude", tool]
    return [*argv, task], env


def last_message(out: str, home: Path) -> str:
    path = home / "last-message.txt"  # codex exec -o
    return path.read_text() if path.exists() else ""


def stdout(out: str, home: Path) -> str:
    return out


SPECS = [
    Spec(
        "claude-code",
        lambda: npm_bin(CLAUDE_CODE, "claude", "Claude Code"),
        claude,
        claude_answer,
        "write",
        WRITE.format(tool="Write"),
    ),
    Spec(
        "codex",
        lambda: npm_bin(CODEX, "codex", "the Codex CLI"),
        codex,
        last_message,
        "read",
        "Use the exec_command tool to run `cat notes.txt`, then copy its third line.",
    ),
    Spec(
        "opencode",
        lambda: npm_bin(OPENCODE, "opencode", "OpenCode"),
        opencode,
        opencode_answer,
        "write",
        WRITE.format(tool="write"),
    ),
    Spec(
        "qwen-code",
        lambda: npm_bin(QWEN_CODE, "qwen", "Qwen Code"),
        qwen_code,
        qwen_answer,
        "write",
        WRITE.format(tool="write_file"),
    ),
    Spec(
        "aider",
        lambda: pip_bin(AIDER, "aider", "Aider"),
        aider,
        stdout,
        "read",
        "Copy the third line of notes.txt.",  # the file is in its prompt
    ),
    Spec(
        "cline",
        lambda: npm_bin(CLINE, "cline", "the Cline CLI"),
        cline,
        cline_answer,
        "read",
        READ.format(tool="read_files"),
    ),
    Spec(
        "continue",
        lambda: npm_bin(CONTINUE, "cn", "the Continue CLI"),
        cont,
        stdout,
        "read",
        READ.format(tool="Read"),
    ),
]


def check(task: str, answer: str, work: Path) -> str | None:
    if task == "read":
        return None if THIRD_LINE in answer else f"the answer does not quote {THIRD_LINE!r}"
    hello = work / "hello.txt"
    if not hello.exists():
        return "hello.txt was not written"
    text = hello.read_text(errors="replace")
    return None if text.strip() == "pippin" else f"hello.txt holds {text[:200]!r}"


def run_agent(spec: Spec, proxy: RecordingProxy, root: Path) -> AgentRun:
    """The agent's task in its own scratch folder and home."""
    run = AgentRun(spec)
    try:
        exe = spec.install()
    except pytest.skip.Exception as e:
        run.skipped = str(e)
        return run
    home, work = root / "home", root / "work"
    home.mkdir(parents=True)
    work.mkdir()
    # Only what the task needs: an agent that lists the folder in its prompt (Qwen Code
    # does) tempted the model, under another batch's rounding, to write into notes.txt.
    if spec.task == "read":
        (work / "notes.txt").write_text(NOTES)
    argv, extra = spec.command(exe, proxy.base(spec.name), home, work, spec.prompt)
    # PWD too: OpenCode takes its project folder from it, and wrote into the folder pytest
    # ran in while PWD was inherited.
    env = {**os.environ, "PWD": str(work), "HOME": str(home)}
    env["XDG_CONFIG_HOME"] = str(home / ".config")
    env.update({"XDG_DATA_HOME": str(home / ".data"), "XDG_CACHE_HOME": str(home / ".cache")})
    env.update({"XDG_STATE_HOME": str(home / ".state"), "NO_COLOR": "1", "CI": "1", **extra})
    start = time.monotonic()
    # A session of its own: the agent's helpers (a Cline hub, language servers) end with
    # it, and a timeout ends them all.
    proc = subprocess.Popen(
        argv,
        cwd=work,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    killed_at: float | None = None
    try:
        out, err = proc.communicate(timeout=TASK_TIMEOUT)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        killed_at = time.monotonic()
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        code = None
    seconds = time.monotonic() - start
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    answer = spec.answer(out, home)
    problem = check(spec.task, answer, work)
    if code is None:
        problem = f"timed out after {TASK_TIMEOUT} s; {problem}"
    tail = f"stdout: {out[-1500:]!r}\nstderr: {err[-1500:]!r}"
    run.outcome = Outcome(spec.task, seconds, code, answer, tail, problem, killed_at)
    return run


@pytest.fixture(scope="module")
def matrix(
    qwen_gguf: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[RecordingProxy, dict[str, AgentRun]]]:
    args = ("--served-model-name", MODEL, "--max-model-len", str(CONTEXT))
    args += ("--default-temperature", "0")  # greedy: few agents send a temperature
    args += ("--max-tokens", str(MAX_TOKENS))  # the bound for agents that send none
    # Small steps: seven prompts prefilled side by side hold up the decodes of the answers
    # between them for one step each, seconds on a CPU at the default 2048.
    args += ("--prefill-step-size", "512")
    # The agents' prompts (7 x 2 turns, at most ~10k tokens each) fit a small pool; the
    # default (a tenth of the machine's memory, and as much again of MLX's buffer cache)
    # took the server to 7-9 GB, and CI's 24 GB are shared with the other worker's servers.
    args += ("--cache-memory-mb", "1536")
    with (
        run_server(str(qwen_gguf), *args, api_key=KEY, startup_timeout=900) as server,
        recording_proxy(server.url) as proxy,
    ):
        root = tmp_path_factory.mktemp("agents")
        with ThreadPoolExecutor(len(SPECS)) as pool:
            futures = {s.name: pool.submit(run_agent, s, proxy, root / s.name) for s in SPECS}
            runs = {name: f.result() for name, f in futures.items()}
        server.check_alive()
        # Side by side, an agent's requests share batches with the others', whose makeup
        # follows the machine's timing, and a batch's rounding can tip the greedy model's
        # near-even choices (seen once: Qwen Code writing to the wrong file). A task it is
        # expected to do runs again alone, from an empty prefix cache, so that each request
        # is its own batch and the outcome does not depend on timing; that outcome counts.
        # Both runs' requests are checked.
        for spec in SPECS:
            o = runs[spec.name].outcome
            if o is not None and o.problem and (spec.name, o.task) not in MODEL_LIMITS:
                with server.http() as h:
                    h.delete("/v1/cache").raise_for_status()
                alone = run_agent(spec, proxy, root / f"{spec.name}-alone")
                alone.beside = o
                runs[spec.name] = alone
                server.check_alive()
        yield proxy, runs


@pytest.mark.parametrize("name", [s.name for s in SPECS])
def test_agent(name: str, matrix: tuple[RecordingProxy, dict[str, AgentRun]]) -> None:
    proxy, runs = matrix
    run = runs[name]
    if run.skipped:
        pytest.skip(run.skipped)
    o = run.outcome
    assert o is not None
    exchanges = proxy.of(name)
    assert exchanges, f"[{name}] sent pippin no request ({o.seconds:.0f} s)\n{o.output}"
    # Every request answered 200, every stream well formed: the agent's protocol works.
    # A stream cut off by this test stopping the agent at TASK_TIMEOUT is no fault of
    # pippin's; the timeout still fails the task (or runs it again alone).
    stopped = (o.killed_at, run.beside.killed_at if run.beside else None)
    problems = proxy.problems(name, tuple(t for t in stopped if t is not None))
    assert not problems, "\n".join(problems)
    if not o.problem:
        return
    # The task not done, as the files and the answer show.
    requests = "\n".join(f"  {e.describe()[:400]}" for e in exchanges)
    report = (
        f"[{name}] {o.task}: {o.problem} (exit {o.returncode}, {o.seconds:.0f} s, answer "
        f"{o.answer[-500:]!r})\n{o.output}\nits {len(exchanges)} requests:\n{requests}"
    )
    if run.beside is not None:
        report = f"[{name}] alone, after failing side by side ({run.beside.problem}):\n{report}"
    if (name, o.task) in MODEL_LIMITS:
        pytest.xfail(f"{MODEL_LIMITS[name, o.task]}\n{report}")
    raise AssertionError(report)
