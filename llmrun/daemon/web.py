"""The web page: the static files of llmrun/ui/ at `/ui/`, and a browser's `GET /` sent there.

The page is a client of the API like any other: its same-origin fetches meet the Host,
Origin and key checks (security.py) unchanged. Only its files are open without a key (they
hold nothing secret, and a page that asks for the key must load before it has one).

- **Which files.** The files under llmrun/ui/ are read once, when the app is made, into a
  table keyed by their path; a request names an entry of that table or gets a 404, so no
  path (`..`, encoded, absolute) reaches the filesystem.
- **What they may do.** Every answer carries a Content-Security-Policy that allows the
  page's own scripts, styles and API only: no inline script, no eval, no other origin, no
  framing, and Trusted Types, so that only the sanitiser (DOMPurify's policy) can turn a
  string into HTML. Model output is untrusted (a poisoned document can make a model write
  `<img onerror>`); the sanitiser is the first wall, this policy the second.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse, RedirectResponse, Response

ROOT = Path(__file__).resolve().parents[1] / "ui"
PREFIX = "/ui/"

CSP = "; ".join([
    "default-src 'none'",
    "script-src 'self'",
    "style-src 'self'",
    # blob: and data: for the user's own attached images; model output never loads images
    "img-src 'self' blob: data:",
    "connect-src 'self'",
    "font-src 'self'",
    "manifest-src 'self'",
    "base-uri 'none'",
    "form-action 'none'",
    "frame-ancestors 'none'",
    "require-trusted-types-for 'script'",
    "trusted-types dompurify",
])
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cross-Origin-Opener-Policy": "same-origin",
    "Cross-Origin-Resource-Policy": "same-origin",
    # revalidated each time (cheap: an ETag), so an upgraded llmrun never serves a stale page
    "Cache-Control": "no-cache",
}
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".mjs": "text/javascript; charset=utf-8", ".css": "text/css; charset=utf-8",
         ".svg": "image/svg+xml", ".png": "image/png", ".json": "application/json"}


@dataclass(frozen=True)
class Asset:
    body: bytes
    media_type: str
    etag: str


def assets(root: Path = ROOT) -> dict[str, Asset]:
    """The servable files under `root` by their path below it (index.html also as "")."""
    table: dict[str, Asset] = {}
    for path in sorted(root.rglob("*")):
        kind = TYPES.get(path.suffix)
        if kind is None or not path.is_file():  # licences and notes are not served
            continue
        body = path.read_bytes()
        etag = '"' + hashlib.sha256(body).hexdigest()[:32] + '"'
        table[path.relative_to(root).as_posix()] = Asset(body, kind, etag)
    if "index.html" in table:
        table[""] = table["index.html"]
    return table


def wants_html(request: Request) -> bool:
    """A browser's navigation (it asks for HTML first); API clients and curl ask for */*."""
    return "text/html" in request.headers.get("accept", "")


def router(root: Path = ROOT) -> APIRouter:
    table = assets(root)
    api = APIRouter()

    @api.get("/ui", include_in_schema=False)
    async def bare() -> Response:
        return RedirectResponse(PREFIX, status_code=308, headers=HEADERS)

    @api.api_route(PREFIX + "{path:path}", methods=["GET", "HEAD"], include_in_schema=False)
    async def asset(path: str, request: Request) -> Response:
        found = table.get(path)
        if found is None:
            return PlainTextResponse("not found", status_code=404, headers=HEADERS)
        headers = {**HEADERS, "ETag": found.etag}
        if request.headers.get("if-none-match") == found.etag:
            return Response(status_code=304, headers=headers)
        return Response(found.body, media_type=found.media_type, headers=headers)

    return api
