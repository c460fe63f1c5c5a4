"""The message trace's statements: recording returned deliveries, reading one message's
stored facts, peeking at a channel's waiting copies, and the stored gauges of ``/metrics``;
all steps (``db.steps``), so the in-memory double answers them too.

A message's life is spread over the tables that hold it (``sql/migrations/0006_trace.sql``
says which): ``read_trace_steps`` reads each with one indexed lookup and puts the facts in time
order, so the CLI (``dmq trace``), the admin API and the console show the same story. What
only a running node knows (a copy in flight right now) is added by ``admin.inspect``.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Sequence, TypedDict

from dmq_client.wire.properties import trace_id
from dmq_server.db.steps import Statement, Steps

__all__ = [
    "ReturnRow",
    "record_returns_steps",
    "sweep_trace_steps",
    "read_trace_steps",
    "find_message_steps",
    "peek_channel_steps",
    "body_preview",
    "MessageProperties",
    "properties_of_row",
    "read_gauges_steps",
    "PREVIEW_BYTES",
]

#: bytes of a body the trace and peek show (the dead-letter view shows whole bodies)
PREVIEW_BYTES = 4096


@dataclass(slots=True)
class ReturnRow:
    """A delivery that came back unacknowledged (``reliable.channel`` RETURN_REASONS)."""

    message_id: int
    topic: str
    channel: str
    attempt: int
    reason: str
    consumer: str
    delivered_ms: int
    returned_ms: int


def record_returns_steps(rows: Sequence[ReturnRow], node_id: str) -> Steps:
    """One statement for a batch of returns; returns how many were written."""
    ((written,),) = yield Statement(
        "record_returns",
        {
            "message_ids": [r.message_id for r in rows],
            "topics": [r.topic for r in rows],
            "channels": [r.channel for r in rows],
            "attempts": [r.attempt for r in rows],
            "reasons": [r.reason for r in rows],
            "consumers": [r.consumer for r in rows],
            "delivered_ms": [r.delivered_ms for r in rows],
            "returned_ms": [r.returned_ms for r in rows],
            "node_id": node_id,
        },
        count=True,
    )
    return written


def sweep_trace_steps(retention_s: float, limit: int) -> Steps:
    """Drop up to ``limit`` returns older than ``retention_s``; returns how many."""
    ((swept,),) = yield Statement("sweep_trace", {"retention_s": retention_s, "limit": limit}, count=True)
    return swept


class Event(TypedDict, total=False):
    """One fact of a message's trace (``read_trace_steps``); ``at_ms`` and ``event``
    always, the rest as the kind of event has them."""

    at_ms: int | None
    event: str
    topic: str
    channel: str
    attempt: int
    consumer: str
    node_id: str
    producer: str
    session_id: int
    reason: str
    detail: str
    dead_letter_id: int
    replay_message_id: int


def body_preview(data: bytes | memoryview | None, size: int) -> dict[str, object]:
    """A body (or its first bytes) as JSON can carry it: UTF-8 text, else base64."""
    raw = bytes(data or b"")
    out: dict[str, object] = {"size": size, "truncated": size > len(raw)}
    try:
        out["body"], out["body_encoding"] = raw.decode("utf-8"), "utf-8"
    except UnicodeDecodeError:
        out["body"], out["body_encoding"] = base64.b64encode(raw).decode("ascii"), "base64"
    return out


class MessageProperties(TypedDict):
    """A message's properties as the trace, peek and the delay view show them (the JSON
    names a dead letter's have): ``key`` and ``headers`` None for none, as stored."""

    key: str | None
    priority: int
    headers: dict[str, str] | None
    trace_id: str | None


def properties_of_row(key: str | None, priority: int, headers: dict[str, str] | None) -> MessageProperties:
    """The three columns schema 16 added (``headers`` is jsonb, read as a dict), as JSON
    fields: an operator looking at a message sees what its consumers get with it; and the
    trace id its ``traceparent`` names (dmq_client.otel puts it there), to look up in the
    tracing backend."""
    return {"key": key, "priority": priority, "headers": headers, "trace_id": trace_id(headers)}


def find_message_steps(producer: str, session_id: int) -> Steps:
    """The id stored for (producer, session id), or None."""
    rows = yield Statement("find_message_by_session", {"producer": producer, "session_id": session_id})
    return rows[0][0] if rows else None


def read_trace_steps(message_id: int, preview: int = PREVIEW_BYTES) -> Steps:
    """Every stored fact about ``message_id``: ``stored`` (None once swept without an
    archive), ``pending`` copies, ``events`` in time order (stored, delivered, returned,
    acked, dead_letter, replayed), and ``delayed`` when the id names a delay entry
    instead. Times are Unix milliseconds."""
    params = {"id": message_id, "preview": preview}
    stored_rows = yield Statement("trace_stored", params)
    stored_row = stored_rows[0] if stored_rows else None
    events: list[Event] = []
    stored = None
    replay_of = None
    topic = None
    if stored_row is not None:
        mid, topic, producer, session_id, produced_ms, published_ms, node_id, size, body, swept, *props = stored_row
        stored = {
            "topic": topic,
            "producer": producer,
            "session_id": session_id,
            "produced_ms": produced_ms,
            "published_ms": published_ms,
            "node_id": node_id,
            "swept": swept,
            **properties_of_row(*props),
            **body_preview(body, size),
        }
        if producer == "dmq-replay":  # the replay of a dead letter: its session id is the letter's id
            replay_of = session_id
        events.append({"at_ms": published_ms, "event": "stored", "node_id": node_id, "producer": producer,
                       "session_id": session_id})
    for channel, attempt, reason, consumer, node_id, delivered_ms, returned_ms in (
        yield Statement("trace_returns", params)
    ):
        events.append({"at_ms": delivered_ms, "event": "delivered", "channel": channel, "attempt": attempt,
                       "consumer": consumer, "node_id": node_id})
        events.append({"at_ms": returned_ms, "event": "returned", "channel": channel, "attempt": attempt,
                       "reason": reason, "consumer": consumer, "node_id": node_id})
    for log_topic, channel, attempts, consumer, published_ms, first_ms, delivered_ms, acked_ms in (
        yield Statement("trace_acks", params)
    ):
        topic = topic or log_topic
        if stored is None and not any(e["event"] == "stored" for e in events):
            events.append({"at_ms": published_ms, "event": "stored", "topic": log_topic})
        if delivered_ms is None and attempts == 1:
            delivered_ms = first_ms  # logged before version 6: the first push was the last
        if delivered_ms is not None:
            events.append({"at_ms": delivered_ms, "event": "delivered", "channel": channel, "attempt": attempts,
                           "consumer": consumer})
        events.append({"at_ms": acked_ms, "event": "acked", "channel": channel, "attempt": attempts,
                       "consumer": consumer})
    letters = yield Statement("trace_dead_letters", dict(params, replay_of=replay_of or 0))
    for letter_id, reason, detail, letter_topic, channel, attempts, dead_ms, replayed_ms, replay_id, of_id in letters:
        if of_id != message_id:
            continue  # the letter this message replays, below
        topic = topic or letter_topic
        events.append({"at_ms": dead_ms, "event": "dead_letter", "channel": channel, "reason": reason,
                       "detail": detail, "attempt": attempts, "dead_letter_id": letter_id})
        if replayed_ms is not None:
            events.append({"at_ms": replayed_ms, "event": "replayed", "channel": channel,
                           "dead_letter_id": letter_id, "replay_message_id": replay_id})
    pending = []
    if topic is not None:
        pending = [
            {"channel": channel, "attempts": attempts, "owner": owner}
            for channel, attempts, owner in (yield Statement("trace_pending", dict(params, topic=topic)))
        ]
    replayed_from = None
    for letter_id, reason, detail, letter_topic, channel, attempts, dead_ms, _, _, of_id in letters:
        if letter_id == replay_of and of_id != message_id:
            replayed_from = {"dead_letter_id": letter_id, "reason": reason, "detail": detail,
                             "channel": channel, "message_id": of_id, "dead_ms": dead_ms}
    events.sort(key=_in_order)
    out: dict[str, object] = {
        "message_id": message_id,
        "found": bool(events) or bool(pending),
        "topic": topic,
        "stored": stored,
        "replay_of": replayed_from,
        "pending": pending,
        "events": events,
        "delayed": None,
    }
    if not out["found"]:
        delayed_rows = yield Statement("trace_delayed", params)
        if delayed_rows:
            row = delayed_rows[0]
            did, d_topic, channel, producer, session_id, due_ms, fragment, node_id, created_ms, size, body, r_of, *props = row
            out["delayed"] = {
                "delay_id": did, "topic": d_topic, "channel": channel, "producer": producer,
                "session_id": session_id, "due_ms": due_ms, "fragment": fragment, "node_id": node_id,
                "created_ms": created_ms, "replay_of": r_of, **properties_of_row(*props), **body_preview(body, size),
            }
    return out


#: events at the same millisecond, in the order they must have happened
_ORDER = {"stored": 0, "delivered": 1, "returned": 2, "acked": 3, "dead_letter": 4, "replayed": 5}


def _in_order(event: Event) -> tuple[int, int, int]:
    """Time, then (within a millisecond) the delivery attempt, then the kind: a REQ and the
    redelivery it causes often share their millisecond."""
    kind = event["event"]
    attempt = event.get("attempt") or (0 if kind == "stored" else 1 << 30)
    return event["at_ms"] or 0, attempt, _ORDER.get(kind, 9)


def peek_channel_steps(topic: str, channel: str, after: int = 0, limit: int = 20, preview: int = 512) -> Steps:
    """A channel's stored, unacknowledged copies after ``after``, oldest first, each with
    its message's properties; the rows are read, nothing is locked or changed (in-flight
    copies are among them)."""
    rows = yield Statement(
        "peek_channel", {"topic": topic, "channel": channel, "after": after, "limit": limit, "preview": preview}
    )
    return [
        {
            "message_id": mid, "attempts": attempts, "owner": owner, "producer": producer,
            "session_id": session_id, "published_ms": published_ms, **properties_of_row(*props),
            **body_preview(body, size),
        }
        for mid, attempts, owner, producer, session_id, published_ms, size, body, *props in rows
    ]


def read_gauges_steps(lowest: dict[tuple[str, str], int | None] | None = None) -> Steps:
    """The figures ``/metrics`` takes from PostgreSQL (refreshed on a timer, never in a
    scrape): each channel's oldest unacknowledged publish time, delayed messages per
    topic, and stored dead letters by reason. The oldest is the publish time of the
    channel's lowest unacknowledged id in ``lowest`` (the depth count's last pass, by
    channel): one probe by primary key each, None where the id is None or not stored here
    (another cluster's, or acknowledged and swept since)."""
    lowest = lowest or {}
    ids = sorted({i for i in lowest.values() if i is not None})
    published: dict[int, int] = dict((yield Statement("published_at", {"ids": ids}))) if ids else {}
    oldest = {key: published.get(i) if i is not None else None for key, i in lowest.items()}
    delayed = {t: (n, due) for t, n, due in (yield Statement("delay_pending_by_topic", {}))}
    letters = {reason: (total, replayed) for reason, total, replayed in (yield Statement("dead_letter_counts", {}))}
    return {"oldest_unacked_ms": oldest, "delay_pending": delayed, "dead_letters": letters}
