"""The web inspector at ``/inspector``: one HTML page, its scripts and the JSON API it reads.

Owns: serving ``static/`` (the page, ``app.js``, ``app.css`` and the vendored
Alpine.js and uPlot files; no build step) under a strict Content-Security-Policy, and mounting
``gateway.inspector.api``. ``gateway.app`` includes ``router`` with one line. Never: renders
captured content on the server; the page fetches JSON and Alpine.js puts every captured string
into the DOM as text (``x-text``), so a prompt holding ``<script>`` shows as those characters.

Every path under ``/inspector/`` that is not a static file serves the page (the views are
client-side routes: ``/inspector/trajectories/<id>``, ``/inspector/steps/<id>``, ...), so a
view's URL, filters included, can be shared.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import FileResponse, Response

from gateway.errors import NotFoundError
from gateway.inspector import api as inspector_api

STATIC_DIR = Path(__file__).resolve().parent / "static"
MEDIA_TYPES = {
    ".js": "text/javascript",
    ".css": "text/css",
    ".html": "text/html; charset=utf-8",
}
# 'unsafe-eval': Alpine.js evaluates its attribute expressions with Function(); no inline
# script is allowed, so injected markup could not run even if it reached the DOM as HTML.
CSP = (
    "default-src 'self'; script-src 'self' 'unsafe-eval'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; "
    "form-action 'self'"
)
SECURITY_HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
}

router = APIRouter()
router.include_router(inspector_api.router)  # JSON endpoints: in the OpenAPI document


def _static(relative: str) -> Path | None:
    path = (STATIC_DIR / relative).resolve()
    if not path.is_file() or STATIC_DIR not in path.parents:
        return None
    return path


@router.get("/inspector/static/{relative:path}", include_in_schema=False)
async def static_file(relative: str) -> Response:
    """The inspector's scripts, styles and vendored libraries."""
    path = _static(relative)
    if path is None:
        raise NotFoundError(f"no inspector file {relative!r}", param="path")
    return FileResponse(
        path,
        media_type=MEDIA_TYPES.get(path.suffix, "application/octet-stream"),
        headers={**SECURITY_HEADERS, "cache-control": "no-cache"},
    )


@router.get("/inspector", include_in_schema=False)
@router.get("/inspector/{view:path}", include_in_schema=False)
async def page(view: str = "") -> Response:
    """The inspector's page (every view; the script reads the URL)."""
    return FileResponse(
        STATIC_DIR / "index.html",
        media_type=MEDIA_TYPES[".html"],
        headers={**SECURITY_HEADERS, "cache-control": "no-cache"},
    )
