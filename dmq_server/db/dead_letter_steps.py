"""The dead-letter table (``dmq_dead_letter``) as the server writes it: recording
dead letters, persisting delivery attempts, and moving exhausted or expired copies.

How messages get there (the broker's sink, its batchers and sweep) is
``dmq_server.reliable.dead_letters``; reading, replaying and deleting them is
``dmq_server.db.admin_steps``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import psycopg

from dmq_client.wire.properties import NO_PROPERTIES, Properties

from dmq_server.db.messages import headers_text
from dmq_server.db.steps import Statement, Steps, run_steps

__all__ = [
    "REASONS",
    "NewDeadLetter",
    "CopyRef",
    "insert_dead_letters",
    "insert_dead_letters_steps",
    "record_attempts_steps",
    "exhaust_deliveries_steps",
    "expire_deliveries_steps",
    "open_ttl_cursors_steps",
]

REASONS = ("rate_limited", "storage_failure", "expired", "max_attempts", "client_reported", "operator")


@dataclass(slots=True)
class NewDeadLetter:
    reason: str
    topic: str
    producer: str
    session_id: int | None
    body: bytes = field(repr=False)
    detail: str = ""
    channel: str | None = None
    message_id: int | None = None
    attempts: int = 0
    published_ms: int = 0
    # the message's key, priority and headers (``Send.properties``, a report's): kept with
    # the letter, so that its replay is the message as it was sent
    properties: Properties = NO_PROPERTIES


@dataclass(slots=True)
class CopyRef:
    """One channel's copy of a message (attempts: as counted in memory)."""

    topic: str
    channel: str
    message_id: int
    attempts: int = 0
    owner: int = 0  # the incarnation that stored it (its cursor is per owner)
    epoch: int = 0  # the channel's epoch when it was pushed (exhaust_deliveries: a seek since refuses it)


def insert_dead_letters_steps(batch: Sequence[NewDeadLetter], node_id: str = "") -> Steps[list[int]]:
    """Record a batch; returns the new ids in batch order. Steps, for the group
    commit."""
    for item in batch:
        if item.reason not in REASONS:
            raise ValueError(f"unknown dead-letter reason {item.reason!r}")
    rows = yield Statement(
        "insert_dead_letters",
        {
            "reasons": [d.reason for d in batch],
            "details": [d.detail for d in batch],
            "topics": [d.topic for d in batch],
            "channels": [d.channel for d in batch],
            "producers": [d.producer for d in batch],
            "session_ids": [d.session_id for d in batch],
            "message_ids": [d.message_id for d in batch],
            "attempts": [d.attempts for d in batch],
            "bodies": [d.body for d in batch],
            "published_ms": [d.published_ms for d in batch],
            "keys": [d.properties.key for d in batch],
            "priorities": [d.properties.priority for d in batch],
            "headers": [headers_text(d.properties.headers) for d in batch],  # cast to jsonb there
        },
    )
    return [r[0] for r in rows]


def insert_dead_letters(conn: psycopg.Connection, batch: Sequence[NewDeadLetter], node_id: str = "") -> list[int]:
    """``insert_dead_letters_steps`` over a blocking connection (tests, tools)."""
    return run_steps(conn, insert_dead_letters_steps(batch, node_id))


def _copy_params(rows: Sequence[CopyRef]) -> dict:
    return {
        "topics": [r.topic for r in rows],
        "channels": [r.channel for r in rows],
        "owners": [r.owner for r in rows],
        "message_ids": [r.message_id for r in rows],
        "attempts": [r.attempts for r in rows],
    }


def record_attempts_steps(rows: Sequence[CopyRef]) -> Steps[int]:
    """Persist the attempts counted in memory (the larger count wins); returns how
    many copies were still stored."""
    ((stored,),) = yield Statement("record_attempts", _copy_params(rows), count=True)
    return stored


def exhaust_deliveries_steps(
    rows: Sequence[CopyRef], holder: str = "", fenced: bool = False
) -> Steps[list[tuple[str, str, int]]]:
    """Copies that used up their attempts -> dead letters, done for their channel;
    [(topic, channel, message_id)] of the copies that were still waiting. ``fenced`` (a
    cluster): only those of cursors ``holder`` still holds; anywhere, only those pushed in
    their channel's epoch (not sought since)."""
    found = yield Statement("exhaust_deliveries", dict(_copy_params(rows), epochs=[r.epoch for r in rows],
                                                       holder=holder, fenced=fenced))
    return [tuple(r) for r in found]


def open_ttl_cursors_steps() -> Steps[int]:
    """A cursor row for every (channel, owner) of a topic with a time to live that stored
    a copy for it: what ``expire_deliveries_steps`` locks. Run and committed first, in a
    transaction of its own: an ack statement that began before a row existed cannot lock
    it (its snapshot has none) and meets it only in its upsert, which fails the statement
    to run it again (sql/queries.sql, ack_deliveries' ``batch``); committed before the
    expiry, the rows are there for every ack statement that begins after, and only one
    already under way takes that second run. The number of rows opened."""
    ((opened,),) = yield Statement("open_ttl_cursors", {}, count=True)
    return opened


def expire_deliveries_steps(
    now_ms: int, limit: int, holder: str = "", fenced: bool = False
) -> Steps[list[tuple[str, str, int]]]:
    """Up to ``limit`` copies past their topic's time to live -> dead letters;
    [(topic, channel, message_id)]. Only copies of cursor rows that exist
    (``open_ttl_cursors_steps``, committed before), each locked (two nodes, or an ack
    batch, never take the same copy); ``fenced`` (a cluster): only those of cursors
    ``holder`` holds."""
    found = yield Statement("expire_deliveries", {"now_ms": now_ms, "limit": limit, "holder": holder,
                                                  "fenced": fenced})
    return [tuple(r) for r in found]
