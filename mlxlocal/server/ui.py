"""The chat page at `/` (and `/ui`): static files shipped in the package, nothing built at
install time and nothing fetched from elsewhere (marked, DOMPurify and highlight.js vendored
under static/vendor). The page talks to the server through the public API only.

The files are public (no API key: a browser's navigation cannot send one; the page asks for
the key and sends it on its API calls) but Host and Origin are checked as for the API
(app.Guard). A strict Content-Security-Policy allows scripts, styles and fetches from this
origin only: no inline script, no eval, no frames. `--no-ui` leaves the routes out.
"""

from __future__ import annotations

import functools
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import Response

from mlxlocal.server.errors import APIError

UI_PATHS = ("/", "/ui", "/ui/")  # the page itself; its files under /ui/
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
       "connect-src 'self'; font-src 'self'; base-uri 'none'; form-action 'none'; "
       "frame-ancestors 'none'")
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# Every file the page may load: a fixed list, so no request path reaches the file system.
FILES = ("index.html", "app.js", "chat.js", "app.css", "icon.svg", "vendor/marked.js",
         "vendor/purify.js", "vendor/highlight.js", "vendor/highlight.css")

router = APIRouter(include_in_schema=False)


def is_ui_path(path: str) -> bool:
    return path in UI_PATHS or path.startswith("/ui/")


@functools.cache  # FILES only: read once, not per request
def _file(name: str) -> bytes:
    return resources.files("mlxlocal.server").joinpath("static", name).read_bytes()


def _respond(name: str) -> Response:
    if name not in FILES:
        raise APIError(404, f"no such file of the chat page: {name!r}")
    suffix = name[name.rfind("."):]
    # The page is revalidated each load (a new version shows at once); its files are small.
    return Response(_file(name), media_type=_TYPES[suffix],
                    headers={"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff",
                             "Referrer-Policy": "no-referrer", "X-Frame-Options": "DENY",
                             "Cache-Control": "no-cache"})


@router.get("/")
@router.get("/ui")
@router.get("/ui/")
async def page() -> Response:
    return _respond("index.html")


@router.get("/ui/{name:path}")
async def asset(name: str) -> Response:
    return _respond(name)
