"""The web UI: a chat page at / and its assets under /ui/, files of this package (server/static/,
written plainly: no build step, no CDN, nothing fetched from elsewhere).

The pages themselves are open (they hold no data); everything they show comes from the API, which
the page calls with the key the user typed (kept in the browser's local storage, sent in the
Authorization header, never in a URL)."""
from __future__ import annotations

from pathlib import Path

from sanic.response import raw

from .errors import APIError

STATIC = Path(__file__).parent / "static"
TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
         ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".txt": "text/plain; charset=utf-8"}
PAGES = {"/": "index.html", "/configure": "configure.html"}


def is_open(path: str) -> bool:
    """Whether a path is the UI's (no API key asked)."""
    return path in PAGES or path.startswith("/ui/")


def _file(name: str):
    # only the package's own files by their plain names: no path is ever joined from the request
    files = {p.name: p for p in STATIC.iterdir() if p.is_file() and p.suffix in TYPES}
    if name not in files:
        raise APIError(f"no such UI file: {name}", 404, "not_found_error")
    return raw(files[name].read_bytes(), content_type=TYPES[files[name].suffix],
               headers={"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff",
                        "Content-Security-Policy": "default-src 'self'; img-src 'self'; connect-src 'self'; "
                                                   "frame-ancestors 'none'"})


def add_routes(app) -> None:
    for path, name in PAGES.items():
        app.add_route(lambda request, name=name: _file(name), path, methods=["GET"], name=f"page_{name.split('.')[0]}")
    app.add_route(lambda request, name: _file(name), "/ui/<name:str>", methods=["GET"], name="ui_file")


__all__ = ["add_routes", "is_open"]
