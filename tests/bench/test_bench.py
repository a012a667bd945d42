"""`pippin bench` against fake servers whose events are known exactly.

The fake server (tests/support/fake_openai_server.py) sends the first token TTFT seconds
after a request arrives and the others ITL seconds apart, and records when each request
arrived and each token left, on the machine's monotonic clock (the one the client stamps
with too). No check depends on how fast the machine is: the tool's numbers must equal what
its own per-request observations give, and each observation must be consistent with the
server's events in the order causality fixes (a request is sent before it arrives, a token
is seen after it left). On two shared cores a sleep or a read can be late by any amount, so
a check against the schedule would measure the machine, not the tool.
"""

from __future__ import annotations

import asyncio
import csv
import json
import re
import statistics
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.fake_openai_server import CACHED_TOKENS, PROMPT_TOKENS, Timing, fake_server
from support.waiting import wait_for

from pippin.bench.client import RequestResult
from pippin.bench.models import resolve_model
from pippin.bench.report import aggregate, describe, table
from pippin.bench.runner import BenchConfig, BenchRun, Target, arrival_gaps, run_benchmark
from pippin.bench.scrape import parse_metrics, spec_acceptance
from pippin.bench.servers import ServerSet, parse_spec
from pippin.bench.sessions import make_sessions
from pippin.bench.stats import percentile
from pippin.bench.workload import Length, Workload, load_workload
from pippin.cli.main import main

TTFT, ITL, TOKENS = 0.4, 0.05, 8
EPS = 1e-6  # float rounding of sums of clock differences, not a tolerance on time


def fixed_workload(api: str = "chat") -> Workload:
    return Workload(
        name="fixed", api=api, prompt_tokens=Length.parse(32), output_tokens=Length.parse(TOKENS)
    )


def realised(url: str) -> list[dict[str, Any]]:
    """The fake server's events, per streamed request in arrival order."""
    return httpx.get(f"{url}/_realised").json()


def request_of(res: RequestResult) -> int:
    """The server's number for the request `res` measured (its text starts ``r{k}w{i}``)."""
    m = re.match(r"r(\d+)w\d+ ", res.text)
    assert m, res.text
    return int(m.group(1))


def stamps(res: RequestResult) -> list[float]:
    """When the client saw each token, on the shared clock."""
    assert res.ttft is not None
    out = [res.start + res.ttft]
    for gap in res.itls:
        out.append(out[-1] + gap)
    return out


def check_against_server(res: RequestResult, event: dict[str, Any]) -> None:
    """One request's observations against the server's events: all tokens counted, the
    request sent before it arrived, each token seen after it left, the end after the
    server's last byte, and every token seen before the client's end."""
    assert res.ok and res.chunks == TOKENS and len(res.itls) == TOKENS - 1, res
    assert res.output_tokens == TOKENS and res.prompt_tokens == PROMPT_TOKENS, res
    assert res.start <= event["arrival"], (res, event)
    seen = stamps(res)
    assert all(s >= sent - EPS for s, sent in zip(seen, event["sent"], strict=True)), (
        seen,
        event,
    )
    assert res.e2e is not None and res.start + res.e2e >= event["done"] - EPS, (res, event)
    assert seen[-1] <= res.start + res.e2e + EPS, res


def check_arithmetic(row: dict[str, Any], results: list[RequestResult], wall: float) -> None:
    """Every figure of `row` is what the requests' own observations give, exactly."""
    values = {
        "ttft": [r.ttft for r in results],
        "e2e": [r.e2e for r in results],
        "itl": [x for r in results for x in r.itls],
        "tpot": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in results],  # type: ignore[operator]
    }
    for key, xs in values.items():
        assert row[f"{key}_mean"] == pytest.approx(statistics.fmean(xs), rel=1e-12), key
        assert row[f"{key}_p50"] == pytest.approx(statistics.median(xs), rel=1e-12), key
        for q in (90, 99):
            assert row[f"{key}_p{q}"] == pytest.approx(percentile(xs, q), rel=1e-12), key
    assert row["output_tokens"] == sum(r.output_tokens for r in results)
    assert row["wall_s"] == pytest.approx(wall, rel=1e-12)
    assert row["tok_s"] == pytest.approx(row["output_tokens"] / wall, rel=1e-12)


def check_closed_loop(results: list[RequestResult], clients: int, one_process: bool) -> None:
    """A closed loop of `clients`: never more in flight at once; and (clients in one event
    loop, all started in its first turn) the first `clients` all sent before any ended."""
    starts = sorted(r.start for r in results)
    ends = sorted(r.start + r.e2e for r in results)  # type: ignore[operator]
    for j in range(clients, len(starts)):
        # When the j-th request (0-based) was sent, at most clients - 1 others were open.
        assert ends[j - clients] <= starts[j], (j, starts, ends)
    wall_span = ends[-1] - starts[0]
    assert wall_span > 0
    if one_process:
        assert starts[clients - 1] < ends[0], (starts, ends)


@pytest.mark.parametrize(("api", "processes"), [("chat", 1), ("completions", 1), ("chat", 2)])
def test_numbers_match_a_known_latency_server(api: str, processes: int) -> None:
    """Also with the clients spread over two processes: one window's results, merged."""
    with fake_server(Timing(TTFT, ITL)) as url:
        cfg = BenchConfig(
            targets=[Target("fake", url)],
            workload=fixed_workload(api),
            levels=[2, 4],
            num_requests=8,
            warmup=4,
            progress=False,
            client_processes=processes,
        )
        run = asyncio.run(run_benchmark(cfg))
        sent = realised(url)
    rows = aggregate(run)
    assert len(sent) == 4 + 8 + 8  # warm-up, then each window's requests
    assert [r["concurrency"] for r in rows] == [2, 4]
    first = 4
    for r, win in zip(rows, run.windows, strict=True):
        assert r["failed"] == 0 and r["requests"] == 8
        assert r["output_tokens"] == 8 * TOKENS and r["prompt_tokens"] == 8 * PROMPT_TOKENS
        # Each of the window's requests is one the server saw in that window, once.
        ks = sorted(request_of(res) for res in win.results)
        assert ks == list(range(first, first + 8)), ks
        first += 8
        for res in win.results:
            check_against_server(res, sent[request_of(res)])
        check_arithmetic(r, win.results, win.wall)
        check_closed_loop(win.results, int(win.level), processes == 1)
        assert r["server_cache_hit_rate"] == pytest.approx(CACHED_TOKENS / PROMPT_TOKENS)
        assert r["usage_cached_ratio"] == pytest.approx(CACHED_TOKENS / PROMPT_TOKENS)


def test_reasoning_deltas_count_as_first_token() -> None:
    """The first four deltas are reasoning: they are tokens, and the first of them is the
    first token (not the first content delta, four later)."""
    with fake_server(Timing(TTFT, ITL, reasoning=4)) as url:
        cfg = BenchConfig([Target("fake", url)], fixed_workload(), num_requests=3, warmup=0)
        cfg.progress = False
        run = asyncio.run(run_benchmark(cfg))
        sent = realised(url)
    [row] = aggregate(run)
    assert row["failed"] == 0 and row["output_tokens"] == 3 * TOKENS, row
    for res in run.windows[0].results:
        # The answer's text is the content alone; the reasoning deltas were still counted.
        k = request_of(res)
        assert res.text.startswith(f"r{k}w4 "), res.text
        check_against_server(res, sent[k])


def test_poisson_rate_mode_and_sessions() -> None:
    w = fixed_workload()
    w.turns = 2
    with fake_server(Timing(0.02, 0.005)) as url:
        cfg = BenchConfig(
            [Target("fake", url)],
            w,
            mode="rate",
            levels=[20.0],
            num_requests=20,
            warmup=0,
            progress=False,
        )
        run = asyncio.run(run_benchmark(cfg))
    [row] = aggregate(run)
    assert row["requests"] == 20 and row["failed"] == 0
    # Open loop: the last session starts only after the others' Poisson gaps, and its two
    # turns take the server's schedule at least; the window cannot end sooner.
    gaps = arrival_gaps("0|0|0", 20.0, 10)
    assert run.windows[0].wall >= sum(gaps[:-1]) + 2 * (0.02 + (TOKENS - 1) * 0.005) - EPS


def test_compare_mode_reports_ratios(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with fake_server(Timing(TTFT, ITL)) as fast, fake_server(Timing(2 * TTFT, 2 * ITL)) as slow:
        code = main(
            [
                "bench",
                "--url", f"fast={fast}/v1",
                "--url", f"slow={slow}",
                "--concurrency", "2",
                "--num-requests", "4",
                "--output-tokens", str(TOKENS),
                "--prompt-tokens", "16",
                "--warmup", "1",
                "--repetitions", "2",
                "--json", str(tmp_path / "b.json"),
                "--csv", str(tmp_path / "b.csv"),
                "--plot", str(tmp_path / "b"),
                "--no-progress",
            ]
        )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "| conc | server | ok | req/s | tok/s |" in out and "fast tok/s ×" in out
    # No tokenizer here (servers given by URL): the report says prompts count words.
    assert "prompt 16 words" in out and "no tokenizer" in out
    # 8 requests a server: every percentile is marked as drawn from few samples.
    assert "*: a percentile of fewer than 20 samples" in out
    assert f"{data_row_cell(out, 'fast', 'TTFT p50')}".endswith("*")
    data = json.loads((tmp_path / "b.json").read_text())
    assert len(data["windows"]) == 4  # 2 servers x 2 repetitions, interleaved
    assert [w["server"] for w in data["windows"]] == ["fast", "slow", "slow", "fast"]
    assert data["machine"]["cores"] and "python" in data["machine"]
    fast_row, slow_row = data["summary"]
    assert (fast_row["server"], slow_row["server"]) == ("fast", "slow")
    # The ratios are the two rows' own figures; the slow server's TTFT is at least its
    # schedule (a token cannot be seen before it leaves).
    assert slow_row["tok_s_x"] == pytest.approx(fast_row["tok_s"] / slow_row["tok_s"])
    assert slow_row["ttft_p99_x"] == pytest.approx(fast_row["ttft_p99"] / slow_row["ttft_p99"])
    assert slow_row["ttft_p50"] >= 2 * TTFT - EPS and fast_row["ttft_p50"] >= TTFT - EPS
    for row in (fast_row, slow_row):
        done = row["requests"] - row["failed"]
        assert row["req_s"] == pytest.approx(done / row["wall_s"], rel=1e-12)
        assert row["ttft_n"] == done == 8
    rows = list(csv.DictReader((tmp_path / "b.csv").open()))
    assert [r["server"] for r in rows] == ["fast", "slow"]
    for name in ("b-throughput.png", "b-latency.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def data_row_cell(out: str, server: str, column: str) -> str:
    """One cell of the printed table: the row of `server`, the column named `column`."""
    lines = [ln for ln in out.splitlines() if ln.startswith("| ")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    row = next(ln for ln in lines[1:] if f"| {server} |" in ln)
    return [c.strip() for c in row.strip("|").split("|")][header.index(column)]


def test_percentiles_of_enough_samples_are_not_marked() -> None:
    row: dict[str, Any] = {"server": "s", "concurrency": 1, "requests": 20, "failed": 0}
    row.update(req_s=2.0, tok_s=10.0, server_cache_hit_rate=None)
    for name in ("ttft", "itl", "tpot", "e2e"):
        row.update({f"{name}_p{p}": 0.1 for p in (50, 90, 99)}, **{f"{name}_n": 20})
    shown = table([row], "concurrency")
    assert "*" not in shown and "| 1 | s | 20/20 | 2.00 | 10.0 | 100.0 ms |" in shown
    row["ttft_n"] = 19
    shown = table([row], "concurrency")
    assert "| 100.0 ms* |" in shown and "fewer than 20 samples" in shown
    assert "| rate | server |" in table([{**row, "request_rate": 2.0}], "request_rate")


def test_workloads(tmp_path: Path) -> None:
    spec = {
        "prompt_tokens": {"uniform": [40, 60]},
        "output_tokens": {"choice": [8, 16]},
        "shared_prefix_ratio": 0.5,
        "turns": 3,
    }
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(spec))
    w = load_workload(str(path))
    assert w.name == "mine" and w.turns == 3
    sessions = make_sessions(w, 7, seed=1)
    assert len(sessions) == 3 and all(len(s.turns) == 3 for s in sessions)
    firsts = [s.turns[0].text.split() for s in sessions]
    # The first 20 words (half of the shortest prompt) are common to every session.
    assert all(f[:20] == firsts[0][:20] for f in firsts)
    assert len({" ".join(f) for f in firsts}) == 3
    assert all(40 <= len(f) <= 60 for f in firsts)
    assert {t.max_tokens for s in sessions for t in s.turns} <= {8, 16}
    assert make_sessions(w, 7, seed=1)[0].turns[0].text == sessions[0].turns[0].text
    with pytest.raises(ValueError, match="unknown workload fields"):
        Workload.from_dict({"prompt": 3})
    assert load_workload("chat-sessions").turns > 1
    # Prompt lengths in another tokenizer's tokens: half a word a token, half the words.
    w.words_per_token = 0.5
    halves = [s.turns[0].text.split() for s in make_sessions(w, 7, seed=1)]
    assert all(20 <= len(f) <= 30 for f in halves)
    assert all(f[:10] == halves[0][:10] for f in halves)


def test_percentile() -> None:
    xs = [1.0, 2.0, 3.0, 4.0]
    assert percentile(xs, 50) == 2.5 and percentile(xs, 0) == 1 and percentile(xs, 100) == 4
    assert percentile([], 50) is None


# --- `--serve`: servers that pippin bench starts and stops -------------------------------

FAKE = Path(__file__).resolve().parents[1] / "support" / "fake_openai_server.py"


def fake_spec(name: str, ttft: float, itl: float) -> str:
    return f"{name}=cmd:{sys.executable} {FAKE} {{port}} {ttft} {itl} 0"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP takes effect when the process next runs: wait;
    the limit is a hang guard and raises)."""
    state = lambda: Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]  # noqa: E731
    return bool(wait_for(lambda: state() == "T", f"process {pid} stopped"))


def running(pid: int) -> bool:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "T"


def test_serve_specs() -> None:
    s = parse_spec(
        "PIPPIN_FUSED_LAYER=0 MLX_X=a:b off=pippin:random:tiny-qwen3 --max-model-len 4096"
    )
    assert (s.name, s.kind, s.model) == ("off", "pippin", "random:tiny-qwen3")
    assert s.env == {"PIPPIN_FUSED_LAYER": "0", "MLX_X": "a:b"}
    assert s.args == ["--max-model-len", "4096"]
    s = parse_spec("mlx_lm:/models/a b")
    assert (s.name, s.kind, s.model, s.args) == ("mlx_lm", "mlx_lm", "/models/a", ["b"])
    assert s.ramps_clients and not parse_spec("pippin:m").ramps_clients
    for bad in ("pippin", "llamacpp:m", "X=1", "name=pippin:", ""):
        with pytest.raises(ValueError, match="KIND:MODEL"):
            parse_spec(bad)
    with pytest.raises(ValueError, match="no random model"):
        resolve_model("random:nope")
    assert resolve_model("/a/folder") == "/a/folder"


def test_serve_starts_compares_and_stops_servers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two servers started as commands, measured in turns (the idle one paused), stopped."""
    code = main(
        [
            "bench",
            "--serve", fake_spec("fast", TTFT / 4, ITL / 4),
            "--serve", fake_spec("slow", TTFT / 2, ITL / 2),
            "--concurrency", "2",
            "--num-requests", "4",
            "--output-tokens", str(TOKENS),
            "--warmup", "1",
            "--no-progress",
            "--log-dir", str(tmp_path / "logs"),
            "--json", str(tmp_path / "b.json"),
            "--md", str(tmp_path / "b.md"),
        ]
    )  # fmt: skip
    assert code == 0
    out = capsys.readouterr().out
    assert "fast tok/s ×" in out and "server CPU" in out
    data = json.loads((tmp_path / "b.json").read_text())
    servers = {s["name"]: s for s in data["servers"]}
    assert list(servers) == ["fast", "slow"]
    for s in servers.values():
        assert s["kind"] == "cmd" and s["startup_s"] > 0 and not alive(s["pid"])
        assert Path(s["log"]).parent == tmp_path / "logs"
    assert all(w["cpu"]["server_cpu"] >= 0 for w in data["windows"])
    assert all(r["failed"] == 0 for r in data["summary"])
    assert "tok_s_x" in next(r for r in data["summary"] if r["server"] == "slow")
    md = (tmp_path / "b.md").read_text()
    assert md.startswith("```sh\npippin bench") and "| conc | server |" in md


def test_idle_servers_are_paused(tmp_path: Path) -> None:
    specs = [parse_spec(fake_spec(n, 0.01, 0.01)) for n in ("a", "b")]
    with ServerSet(specs, log_dir=tmp_path, echo=lambda _: None) as servers:
        a, b = (servers.servers[n].proc.pid for n in ("a", "b"))  # type: ignore[union-attr]
        servers.begin("a")
        assert stopped(b) and running(a)
        servers.begin("b")
        assert stopped(a) and running(b)
        assert servers.end("b") is not None
    assert not alive(a) and not alive(b)


def test_a_server_that_does_not_start_is_reported(tmp_path: Path) -> None:
    bad = f"cmd:{sys.executable} -c 'print(\"no model here\"); raise SystemExit(3)'"
    with pytest.raises(SystemExit, match="exited with code 3(.|\n)*no model here"):
        main(["bench", "--serve", bad, "--log-dir", str(tmp_path), "--no-progress"])


def test_pippin_against_mlx_lm_server(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Real servers on a random model built for the run: pippin serve and mlx_lm.server."""
    code = main(
        [
            "bench",
            "--serve", "pippin:random:tiny-qwen3 --max-model-len 1024",
            "--serve", "mlx_lm:random:tiny-qwen3",
            "--model-root", str(tmp_path / "models"),
            "--concurrency", "2",
            "--num-requests", "4",
            "--prompt-tokens", "32",
            "--output-tokens", "8",
            "--warmup", "1",
            "--no-progress",
            "--json", str(tmp_path / "b.json"),
        ]
    )  # fmt: skip
    assert code == 0
    assert "pippin tok/s ×" in capsys.readouterr().out
    data = json.loads((tmp_path / "b.json").read_text())
    assert [s["model"] for s in data["servers"]] == ["tiny-qwen3", "default_model"]
    assert all(r["failed"] == 0 for r in data["summary"])
    assert all(not alive(s["pid"]) for s in data["servers"])
    # Prompt lengths were counted in the model's own tokens (its tokenizer.json).
    assert data["config"]["workload"]["words_per_token"] < 1
    assert Path(data["config"]["workload"]["tokenizer"]).name == "tiny-qwen3"  # and says so
    # pippin honours ignore_eos; mlx_lm.server may stop at an end token.
    pippin = next(r for r in data["summary"] if r["server"] == "pippin")
    assert pippin["output_tokens"] == 4 * 8


def test_bench_serve_takes_vllm_mlx_flag_names(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`pippin bench-serve` is `pippin bench` under vllm-mlx's flag names."""
    out = tmp_path / "b.json"
    with fake_server(Timing(TTFT, ITL)) as url:
        code = main(
            [
                "bench-serve",
                "--url", url,
                "--prompts", "short",
                "--concurrency", "1,2",
                "--max-tokens", str(TOKENS),
                "--repetitions", "1",
                "--warmup", "0",
                "--num-requests", "2",
                "--skip-preflight-token-count",
                "--format", "json",
                "--output", str(out),
                "--no-progress",
            ]
        )  # fmt: skip
    assert code == 0
    data = json.loads(out.read_text())
    assert sorted({w["concurrency"] for w in data["windows"]}) == [1, 2]
    assert all(w["output_tokens"] == 2 * TOKENS for w in data["windows"])
    with pytest.raises(SystemExit, match="not shipped"):
        main(["bench-serve", "--prompts", "long", "--url", "http://127.0.0.1:9"])


def test_an_interrupted_run_reports_the_windows_that_finished() -> None:
    """A cancel (what SIGINT does to `asyncio.run`'s task) while a window is measured keeps
    the windows that finished: the GPU scripts stop `pippin bench` at their time limit."""
    with fake_server(Timing(0.05, 0.01)) as fast, fake_server(Timing(120, 0.01)) as hang:
        targets = [Target("fast", fast), Target("hang", hang)]
        cfg = BenchConfig(targets, fixed_workload(), num_requests=1, warmup=0, levels=[1])

        async def cancelled() -> BenchRun:
            task = asyncio.create_task(run_benchmark(cfg))
            # The servers take turns, the fast one first: once the other has a request,
            # the fast window is over and the slow one (120 s to its first token) runs.
            async with httpx.AsyncClient() as client:
                for _ in range(2400):  # a hang guard: 2 minutes
                    if (await client.get(f"{hang}/_realised")).json():
                        break
                    await asyncio.sleep(0.05)
                else:
                    raise AssertionError("the second window never started")
            task.cancel()
            return await task

        run = asyncio.run(cancelled())
    assert run.interrupted
    assert [w.target for w in run.windows] == ["fast"]
    assert "Interrupted: 1 window(s) finished" in describe(run)
    assert aggregate(run)[0]["server"] == "fast"


def test_spec_acceptance_between_two_scrapes() -> None:
    """Kept over proposed tokens between scrapes, from pippin's counters or vLLM's; none
    from a server without them."""
    pippin = (
        "# TYPE pippin_spec_decode_num_draft_tokens counter\n"
        'pippin_spec_decode_num_draft_tokens_total{{model="a"}} {p}\n'
        "# TYPE pippin_spec_decode_num_accepted_tokens counter\n"
        'pippin_spec_decode_num_accepted_tokens_total{{model="a"}} {k}\n'
    )
    before = parse_metrics(pippin.format(p=100, k=60))
    after = parse_metrics(pippin.format(p=140, k=90))
    stats = spec_acceptance(before, after)
    assert stats is not None and (stats.proposed, stats.accepted) == (40, 30)
    assert stats.acceptance == pytest.approx(0.75)
    vllm = (
        "# TYPE vllm:spec_decode_num_draft_tokens counter\n"
        "vllm:spec_decode_num_draft_tokens_total {p}\n"
        "# TYPE vllm:spec_decode_num_accepted_tokens counter\n"
        "vllm:spec_decode_num_accepted_tokens_total {k}\n"
    )
    stats = spec_acceptance(
        parse_metrics(vllm.format(p=0, k=0)), parse_metrics(vllm.format(p=8, k=2))
    )
    assert stats is not None and stats.acceptance == pytest.approx(0.25)
    idle = spec_acceptance(before, before)
    assert idle is not None and idle.acceptance is None
    other = parse_metrics("# TYPE x counter\nx_total 1\n")
    assert spec_acceptance(other, other) is None and spec_acceptance(None, after) is None


def test_decode_traces_between_two_scrapes_and_in_the_table() -> None:
    """pippin's decode graphs traced in a window (a stall each, on the host), from its
    counters; the table shows them only where some window traced."""
    from pippin.bench.report import table
    from pippin.bench.scrape import decode_traces
    from pippin.bench.stats import summarize

    page = (
        "# TYPE pippin_decode_graph_traces counter\n"
        'pippin_decode_graph_traces_total{{model="a"}} {n}\n'
        "# TYPE pippin_decode_graph_trace_seconds counter\n"
        'pippin_decode_graph_trace_seconds_total{{model="a"}} {s}\n'
    )
    stats = decode_traces(
        parse_metrics(page.format(n=3, s=1.5)), parse_metrics(page.format(n=7, s=2.75))
    )
    assert stats is not None and (stats.traces, stats.seconds) == (4, 1.25)
    other = parse_metrics("# TYPE x counter\nx_total 1\n")
    assert decode_traces(other, other) is None
    row = {"server": "a", "concurrency": 1, **summarize([], 1.0), "server_cache_hit_rate": None}
    assert "decode traces" not in table(
        [{**row, "decode_traces": 0, "decode_trace_s": 0}], "concurrency"
    )
    shown = table([row, {**row, "decode_traces": 12, "decode_trace_s": 3.42}], "concurrency")
    assert "| decode traces |" in shown and "| 12 (3.4 s) |" in shown
