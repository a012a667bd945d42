"""What each rank of a tensor-parallel group is started with (`engine/tp/launch.py`):
the environment `mlx.launch` gives it for each backend."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pippin.engine.config import TPConfig
from pippin.engine.tp import launch


def test_ring_on_one_host_gets_a_ring_hostfile_of_free_ports() -> None:
    p = launch.plan(TPConfig(3, backend="ring"))
    assert p.backend == "ring"
    assert [e["MLX_RANK"] for e in p.env] == ["0", "1", "2"]
    rings = [json.loads(f["MLX_HOSTFILE"]) for f in p.files]
    assert rings[0] == rings[1] == rings[2]
    addrs = [a for [a] in rings[0]]
    assert len(set(addrs)) == 3 and all(a.startswith("127.0.0.1:") for a in addrs)
    assert p.channel[0] == "127.0.0.1" and f"127.0.0.1:{p.channel[1]}" not in addrs


def test_nccl_gives_each_rank_one_gpu_and_rank_0_as_host(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    p = launch.plan(TPConfig(2, backend="nccl", port=40000))
    assert [e["CUDA_VISIBLE_DEVICES"] for e in p.env] == ["4", "5"]
    assert {e["NCCL_HOST_IP"] for e in p.env} == {"127.0.0.1"}
    assert {e["NCCL_PORT"] for e in p.env} == {"40001"}
    assert {e["MLX_WORLD_SIZE"] for e in p.env} == {"2"}
    assert p.channel == ("127.0.0.1", 40000)


def test_a_hostfile_sets_hosts_backend_and_env(tmp_path: Path) -> None:
    hf = tmp_path / "hosts.json"
    hf.write_text(
        json.dumps(
            {
                "backend": "jaccl",
                "envs": ["MLX_METAL_FAST_SYNCH=1"],
                "hosts": [
                    {"ssh": "mac1", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en3"]},
                    {"ssh": "mac2", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", None]},
                ],
            }
        )
    )
    p = launch.plan(TPConfig(2, hostfile=str(hf), port=50000))
    assert p.backend == "jaccl"
    assert [h.ssh for h in p.hosts] == ["mac1", "mac2"]
    assert all(e["MLX_JACCL_COORDINATOR"] == "10.0.0.1:50001" for e in p.env)
    assert all(e["MLX_METAL_FAST_SYNCH"] == "1" for e in p.env)
    assert json.loads(p.files[1]["MLX_IBV_DEVICES"]) == [[None, "rdma_en3"], ["rdma_en3", None]]
    assert p.channel == ("10.0.0.1", 50000)  # the others reach rank 0 there


def test_several_hosts_need_a_port_and_the_right_count(tmp_path: Path) -> None:
    hf = tmp_path / "hosts.json"
    hosts = [{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]
    hf.write_text(json.dumps(hosts))
    with pytest.raises(ValueError, match="--tp-port"):
        launch.plan(TPConfig(2, hostfile=str(hf)))
    with pytest.raises(ValueError, match="lists 2 hosts"):
        launch.plan(TPConfig(3, hostfile=str(hf), port=1000))


def _settings(*argv: str):  # type: ignore[no-untyped-def]
    from pippin.cli.main import build_parser
    from pippin.cli.settings import settings_from_args

    return settings_from_args(build_parser().parse_args(["serve", "m", *argv]))


def test_serve_flags_make_the_tp_config(tmp_path: Path) -> None:
    assert _settings().engine.tensor_parallel is None
    assert _settings("--tensor-parallel", "1").engine.tensor_parallel is None
    tp = _settings("-tp", "2", "--distributed-backend", "ring", "--tp-timeout", "30")
    assert tp.engine.tensor_parallel == TPConfig(2, backend="ring", timeout_s=30.0)
    hf = tmp_path / "hosts.json"
    hf.write_text(json.dumps([{"ssh": "a", "ips": ["10.0.0.1"]}] * 3))
    cfg = _settings("--hostfile", str(hf), "--tp-port", "4000").engine.tensor_parallel
    assert cfg is not None and cfg.size == 3 and cfg.port == 4000


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--tensor-parallel", "2", "--ssd-cache-dir", "/tmp/x"], "--ssd-cache-dir"),
        (["--tensor-parallel", "2", "--no-engine-process"], "--no-engine-process"),
        (
            ["--tensor-parallel", "2", "--speculative-config", '{"method": "ngram"}'],
            "--speculative-config",
        ),
        (["--tensor-parallel", "2", "--distributed-backend", "mpi"], None),
    ],
)
def test_serve_refuses_what_tp_cannot_do(argv: list[str], message: str | None) -> None:
    with pytest.raises(SystemExit) as e:
        _settings(*argv)
    if message is not None:
        assert message in str(e.value)
