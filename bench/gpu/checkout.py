"""What a bench script run from this checkout does first: puts `src/` on the path and
imports pippin before MLX, so that pippin's MLX settings (`pippin.mlx_env`) reach its
in-process runs as they reach the server.

    from checkout import REPO_ROOT  # first, before anything imports MLX

PIPPIN_SRC=DIR takes pippin from another source tree (another branch's `src/`, to compare
two versions on the GPU machine in one call: `bash bench/gpu/gpu_probe.sh ab`).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SRC = str(Path(os.environ.get("PIPPIN_SRC") or REPO_ROOT / "src").resolve())
if sys.path[:1] != [SRC]:
    sys.path.insert(0, SRC)

import pippin  # noqa: E402,F401
