"""nsqd's HTTP conventions ("V1", ``internal/http_api``) on twisted.web.

A handler returns a string (sent as text), None (empty body), a dict or list (JSON,
``Content-Type: application/json; charset=utf-8``) or a Deferred of one, or raises
``HttpError(status, MESSAGE)`` (sent as ``{"message": "MESSAGE"}``). Every V1
response carries ``X-NSQ-Content-Type: nsq; version=1.0``. A method a path does not
serve is ``405 METHOD_NOT_ALLOWED``; an unknown path ``404 NOT_FOUND``. Parameters
come from the query string only.
"""

from __future__ import annotations

import json
from typing import Callable, Mapping, Sequence, Union
from urllib.parse import parse_qs, urlsplit

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from twisted.web.server import Request

from dmq_server.core.nsq_wire import valid_name_bytes

__all__ = [
    "HttpError",
    "Answer",
    "Body",
    "Handler",
    "Endpoint",
    "Group",
    "PlainText",
    "NOT_FOUND",
    "params_of",
    "get_param",
    "valid_name_str",
    "body_of",
]

log = Logger()


class HttpError(Exception):
    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


#: a V1 body: text (str or bytes), nothing, or a JSON structure
Body = Union[str, bytes, None, Mapping[str, object], Sequence[object]]
#: what a handler returns: a V1 body, a non-V1 answer (``PlainText``), a Deferred of one
#: (or of an ``HttpError``), or ``NOT_DONE_YET`` (an int) when it answers the request itself
Answer = Union[Body, "PlainText", Deferred, int]
Handler = Callable[[Request], Answer]


def _send(request: Request, status: int, body: Body | int) -> bytes:
    """nsqd's RespondV1."""
    request.setResponseCode(status)
    if status != 200:
        data = json.dumps({"message": str(body)}, separators=(",", ":")).encode()
        request.setHeader(b"content-type", b"application/json; charset=utf-8")
    elif body is None:
        data = b""
        request.setHeader(b"content-type", b"text/plain; charset=utf-8")
    elif isinstance(body, (str, bytes)):
        data = body.encode() if isinstance(body, str) else body
        request.setHeader(b"content-type", b"text/plain; charset=utf-8")
    else:
        data = json.dumps(body, separators=(",", ":")).encode()
        request.setHeader(b"content-type", b"application/json; charset=utf-8")
    request.setHeader(b"x-nsq-content-type", b"nsq; version=1.0")
    return data


def _plain(request: Request, status: int, text: str) -> bytes:
    """nsqd's PlainText decorator (``/ping``): no JSON, no X-NSQ-Content-Type."""
    request.setResponseCode(status)
    request.setHeader(b"content-type", b"text/plain; charset=utf-8")
    return text.encode()


class Endpoint(Resource):
    """One path: method -> handler(request). A handler returns the V1 body (str, None,
    dict/list) or a Deferred of one, or raises HttpError."""

    isLeaf = True

    def __init__(self, routes: dict[bytes, Handler]):
        super().__init__()
        self.routes = routes

    def render(self, request: Request) -> bytes | int:
        handler = self.routes.get(request.method)
        if handler is None:
            return _send(request, 405, "METHOD_NOT_ALLOWED")
        try:
            result = handler(request)
        except HttpError as exc:
            return _send(request, exc.status, exc.message)
        if result is NOT_DONE_YET:
            return result
        if isinstance(result, Deferred):
            gone = [False]
            request.notifyFinish().addErrback(lambda _: gone.__setitem__(0, True))

            def finish(value: Body | PlainText | HttpError) -> None:
                if gone[0]:
                    return
                if isinstance(value, HttpError):
                    request.write(_send(request, value.status, value.message))
                elif isinstance(value, PlainText):
                    request.write(value.render(request))
                else:
                    request.write(_send(request, 200, value))
                request.finish()

            result.addCallback(finish)
            result.addErrback(lambda f: log.failure("HTTP handler failed", f))
            return NOT_DONE_YET
        if isinstance(result, PlainText):
            return result.render(request)
        return _send(request, 200, result)


class PlainText:
    """A response that is not V1 (``/ping``)."""

    def __init__(self, status: int, text: str):
        self.status, self.text = status, text

    def render(self, request: Request) -> bytes:
        return _plain(request, self.status, self.text)


class Group(Resource):
    """A path prefix (``/topic``, ``/channel``) whose unknown children answer NOT_FOUND."""

    def getChild(self, path: bytes, request: Request) -> Resource:
        return NOT_FOUND


NOT_FOUND = Endpoint({})
NOT_FOUND.render = lambda request: _send(request, 404, "NOT_FOUND")  # type: ignore[method-assign]


def params_of(request: Request) -> dict[str, list[str]]:
    try:
        query = urlsplit(request.uri.decode("latin-1")).query
        return parse_qs(query, keep_blank_values=True, errors="strict")
    except (UnicodeDecodeError, ValueError):
        raise HttpError(400, "INVALID_REQUEST") from None


def get_param(params: dict[str, list[str]], key: str) -> str | None:
    values = params.get(key)
    return values[0] if values else None


def valid_name_str(name: str) -> bool:
    try:
        return valid_name_bytes(name.encode("utf-8"))
    except UnicodeEncodeError:
        return False


def body_of(request: Request) -> bytes:
    if request.content is None:  # only before Twisted has read the request's length
        return b""
    request.content.seek(0)
    return request.content.read()
