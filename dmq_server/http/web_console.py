"""The web console at ``/console/``: three static files (HTML, CSS, JavaScript) served from
the package, no build step and no CDN. Everything it shows or changes goes through the
JSON admin API (``/admin``), with the API's rights (``http.access``): the files themselves
hold no data, so they are served to anyone who can reach the port.

The page may load nothing from elsewhere (``Content-Security-Policy``), may not be framed
by another site (clickjacking), and sends its changes from its own origin, which is what
``http.guard`` requires of a change a browser sends.
"""

from __future__ import annotations

from importlib import resources

from twisted.web.resource import Resource
from twisted.web.server import Request
from twisted.web.util import Redirect

__all__ = ["ConsoleResource", "install", "FILES"]

#: path under /console/ -> (file in dmq_server/http/static, content type)
FILES = {
    "": ("index.html", b"text/html; charset=utf-8"),
    "index.html": ("index.html", b"text/html; charset=utf-8"),
    "app.js": ("app.js", b"text/javascript; charset=utf-8"),
    "style.css": ("style.css", b"text/css; charset=utf-8"),
}

_HEADERS = {
    b"content-security-policy": b"default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    b"connect-src 'self'; base-uri 'none'; form-action 'self'; frame-ancestors 'none'",
    b"x-content-type-options": b"nosniff",
    b"x-frame-options": b"DENY",
    b"referrer-policy": b"no-referrer",
    b"cache-control": b"no-cache",
}


class ConsoleResource(Resource):
    """``/console/<file>``; the files are read once, when the resource is made."""

    isLeaf = True

    def __init__(self) -> None:
        super().__init__()
        folder = resources.files("dmq_server.http").joinpath("static")
        self.files = {path: (folder.joinpath(name).read_bytes(), kind) for path, (name, kind) in FILES.items()}

    def render_GET(self, request: Request) -> bytes:
        path = "/".join(p.decode("utf-8", "replace") for p in request.postpath or ())
        found = self.files.get(path)
        for name, value in _HEADERS.items():
            request.setHeader(name, value)
        if found is None:
            request.setResponseCode(404)
            request.setHeader(b"content-type", b"text/plain; charset=utf-8")
            return b"no such file in the console\n"
        body, kind = found
        request.setHeader(b"content-type", kind)
        return body

    render_HEAD = render_GET


class _Entry(Resource):
    """``/console`` without the slash: to ``/console/`` (relative links need it)."""

    def __init__(self, console: ConsoleResource):
        super().__init__()
        self.console = console

    def getChild(self, path: bytes, request: Request) -> Resource:
        if request.postpath is not None:  # always a list while a request is traversed
            request.postpath.insert(0, path)
        return self.console

    def render_GET(self, request: Request) -> bytes:
        return Redirect(b"/console/").render(request)


def install(root: Resource) -> ConsoleResource:
    console = ConsoleResource()
    root.putChild(b"console", _Entry(console))  # type: ignore[arg-type]  # zope's @implementer(IResource) on Resource is invisible to mypy (no zope plugin)
    return console
