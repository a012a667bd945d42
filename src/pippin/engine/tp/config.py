"""Tensor-parallel settings (`pippin serve --tensor-parallel N`, `--hostfile`)."""

from __future__ import annotations

from dataclasses import dataclass

BACKENDS = ("auto", "ring", "nccl", "jaccl", "jaccl-ring", "any")

# How long rank 0 waits for a model call another rank started and has not finished
# before it takes the group for dead (a collective can block forever, NCCL's above all).
DEFAULT_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class TPConfig:
    size: int
    # auto: the hostfile's backend, else NCCL on NVIDIA GPUs and ring elsewhere
    # (as `mlx.launch` picks).
    backend: str = "auto"
    # mlx.launch's JSON hostfile ({"hosts": [{"ssh": ..., "ips": [...]}, ...]}); None: every
    # rank on this host.
    hostfile: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S
    # First port of the ring's (or NCCL's, JACCL's coordinator) and the plan channel's
    # listeners; 0: free ports picked on this host (one host only).
    port: int = 0

    def resolved_backend(self, hostfile_backend: str = "") -> str:
        if self.backend != "auto":
            return self.backend
        if hostfile_backend:
            return hostfile_backend
        import mlx.core as mx

        return "nccl" if mx.cuda.is_available() else "ring"
