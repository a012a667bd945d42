"""`pippin bench` against fake servers whose latencies are known exactly.

The fake server (tests/fake_openai_server.py) sends the first token after TTFT seconds and
the others ITL seconds apart, so every number the tool reports has a known true value.
"""

from __future__ import annotations

import asyncio
import csv
import json
import sys
import time
from pathlib import Path

import httpx
import pytest
from fake_openai_server import CACHED_TOKENS, PROMPT_TOKENS, Timing, fake_server

from pippin.bench.models import resolve_model
from pippin.bench.report import aggregate, describe
from pippin.bench.runner import BenchConfig, BenchRun, Target, run_benchmark
from pippin.bench.scrape import parse_metrics, spec_acceptance
from pippin.bench.servers import ServerSet, parse_spec
from pippin.bench.stats import percentile
from pippin.bench.workload import Length, Workload, load_workload, make_sessions
from pippin.cli import main

TTFT, ITL, TOKENS = 0.4, 0.05, 8
E2E = TTFT + (TOKENS - 1) * ITL
REL = 0.05  # "within a few percent"; tails (p90) get twice that


def close(measured: float | None, true: float, rel: float = REL) -> bool:
    return measured is not None and abs(measured - true) <= rel * true


def fixed_workload(api: str = "chat") -> Workload:
    return Workload(
        name="fixed", api=api, prompt_tokens=Length.parse(32), output_tokens=Length.parse(TOKENS)
    )


@pytest.mark.parametrize(("api", "processes"), [("chat", 1), ("completions", 1), ("chat", 2)])
def test_numbers_match_a_known_latency_server(api: str, processes: int) -> None:
    """Also with the clients spread over two processes: one window's results, merged.

    Means and medians must equal the server's schedule. A tail (p90) must equal the tail of
    what the server really sent in that window: on a loaded machine a few of its sleeps
    overrun, which moves the true p90 and is no error of the client's."""
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
        rows = aggregate(asyncio.run(run_benchmark(cfg)))
        sent = httpx.get(f"{url}/_realised").json()
    assert len(sent) == 4 + 8 + 8  # warm-up, then each window's requests, in arrival order
    assert [r["concurrency"] for r in rows] == [2, 4]
    for r, times in zip(rows, (sent[4:12], sent[12:20]), strict=True):
        real = {
            "ttft": [t[0] for t in times],
            "e2e": [t[-1] for t in times],
            "itl": [b - a for t in times for b, a in zip(t[1:], t[:-1], strict=True)],
        }
        real["tpot"] = [(t[-1] - t[0]) / (TOKENS - 1) for t in times]
        assert r["failed"] == 0 and r["requests"] == 8
        assert r["output_tokens"] == 8 * TOKENS and r["prompt_tokens"] == 8 * PROMPT_TOKENS
        for key, true in (("ttft", TTFT), ("e2e", E2E), ("itl", ITL), ("tpot", ITL)):
            assert close(r[f"{key}_p50"], true), (key, r)
            assert close(r[f"{key}_mean"], true), (key, r)
            real_p90 = percentile(real[key], 90)
            assert real_p90 is not None and close(r[f"{key}_p90"], real_p90, 2 * REL), (key, r)
        # Closed loop, c clients, back to back: c * TOKENS tokens every E2E seconds.
        assert close(r["tok_s"], r["concurrency"] * TOKENS / E2E), r
        assert r["server_cache_hit_rate"] == pytest.approx(CACHED_TOKENS / PROMPT_TOKENS)
        assert r["usage_cached_ratio"] == pytest.approx(CACHED_TOKENS / PROMPT_TOKENS)


def test_reasoning_deltas_count_as_first_token() -> None:
    with fake_server(Timing(TTFT, ITL, reasoning=4)) as url:
        cfg = BenchConfig([Target("fake", url)], fixed_workload(), num_requests=3, warmup=0)
        cfg.progress = False
        [row] = aggregate(asyncio.run(run_benchmark(cfg)))
    assert close(row["ttft_p50"], TTFT) and close(row["itl_p50"], ITL), row


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
    # 10 sessions arriving at 20/s take about half a second to arrive, plus two turns each.
    assert 0.1 < run.windows[0].wall < 3


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
    assert "| conc | server |" in out and "fast tok/s ×" in out
    data = json.loads((tmp_path / "b.json").read_text())
    assert len(data["windows"]) == 4  # 2 servers x 2 repetitions, interleaved
    assert [w["server"] for w in data["windows"]] == ["fast", "slow", "slow", "fast"]
    assert data["machine"]["cores"] and "python" in data["machine"]
    slow_row = next(r for r in data["summary"] if r["server"] == "slow")
    assert close(slow_row["tok_s_x"], 2.0) and close(slow_row["ttft_p99_x"], 0.5)
    rows = list(csv.DictReader((tmp_path / "b.csv").open()))
    assert [r["server"] for r in rows] == ["fast", "slow"]
    for name in ("b-throughput.png", "b-latency.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


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

FAKE = Path(__file__).resolve().parents[1] / "fake_openai_server.py"


def fake_spec(name: str, ttft: float, itl: float) -> str:
    return f"{name}=cmd:{sys.executable} {FAKE} {{port}} {ttft} {itl} 0"


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def stopped(pid: int) -> bool:
    """Whether `pid` is stopped (SIGSTOP takes effect when the process next runs: wait)."""
    for _ in range(100):
        if Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T":
            return True
        time.sleep(0.05)
    return False


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
            await asyncio.sleep(5)  # the fast window takes about 0.1 s, the other 120 s
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
