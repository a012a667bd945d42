"""The web page at `/`: live metrics and a chat playground, plain static files.

No build step: `static/` holds the HTML, CSS, JavaScript and icon as served. The page reads
`/metrics`, `/v1/models` and `/health`, and chats through `/v1/chat/completions` with
`stream: true`. With an API key set, the browser asks for it (HTTP Basic: the key as the
password) and sends it on the page's own calls; the page asks again if the API refuses it.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse

from pippin.api.openapi import openai_route
from pippin.serving.errors import ApiError

STATIC_DIR = Path(__file__).resolve().parent / "static"
_MEDIA = {
    ".html": "text/html",
    ".js": "text/javascript",
    ".css": "text/css",
    ".svg": "image/svg+xml",
}
_FILES = {p.name: p for p in STATIC_DIR.iterdir() if p.suffix in _MEDIA}
# Where browsers look for a site's icon unless the page names one: without it, every
# page load counted a 404 in pippin_request_errors_total.
ICON_PATH = "/favicon.ico"
# Behind the API key when one is set, as HTTP Basic (see api.middleware.ApiKeyMiddleware).
STATIC_PATHS = frozenset({"/", ICON_PATH} | {f"/ui/{name}" for name in _FILES})

router = APIRouter()
# The page and its files: HTML, JavaScript, CSS, SVG (FileResponse names no type of its own).
_PAGE = openai_route(media=tuple(_MEDIA.values()))


def _file(name: str) -> FileResponse:
    path = _FILES[name]
    return FileResponse(path, media_type=_MEDIA[path.suffix], headers={"Cache-Control": "no-cache"})


# HEAD as GET without the body: Claude Code sends `HEAD /` to check the server is up.
@router.api_route("/", methods=["GET", "HEAD"], response_class=FileResponse, **_PAGE)
async def index() -> FileResponse:
    return _file("index.html")


@router.get(ICON_PATH, response_class=FileResponse, **_PAGE)
async def icon() -> FileResponse:
    # The page names /ui/favicon.svg; this answers browsers and tools that ask anyway.
    return _file("favicon.svg")


@router.get("/ui/{name}", response_class=FileResponse, **_PAGE)
async def asset(name: str) -> FileResponse:
    if name not in _FILES:
        raise ApiError(404, f"No such file: {name}", code="not_found")
    return _file(name)
