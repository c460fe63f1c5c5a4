"""The HTTP port's connections, bounded: body size, slow requests, idle keep-alives.

twisted.web reads a request's whole body (into memory or a temporary file) before
any resource sees it, and its only timeout is an idle timer that every received
byte resets. So this channel adds, below the resources:

* **body limits decided from the headers.** A ``Content-Length`` over the path's
  limit is answered ``413`` at once, before the body is read (and before ``100
  Continue``), and the connection closes; a chunked body is cut off the moment it
  passes the limit. ``/pub`` allows ``--max-msg-size`` (nsqd's ``MSG_TOO_BIG``),
  every other path ``--max-body-size`` (``BODY_TOO_BIG``).
* **a read timeout per request** (``--read-timeout``): from a request's first byte
  to the end of its body. A client trickling one byte every few seconds is
  answered ``408`` and closed.
* **an idle timeout** between requests of a keep-alive connection
  (``--http-idle-timeout``), twisted.web's own.
* **the guard** (``http.guard.HttpGuard``): TLS required, the Host, cross-site
  requests and authorization, checked for every request before its resource renders.
* **an access log that stays quiet**: no line at all for ``/ping`` and ``/metrics``
  (polled every few seconds by load balancers and Prometheus), a ``debug`` line for
  other requests, a warning for a 5xx answer; fields ``peer``, ``method``, ``path``,
  ``status`` (twisted.web would write a line per request, ``/ping`` included);
* **a request description safe to log** (twisted.web's ``repr`` of a request
  decodes the URI as ASCII and breaks log formatting on any other byte, e.g. in
  the warning about a body sent to a ``HEAD`` request).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, cast
from urllib.parse import unquote_to_bytes

from twisted.logger import Logger, LogLevel
from twisted.python.failure import Failure
from twisted.internet.interfaces import IReactorTime
from twisted.internet.protocol import connectionDone
from twisted.web import http
from twisted.web.http import HTTPChannel
from twisted.web.resource import Resource
from twisted.web.server import Request, Site

from dmq_server.core.clock import Clock, Timer
from dmq_server.core.options import Options
from dmq_server.core.peers import peer_address
from dmq_server.core.transport import Transport

if TYPE_CHECKING:  # the guard imports nothing of this module; a site is given one
    from dmq_server.http.guard import HttpGuard

__all__ = ["BoundedRequest", "BoundedChannel", "BoundedSite"]

log = Logger()

#: seconds a refused request's connection keeps reading (and dropping) after the answer
LINGER = 1.0

#: paths polled by machines: never a line in the access log
QUIET_PATHS = (b"/ping", b"/metrics")


class BoundedRequest(Request):
    """Counts a chunked body against the channel's limit; describes itself safely."""

    _body_received = 0

    def handleContentChunk(self, data: bytes) -> None:
        channel = self.channel
        if channel is None:
            return
        if isinstance(channel, BoundedChannel):
            if channel.refused:
                return
            self._body_received += len(data)
            limit = channel.body_limit
            if limit is not None and self._body_received > limit[0]:
                channel.refuse_body(self._body_received, more=True)
                return
        super().handleContentChunk(data)

    def __repr__(self) -> str:
        return "<{} at 0x{:x} method={!r} uri={!r} clientproto={!r}>".format(
            self.__class__.__name__, id(self), self.method, self.uri, self.clientproto
        )


class BoundedChannel(HTTPChannel):
    """twisted.web's channel with body limits and a per-request read timeout."""

    # ITransport is a zope interface, nominal to mypy and read without self; Twisted's
    # transports and StringTransport have this shape (dmq_server.core.transport)
    transport: Transport  # type: ignore[assignment]
    site: BoundedSite  # set by Site.buildProtocol
    refused = False
    body_limit: tuple[int, str, bytes] | None = None
    _request_timer: Timer | None = None
    _linger: Timer | None = None

    def dataReceived(self, data: bytes) -> None:
        if self.refused:
            return
        timeout = self.site.read_timeout
        if self._request_timer is None and not self._handlingRequest and timeout > 0:
            self._request_timer = self.callLater(timeout, self._request_timed_out)
        super().dataReceived(data)

    def lineReceived(self, line: bytes) -> None:
        if not self.refused:
            super().lineReceived(line)

    def rawDataReceived(self, data: bytes) -> None:
        if not self.refused:
            super().rawDataReceived(data)

    def allHeadersReceived(self) -> None:
        self.body_limit = self.site.body_limit(self._path)
        if self.length is not None and self.length > self.body_limit[0]:
            self.refuse_body(self.length, more=False)
            return
        super().allHeadersReceived()

    def allContentReceived(self) -> None:
        if self.refused:
            return
        self._cancel_request_timer()
        super().allContentReceived()

    def refuse_body(self, size: int, more: bool) -> None:
        """413 now, then close: the body is not read (any further)."""
        limit, message, kind = self.body_limit or self.site.body_limit(b"/")
        self.refused = True
        for request in self.requests:
            # a chunked body refused midway: what twisted.web buffered (a temporary file
            # for large bodies) is released now, not whenever the collector gets to it
            content = getattr(request, "content", None)
            if content is not None:
                content.close()
                request.content = None
        self._cancel_request_timer()
        what = f"at least {size}" if more else str(size)
        log.info(
            "{peer}: HTTP body of {what} bytes over the limit of {limit}, answered 413",
            peer=peer_address(self.transport), what=what, limit=limit,
        )
        if kind == b"admin":
            payload = {"error": "E_TOO_BIG", "message": f"request body over the limit of {limit} bytes"}
        else:
            payload = {"message": message}
        self._respond(413, b"Request Entity Too Large", json.dumps(payload).encode(), kind == b"nsq")

    def _request_timed_out(self) -> None:
        self._request_timer = None
        if self.refused or self._handlingRequest:
            return
        log.info(
            "{peer}: HTTP request not received within {timeout}s, closing",
            peer=peer_address(self.transport), timeout=self.site.read_timeout,
        )
        self.refused = True
        self._respond(408, b"Request Timeout", b'{"message":"REQUEST_TIMEOUT"}')

    def _respond(self, status: int, reason: bytes, body: bytes, nsq: bool = True) -> None:
        """A whole response written below twisted.web (no Request finished it), then close."""
        v1 = b"X-NSQ-Content-Type: nsq; version=1.0\r\n" if nsq else b""  # nsqd's V1 marker
        self.transport.write(
            b"HTTP/1.1 %d %s\r\nContent-Type: application/json; charset=utf-8\r\n%s"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (status, reason, v1, len(body), body)
        )
        # Lingering close: send the answer and a FIN, then drop (unbuffered) what the
        # client still sends for a moment. Closing at once with its body unread would
        # make the kernel answer with a reset, and the client could miss the answer.
        lose_write = getattr(self.transport, "loseWriteConnection", None)
        if lose_write is None:  # a transport without half-close
            self.loseConnection()
            return
        self._networkProducer.unregisterProducer()
        lose_write()
        # by then the answer and the FIN are out, or the client reads nothing: abort
        self._linger = self.callLater(LINGER, self.transport.abortConnection)

    def _cancel_request_timer(self) -> None:
        if self._request_timer is not None:
            if self._request_timer.active():
                self._request_timer.cancel()
            self._request_timer = None

    def connectionLost(self, reason: Failure = connectionDone) -> None:
        self._cancel_request_timer()
        if self._linger is not None and self._linger.active():
            self._linger.cancel()
        super().connectionLost(reason)


class BoundedSite(Site):
    """A Site whose channels are ``BoundedChannel``; the limits come from ``options``."""

    # Twisted types this as the factory of its HTTP/2-switching wrapper; Site builds and
    # configures any HTTPChannel, and this one is meant to be used as it is
    protocol = BoundedChannel  # type: ignore[assignment]
    requestFactory = BoundedRequest
    def __init__(self, resource: Resource, options: Options | None = None, reactor: Clock | None = None,
                 guard: HttpGuard | None = None):
        #: the listener's HttpGuard (dmq_server.http.guard); None lets every request through
        self.guard = guard
        # the options' fields, or these defaults where a test's options leave one out
        idle: float = getattr(options, "http_idle_timeout", 300.0)
        # IReactorTime is a zope interface, nominal to mypy; the reactor and task.Clock provide it
        clock = cast(IReactorTime, reactor) if reactor is not None else None
        super().__init__(resource, timeout=idle or None, reactor=clock)
        self.requestFactory = BoundedRequest
        self.max_msg_size: int = getattr(options, "max_msg_size", 1048576)
        self.max_body_size: int = getattr(options, "max_body_size", 5242880)
        self.read_timeout: float = getattr(options, "read_timeout", 30.0)

    def getResourceFor(self, request: Request) -> Resource:
        resource = super().getResourceFor(request)
        return resource if self.guard is None else self.guard.resource_for(request, resource)

    def log(self, request: http.Request) -> None:
        """The access log (replacing twisted.web's line per request): see the module's docstring."""
        path = request.path or b""
        if path in QUIET_PATHS:
            return
        status = request.code
        log.emit(
            LogLevel.warn if status >= 500 else LogLevel.debug,
            "{peer} {method} {path} {status}",
            peer=peer_address(request.transport) if request.transport is not None else "-",
            method=(request.method or b"-").decode("latin-1"),
            path=path.decode("utf-8", "replace"),
            status=status,
        )

    def body_limit(self, target: bytes) -> tuple[int, str, bytes]:
        """``(bytes, nsqd's error text, kind)`` for a request target (path and query).

        The resource that will answer is named by the path's first segment as twisted.web
        finds it: percent-decoded, after any empty segments (the root resource answers
        ``""`` with itself), so ``/pub/``, ``//pub`` and ``/%70ub`` are ``/pub`` and get its
        limit, not the larger one of ``/mpub``."""
        path = target.split(b"?", 1)[0]
        first = next((unquote_to_bytes(p) for p in path.split(b"/") if p), b"")
        if first == b"pub":
            return self.max_msg_size, "MSG_TOO_BIG", b"nsq"
        if first == b"admin":
            return self.max_body_size, "BODY_TOO_BIG", b"admin"
        return self.max_body_size, "BODY_TOO_BIG", b"nsq"
