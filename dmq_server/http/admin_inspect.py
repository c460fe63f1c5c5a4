"""The admin API's endpoints for looking inside the node (``admin.inspect``), routed by
``http.admin_api`` under ``/admin``; the web console is built on them.

=======  =======================================  ==========================================
GET      /admin/whoami                            this caller's rights (the console's mode)
GET      /admin/overview                          every topic of both stores, its channels'
                                                  figures (the console's first page)
GET      /admin/messages/ID                       the message's trace: stored facts (with its
                                                  key, priority, headers), events in time
                                                  order, this node's live copies
GET      /admin/messages?producer=P&session_id=S  the id stored for a producer's session id
GET      /admin/channels/TOPIC/CHANNEL            figures and consumers on this node
GET      /admin/channels/TOPIC/CHANNEL/peek       waiting copies, oldest first, not consumed,
                                                  with their properties (after, limit)
GET      /admin/history                           each channel's last minutes (topic)
GET      /admin/nodes                             live nodes from the registry
GET      /admin/delay/entries                     waiting delayed messages by due time, with
                                                  their properties (topic, after_due,
                                                  after_id, limit)
GET      /admin/delay/histogram                   waiting delayed messages per due-time
                                                  bucket (topic, width: e.g. 1m)
POST     /admin/delay/deliver-now|cancel          ids=1,2,3 (audited)
GET      /admin/audit                             the audit log, newest first (before, limit)
GET      /admin/dead-letters/count                how many match the filters (and are not
                                                  replayed): the console's confirmation
=======  =======================================  ==========================================
"""

from __future__ import annotations

from typing import Any

from dmq_client.spelling import parse_duration
from dmq_server.admin.inspect import Inspector, parse_ids
from dmq_server.admin.operations import DeadLetterFilter, parse_limit
from dmq_server.core.errors import Invalid
from dmq_server.http.access import Access

__all__ = ["ENDPOINTS", "route", "not_mine"]

ENDPOINTS = [
    "GET /admin/whoami",
    "GET /admin/overview",
    "GET /admin/messages/ID",
    "GET /admin/messages?producer=P&session_id=S",
    "GET /admin/channels/TOPIC/CHANNEL",
    "GET /admin/channels/TOPIC/CHANNEL/peek",
    "GET /admin/history",
    "GET /admin/nodes",
    "GET /admin/delay/entries",
    "GET /admin/delay/histogram",
    "POST /admin/delay/deliver-now|cancel",
    "GET /admin/audit",
    "GET /admin/dead-letters/count",
]

_NOT_MINE = object()


def _int(params: dict[str, str], name: str, default: int = 0) -> int:
    text = params.pop(name, None)
    if text is None or text == "":
        return default
    try:
        return int(text)
    except ValueError:
        raise Invalid(f"{name}: expected an integer, got {text!r}") from None


def route(inspector: Inspector, access: Access, method: str, parts: list[str], params: dict[str, str]) -> Any:
    """The answer (a value or a Deferred), or ``NOT_MINE`` for a path this module does not serve."""
    head = parts[0] if parts else ""
    if method == "GET":
        if parts == ["whoami"]:
            return {"actor": access.actor, "admin": access.admin}
        if parts == ["overview"]:
            return inspector.overview()
        if head == "messages" and len(parts) == 2:
            if not parts[1].isdigit():
                raise Invalid(f"message id {parts[1]!r} is not a positive integer")
            return inspector.trace(int(parts[1]))
        if parts == ["messages"]:
            producer = params.get("producer")
            if not producer:
                raise Invalid("give producer and session_id (or GET /admin/messages/ID)")
            return inspector.find(producer, _int(params, "session_id"))
        if head == "channels" and len(parts) == 3:
            return inspector.channel(parts[1], parts[2])
        if head == "channels" and len(parts) == 4 and parts[3] == "peek":
            return inspector.peek(parts[1], parts[2], _int(params, "after"), _int(params, "limit", 20))
        if parts == ["history"]:
            return inspector.history(params.get("topic") or None)
        if parts == ["nodes"]:
            return inspector.nodes()
        if parts == ["delay", "entries"]:
            limit = parse_limit(params.pop("limit", None), 50)
            return inspector.delayed(params.get("topic") or None, _int(params, "after_due", -(2**62)),
                                     _int(params, "after_id"), limit)
        if parts == ["delay", "histogram"]:
            try:
                width = parse_duration(params.get("width") or "1m")
            except ValueError as exc:
                raise Invalid(f"width: {exc}") from None
            return inspector.due_histogram(params.get("topic") or None, int(width * 1000))
        if parts == ["audit"]:
            limit = parse_limit(params.pop("limit", None), 50)
            return inspector.audit_log(_int(params, "before") or None, limit).addCallback(
                lambda rows: {"audit": rows})
        if parts == ["dead-letters", "count"]:
            flt = DeadLetterFilter.parse(params)
            return inspector.ops.dlq_count(flt).addCallback(lambda n: {"matching": n[0], "unreplayed": n[1]})
    if method == "POST" and head == "delay" and len(parts) == 2:
        return inspector.delay_action(parts[1], parse_ids(params.get("ids")), "http", access.actor).addCallback(
            lambda ids: {"changed": ids})
    return _NOT_MINE


def not_mine(result: Any) -> bool:
    return result is _NOT_MINE

