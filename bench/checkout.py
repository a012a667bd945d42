"""What a bench script run from this checkout does first: puts `src/` on the path and
imports pippin before MLX, so that pippin's MLX settings (`pippin.mlx_env`) reach its
in-process runs as they reach the server.

    from checkout import REPO_ROOT  # first, before anything imports MLX
"""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT / "src") not in sys.path:
    sys.path.insert(0, str(REPO_ROOT / "src"))

import pippin  # noqa: E402,F401
