"""The HTTP port: readiness (``/ping``), node info (``/info``) and ``/stats``.

``/ping`` asks PostgreSQL on every call (on its own connection), so a load
balancer or an operator sees ``500 NOK`` while the database is unreachable
and ``OK`` again as soon as it answers, without restarting dmq.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from twisted.internet.defer import Deferred
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from twisted.web.server import Request

from dmq_server.core.options import Options
from dmq_server.http.guard import HttpGuard
from dmq_server.http.site import BoundedSite

__all__ = ["make_site"]

VERSION = "0.1.0"


def _json(request: Request, status: int, payload: Any) -> bytes:
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"application/json; charset=utf-8")
    return json.dumps(payload, indent=None, sort_keys=False).encode("utf-8") + b"\n"


class Ping(Resource):
    isLeaf = True

    def __init__(self, check: Callable[[], Deferred]):
        super().__init__()
        self._check = check

    def render_GET(self, request: Request) -> Any:
        d = self._check()

        def ok(_: object) -> None:
            request.setHeader(b"content-type", b"text/plain; charset=utf-8")
            request.write(b"OK")
            request.finish()

        def failed(failure: Failure) -> None:
            request.setResponseCode(500)
            request.setHeader(b"content-type", b"text/plain; charset=utf-8")
            request.write(f"NOK - database unreachable: {failure.value}".encode("utf-8"))
            request.finish()

        d.addCallbacks(ok, failed)
        return NOT_DONE_YET


class Stats(Resource):
    isLeaf = True

    def __init__(self, stats: Callable[[], dict]):
        super().__init__()
        self._stats = stats

    def render_GET(self, request: Request) -> bytes:
        return _json(request, 200, self._stats())


class Info(Resource):
    isLeaf = True

    def __init__(self, info: Callable[[], dict]):
        super().__init__()
        self._info = info

    def render_GET(self, request: Request) -> bytes:
        return _json(request, 200, self._info())


class Root(Resource):
    #: answers unknown paths when set (the NSQ API wants nsqd's JSON 404)
    not_found: Resource | None = None

    def getChild(self, path: bytes, request: Request) -> Resource:
        if path == b"":
            return self
        if self.not_found is not None:
            return self.not_found
        return super().getChild(path, request)

    def render_GET(self, request: Request) -> bytes:
        return _json(request, 200, {"service": "dmq", "endpoints": ["/ping", "/info", "/stats"]})


def make_site(
    check: Callable[[], Deferred],
    stats: Callable[[], dict],
    info: Callable[[], dict],
    options: Options | None = None,
    guard: HttpGuard | None = None,
) -> BoundedSite:
    """The HTTP port's site; body limits and timeouts come from ``options`` (see ``http.site``),
    ``guard`` is the port's ``http.guard.HttpGuard``."""
    root = Root()
    # zope's @implementer(IResource) on Resource is invisible to mypy (no zope plugin)
    root.putChild(b"ping", Ping(check))  # type: ignore[arg-type]
    root.putChild(b"stats", Stats(stats))  # type: ignore[arg-type]
    root.putChild(b"info", Info(info))  # type: ignore[arg-type]
    site = BoundedSite(root, options, guard=guard)
    site.noisy = False
    return site
