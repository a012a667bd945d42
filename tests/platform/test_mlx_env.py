"""pippin's MLX settings: chosen on the CUDA build only, before MLX is imported, and
never over the user's own."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import mlx

SRC = Path(__file__).resolve().parents[2] / "src"


def _ops_per_buffer(site: Path | None, user: str | None) -> tuple[str, dict[str, str]]:
    """MLX_MAX_OPS_PER_BUFFER after `import pippin`, and what pippin says it set."""
    env = {k: v for k, v in os.environ.items() if k != "MLX_MAX_OPS_PER_BUFFER"}
    env["PYTHONPATH"] = os.pathsep.join([*([str(site)] if site else []), str(SRC)])
    if user is not None:
        env["MLX_MAX_OPS_PER_BUFFER"] = user
    code = "import sys, os, pippin; assert 'mlx.core' not in sys.modules; "
    code += "print(os.environ.get('MLX_MAX_OPS_PER_BUFFER', '-'), pippin.mlx_env.SET)"
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    value, _, set_by_pippin = out.stdout.strip().partition(" ")
    return value, ast.literal_eval(set_by_pippin)


def _cuda_site(tmp_path: Path) -> Path:
    # An MLX install as the CUDA wheels lay it out: mlx beside its mlx_cuda_* metadata.
    site = tmp_path / "site"
    site.mkdir()
    (site / "mlx").symlink_to(Path(mlx.__path__[0]))
    (site / "mlx_cuda_13-0.32.4.dist-info").mkdir()
    return site


def test_cuda_build_gets_larger_graphs(tmp_path: Path) -> None:
    from pippin.mlx_env import OPS_PER_BUFFER_CUDA

    assert _ops_per_buffer(_cuda_site(tmp_path), None) == (
        OPS_PER_BUFFER_CUDA,
        {"MLX_MAX_OPS_PER_BUFFER": OPS_PER_BUFFER_CUDA},
    )


def test_users_setting_wins(tmp_path: Path) -> None:
    assert _ops_per_buffer(_cuda_site(tmp_path), "7") == ("7", {})


def test_other_builds_keep_mlx_defaults() -> None:
    assert _ops_per_buffer(None, None) == ("-", {})
