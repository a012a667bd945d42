"""Who may manage models, and which folders requests may name.

Pulling, creating, copying and deleting models and loading LoRA adapters change what the
server holds, so they are refused (403) when ``--disable-model-management`` is given, and
for a key of the ``--api-keys`` file unless it is marked ``admin: true``. The operator's
``--api-key`` may; so may any client of a server that requires no key (it binds
127.0.0.1 unless told otherwise).

A path in a request (a create's source, an adapter) is read only inside the ``--models-dir``
folders: elsewhere it is a 400, before anything is opened.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pippin.serving.errors import ApiError

if TYPE_CHECKING:
    from pippin.serving.admission import KeyUse
    from pippin.serving.settings import ServerSettings


def check_admin(settings: ServerSettings, key: KeyUse | None) -> None:
    """Raise the 403 a model-management request gets, if it gets one. ``key``: the
    ``--api-keys`` entry the request came with (None: the operator's key, or none)."""
    if not settings.model_management:
        raise ApiError(
            403,
            "Model management is turned off on this server (--disable-model-management).",
            type="permission_error",
            code="model_management_disabled",
        )
    if key is not None and not key.key.admin:
        raise ApiError(
            403,
            f"The API key '{key.key.name}' may not manage models: it needs 'admin: true' "
            "in the --api-keys file.",
            type="permission_error",
            code="admin_key_required",
        )


def allowed_roots(settings: ServerSettings) -> list[Path]:
    """The folders requests may name paths in: every --models-dir (or the default one)."""
    dirs = settings.models_dirs or [settings.library_dir]
    return [Path(d).expanduser().resolve() for d in dirs]


def allowed_path(settings: ServerSettings, path: str, param: str) -> Path:
    """``path`` resolved (links followed), if it lies inside an allowed folder; else a 400
    naming ``param``. Says nothing of whether it exists."""
    resolved = Path(path).expanduser().resolve()
    for root in allowed_roots(settings):
        if resolved == root or resolved.is_relative_to(root):
            return resolved
    raise ApiError(
        400,
        f"'{param}': the path is outside the folders this server may read models from "
        "(--models-dir).",
        param=param,
        code="path_not_allowed",
    )
