"""Starting the ranks of a tensor-parallel group, the way `mlx.launch` does.

Rank 0 is the engine process of `pippin serve` (`tp/rank0.py`); it starts ranks 1..N-1
as `python -m pippin.engine.tp.worker`: as local processes when every rank runs on this
host, over `ssh` for the hosts of a hostfile (mlx.launch's JSON format, read with MLX's
own parser). Each rank gets the environment `mlx.launch` would give it for the backend
(`MLX_RANK` and `MLX_HOSTFILE` for ring, `NCCL_HOST_IP`/`NCCL_PORT`/`MLX_WORLD_SIZE` and
one GPU each for NCCL, `MLX_JACCL_COORDINATOR`/`MLX_IBV_DEVICES` for JACCL), so
`mx.distributed.init` connects them, and the address of rank 0's plan channel.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import secrets
import shlex
import socket
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any

from pippin import envs
from pippin.engine.config import TPConfig

LOCAL_NAMES = {"localhost", "127.0.0.1", "::1"}


@dataclass
class Host:
    ssh: str  # where the rank is started ("127.0.0.1": here, no ssh)
    ip: str  # where the other ranks reach it
    rdma: list[Any] = field(default_factory=list)

    @property
    def local(self) -> bool:
        return self.ssh in LOCAL_NAMES or self.ssh == socket.gethostname()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def read_hosts(tp: TPConfig) -> tuple[list[Host], str, list[str]]:
    """The hosts, one per rank, the hostfile's backend and its extra environment."""
    if tp.hostfile is None:
        return [Host("127.0.0.1", "127.0.0.1") for _ in range(tp.size)], "", []
    from mlx._distributed_utils.common import Hostfile

    try:
        hf = Hostfile.from_file(tp.hostfile)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"cannot read the hostfile {tp.hostfile}: {e}") from None
    hosts = []
    for h in hf.hosts:
        if not h.ips:
            raise ValueError(f"the hostfile gives no IP for {h.ssh_hostname!r}")
        hosts.append(Host(h.ssh_hostname, h.ips[0], list(h.rdma)))
    return hosts, hf.backend, list(hf.envs)


@dataclass
class Plan:
    """Every rank's environment, decided once by rank 0."""

    backend: str
    hosts: list[Host]
    env: list[dict[str, str]]  # per rank
    files: list[dict[str, str]]  # per rank: variable -> content of a file it names
    channel: tuple[str, int]  # rank 0's plan channel, as the others reach it
    authkey: bytes


def plan(tp: TPConfig) -> Plan:
    hosts, hf_backend, extra = read_hosts(tp)
    if len(hosts) != tp.size:
        raise ValueError(f"--tensor-parallel {tp.size}, but the hostfile lists {len(hosts)} hosts")
    backend = tp.resolved_backend(hf_backend)
    one_host = all(h.local for h in hosts)
    if tp.port:
        ports = list(range(tp.port, tp.port + tp.size + 1))
    elif one_host:
        ports = [free_port() for _ in range(tp.size + 1)]
    else:
        raise ValueError("several hosts need a fixed --tp-port (and the ports after it)")
    common = dict(e.split("=", 1) for e in extra if "=" in e)
    n = len(hosts)
    env: list[dict[str, str]] = []
    files: list[dict[str, str]] = []
    gpus = (envs.CUDA_VISIBLE_DEVICES or "").split(",")
    for rank, h in enumerate(hosts):
        e = dict(common, MLX_RANK=str(rank), MLX_WORLD_SIZE=str(n))
        f: dict[str, str] = {}
        if backend == "ring":
            ring = [[f"{x.ip}:{ports[1 + r]}"] for r, x in enumerate(hosts)]
            f["MLX_HOSTFILE"] = json.dumps(ring)
        elif backend == "nccl":
            e.update(NCCL_HOST_IP=hosts[0].ip, NCCL_PORT=str(ports[1]))
            # One GPU per rank: the rank-th of this host's ranks.
            local = sum(1 for x in hosts[:rank] if x.ssh == h.ssh)
            e["CUDA_VISIBLE_DEVICES"] = gpus[local] if len(gpus) > local and gpus[0] else str(local)
        elif backend in ("jaccl", "jaccl-ring"):
            e["MLX_JACCL_COORDINATOR"] = f"{hosts[0].ip}:{ports[1]}"
            if backend == "jaccl-ring":
                e["MLX_JACCL_RING"] = "1"
            f["MLX_IBV_DEVICES"] = json.dumps([x.rdma for x in hosts])
        env.append(e)
        files.append(f)
    channel = ("127.0.0.1" if one_host else hosts[0].ip, ports[0])
    return Plan(backend, hosts, env, files, channel, secrets.token_hex(16).encode())


def apply_here(p: Plan, rank: int = 0) -> None:
    """Give this process rank `rank`'s environment (before `mx.distributed.init`)."""
    os.environ.update(p.env[rank])
    for name, content in p.files[rank].items():
        fd, path = tempfile.mkstemp(prefix="pippin-tp-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            fh.write(content)
        os.environ[name] = path


def start_worker(p: Plan, rank: int, spec: dict[str, Any]) -> subprocess.Popen[bytes]:
    """Start rank `rank` (> 0): a local process, or over ssh on its host."""
    blob = base64.b64encode(pickle.dumps(spec)).decode()
    args = [
        "-m",
        "pippin.engine.tp.worker",
        "--channel",
        f"{p.channel[0]}:{p.channel[1]}",
        "--authkey",
        p.authkey.decode(),
        "--backend",
        p.backend,
        "--spec",
        blob,
    ]
    host = p.hosts[rank]
    if host.local:
        env = dict(os.environ)
        env.update(p.env[rank])
        for name, content in p.files[rank].items():
            fd, path = tempfile.mkstemp(prefix="pippin-tp-", suffix=".json")
            with os.fdopen(fd, "w") as fh:
                fh.write(content)
            env[name] = path
        return subprocess.Popen([sys.executable, *args], env=env)
    # As mlx.launch: the same folder and interpreter on the remote host.
    script = f"cd {shlex.quote(os.getcwd())} 2>/dev/null; "
    for k, v in p.env[rank].items():
        script += f"export {k}={shlex.quote(v)}; "
    for name, content in p.files[rank].items():
        script += f"f=$(mktemp); echo {shlex.quote(content)} >$f; export {name}=$f; "
    script += "exec " + shlex.join([sys.executable, *args])
    return subprocess.Popen(["ssh", host.ssh, script])
