"""The JSON admin API, mounted under ``/admin`` on the HTTP port.

=======  ==============================  ===========================================
GET      /admin                          the endpoints
GET      /admin/stats                    live and stored statistics
GET      /admin/topics                   topics, settings, channels
GET      /admin/clients                  connected clients
GET      /admin/delay                    delay fragments, workers, pending counts
GET      /admin/flow                     the TCP port's flow control: bytes held,
                                         paused connections and why (see flow.py)
GET      /admin/outboxes                 the application outboxes this node relays or
                                         stands by for (--outbox): pending rows, the
                                         oldest one's age, rows relayed and dead-
                                         lettered, the relaying node; never a DSN
GET      /admin/dead-letters             list; filters as query parameters (topic,
                                         channel, reason, since, until, ids,
                                         message_ids, replayed), limit, after; each
                                         with its message's key, priority, headers
GET      /admin/dead-letters/ID          one dead letter with its body
POST     /admin/dead-letters/replay      replay the selection (filters, or all=true)
POST     /admin/dead-letters/delete      delete the selection (filters, or all=true)
DELETE   /admin/dead-letters/ID          delete one
POST     /admin/dead-letters             a client reports a send it could not store
                                         (JSON: topic, producer, session_id, body,
                                         body_encoding utf-8|base64, detail, and
                                         the send's key, priority, headers if any)
POST     /admin/channels/T/C/seek        deliver a channel's stored messages again
                                         from to_time, to_id, or to_latest=true
                                         (query parameters); dry_run=true counts
                                         only; answers each cluster's report
=======  ==============================  ===========================================

The endpoints for looking inside (message trace, peek, history, nodes, the delay
table, the audit log) are ``http.admin_inspect``'s.

Answers are JSON; errors are ``{"error": CODE, "message": TEXT}`` with a 4xx/5xx
status. Who may read and who may change is ``http.access.authorize`` (the admin token,
the listener's address, and the Origin; a change from another origin is ``http.guard``'s).
"""

from __future__ import annotations

import json
from typing import Callable

from twisted.internet.defer import Deferred, maybeDeferred
from twisted.logger import Logger
from twisted.python.failure import Failure
from twisted.web.resource import Resource
from twisted.web.server import NOT_DONE_YET
from twisted.web.server import Request

from dmq_server.admin.inspect import Inspector
from dmq_server.admin.operations import AdminOps, DeadLetterFilter, parse_limit
from dmq_server.admin.seek_request import parse_flag, parse_seek
from dmq_server.core.errors import DmqError, Forbidden, Invalid, NotFound, Refused, Unauthorized, Unavailable, reply_for
from dmq_server.core.outbox_figures import OutboxJson
from dmq_server.http import admin_inspect
from dmq_server.http.access import Access, authorize

__all__ = ["AdminResource", "install"]

log = Logger()

#: an admin API error's HTTP status, by its family (PostgreSQL failing is Unavailable: 503)
_STATUS: dict[type[DmqError], int] = {NotFound: 404, Unauthorized: 401, Forbidden: 403, Refused: 400, Unavailable: 503}

_ENDPOINTS = [
    "GET /admin/stats",
    "GET /admin/topics",
    "GET /admin/clients",
    "GET /admin/delay",
    "GET /admin/flow",
    "GET /admin/outboxes",
    "GET /admin/dead-letters",
    "GET /admin/dead-letters/ID",
    "POST /admin/dead-letters/replay",
    "POST /admin/dead-letters/delete",
    "DELETE /admin/dead-letters/ID",
    "POST /admin/dead-letters",
    "POST /admin/channels/TOPIC/CHANNEL/pause|unpause|empty",
    "POST /admin/channels/TOPIC/CHANNEL/seek",
    *admin_inspect.ENDPOINTS,
]


def _text_params(request: Request) -> dict[str, str]:
    params: dict[str, str] = {}
    args: dict[bytes, list[bytes]] = request.args or {}
    for key, values in args.items():
        name = key.decode("utf-8", "replace")
        if len(values) != 1:
            raise Invalid(f"parameter {name!r} given {len(values)} times")
        try:
            params[name] = values[0].decode("utf-8")
        except UnicodeDecodeError:
            raise Invalid(f"parameter {name!r} is not UTF-8") from None
    return params


def _everything(params: dict[str, str]) -> bool:
    value = params.pop("all", "false").lower()
    if value not in ("true", "1", "false", "0", ""):
        raise Invalid(f"all: expected true or false, got {value!r}")
    return value in ("true", "1")


class AdminResource(Resource):
    """Every ``/admin/...`` path; routing by path segments and method."""

    isLeaf = True

    def __init__(self, ops: AdminOps, listen_host: str, token: str, inspector: Inspector | None = None,
                 outboxes: Callable[[], list[OutboxJson]] = list):
        super().__init__()
        self.ops = ops
        self.outboxes = outboxes
        self.listen_host = listen_host
        self.token = token
        self.inspector = inspector or Inspector(ops)

    def render(self, request: Request) -> int:
        d = maybeDeferred(self._route, request)
        d.addCallbacks(lambda result: self._reply(request, 200, result), lambda f: self._fail(request, f))
        return NOT_DONE_YET

    # -- plumbing -------------------------------------------------------------------
    def _reply(self, request: Request, status: int, payload: object) -> None:
        if getattr(request, "_disconnected", False) or request.finished:
            return
        request.setResponseCode(status)
        request.setHeader(b"content-type", b"application/json; charset=utf-8")
        request.write(json.dumps(payload, default=str).encode("utf-8") + b"\n")
        request.finish()

    def _fail(self, request: Request, failure: Failure) -> None:
        error = failure.value
        status = reply_for(error, _STATUS) if isinstance(error, DmqError) else None
        if status is not None:
            self._reply(request, status, {"error": error.code, "message": error.description})
        else:
            log.failure("admin API request failed", failure)
            self._reply(request, 500, {"error": "E_INTERNAL", "message": repr(error)})

    def _authorize(self, request: Request) -> Access:
        try:
            return authorize(request, self.listen_host, self.token)
        except Refused as exc:
            log.warn("admin API: refused {method} {path} from {peer}: {why}",
                     method=request.method.decode(), path=request.path.decode("latin-1"),
                     peer=request.getClientAddress(), why=exc.description)
            raise

    # -- routing ------------------------------------------------------------------------
    def _route(self, request: Request) -> object:
        """The answer's JSON value, or a Deferred of it."""
        access = self._authorize(request)
        method = request.method.decode("ascii", "replace")
        parts = [p.decode("utf-8", "replace") for p in request.postpath or () if p]
        params = _text_params(request)
        if parts == [] and method == "GET":
            return {"endpoints": _ENDPOINTS}
        if len(parts) == 1 and method == "GET":
            simple: dict[str, Callable[[], object]] = {
                "stats": self.ops.stats,
                "topics": self.ops.topics,
                "clients": self.ops.clients,
                "delay": self.ops.delay_stats,
                "flow": self._flow,
                "outboxes": self.outboxes,
            }
            if parts[0] in simple:
                result = simple[parts[0]]()
                if parts[0] in ("topics", "clients", "outboxes"):
                    return {parts[0]: result}
                return result
        found = admin_inspect.route(self.inspector, access, method, parts, params)
        if not admin_inspect.not_mine(found):
            return found
        if parts[:1] == ["dead-letters"]:
            return self._dead_letters(request, access.actor, method, parts[1:], params)
        if len(parts) == 4 and parts[0] == "channels" and method == "POST":
            # POST /admin/channels/TOPIC/CHANNEL/pause|unpause|empty
            _, topic, channel, action = parts
            if action == "seek":
                dry_run = params.pop("dry_run", "false").lower() in ("true", "1", "yes")
                from_archive = parse_flag("from_archive", params.pop("from_archive", None))
                target = parse_seek(params)
                sought = self.ops.channel_seek(topic, channel, target, dry_run, "http", access.actor, from_archive)
                return sought.addCallback(lambda reports: {"clusters": reports})
            d = self.ops.channel_action(action, topic, channel, "http", access.actor)
            return d.addCallback(lambda summary: {"ok": summary})
        raise NotFound(f"no admin endpoint {method} /admin/{'/'.join(parts)}")

    def _flow(self) -> dict:
        return self.ops.flow()

    def _dead_letters(self, request: Request, actor: str, method: str, rest: list[str], params: dict[str, str]) -> Deferred:
        if not rest:
            if method == "GET":
                limit = parse_limit(params.pop("limit", None))
                after = parse_limit(params.pop("after", None), 0, "after") if params.get("after") else 0
                params.pop("after", None)
                flt = DeadLetterFilter.parse(params)
                return self.ops.dlq_list(flt, limit, after).addCallback(
                    lambda rows: {"dead_letters": rows, "next_after": rows[-1]["id"] if len(rows) == limit else None}
                )
            if method == "POST":
                return self._report(request, actor)
        elif len(rest) == 1 and rest[0] in ("replay", "delete") and method == "POST":
            everything = _everything(params)
            flt = DeadLetterFilter.parse(params)
            if rest[0] == "replay":
                d = self.ops.dlq_replay(flt, everything, "http", actor)
                return d.addCallback(lambda n: {"replayed": n})
            d = self.ops.dlq_delete(flt, everything, "http", actor)
            return d.addCallback(lambda n: {"deleted": n})
        elif len(rest) == 1:
            if not rest[0].isdigit():
                raise Invalid(f"dead letter id {rest[0]!r} is not a positive integer")
            letter_id = int(rest[0])
            if method == "GET":
                return self.ops.dlq_show(letter_id)
            if method == "DELETE":
                flt = DeadLetterFilter(ids=(letter_id,))
                d = self.ops.dlq_delete(flt, False, "http", actor)

                def deleted(n: int) -> dict:
                    if n == 0:
                        raise NotFound(f"no dead letter {letter_id}")
                    return {"deleted": n}

                return d.addCallback(deleted)
        raise NotFound(f"no admin endpoint {method} /admin/dead-letters/{'/'.join(rest)}")

    def _report(self, request: Request, actor: str) -> Deferred:
        raw = request.content.read() if request.content is not None else b""
        try:
            payload = json.loads(raw or b"null")
        except ValueError as exc:
            raise Invalid(f"report: the body is not JSON: {exc}") from None
        if not isinstance(payload, dict):
            raise Invalid("report: the body must be a JSON object")
        return self.ops.dlq_report(payload, "http", actor).addCallback(lambda i: {"id": i})


def install(root: Resource, ops: AdminOps, listen_host: str, token: str, inspector: Inspector | None = None,
            outboxes: Callable[[], list[OutboxJson]] = list) -> AdminResource:
    """``outboxes``: the application outboxes' figures (``/admin/outboxes``), none by default."""
    resource = AdminResource(ops, listen_host, token, inspector, outboxes)
    root.putChild(b"admin", resource)  # type: ignore[arg-type]  # zope's @implementer(IResource) on Resource is invisible to mypy (no zope plugin)
    return resource
