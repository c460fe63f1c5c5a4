"""The reliable store's hot statements: group commit, durable acks, backlog reads.

The group commit and the ack batch are steps (``dmq_server.db.steps``), so the
reactor-driven connection and the worker threads run the same code.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import psycopg

from dmq_server.db.errors import StorageError
from dmq_server.db.steps import Statement, Steps, add_statement, run_steps
from dmq_sql import queries

__all__ = [
    "NewMessage",
    "StoredMessage",
    "BacklogRow",
    "AckRow",
    "insert_messages",
    "insert_messages_steps",
    "send_columns",
    "INSERT_NEW_MESSAGES",
    "HOT_STATEMENTS",
    "ack_deliveries_steps",
    "load_backlog",
    "load_backlog_steps",
    "sweep_messages",
    "sweep_messages_steps",
    "run_query",
    "run_query_steps",
    "read_channel_state",
    "read_channel_state_steps",
]




@dataclass(slots=True)
class NewMessage:
    """A validated send waiting for the group commit."""

    topic: str
    producer: str
    session_id: int
    produced_ms: int
    body: bytes


@dataclass(slots=True)
class StoredMessage:
    """What the commit made of a NewMessage. ``duplicate``: it was stored before."""

    message_id: int
    published_ms: int
    channels: tuple[str, ...]
    duplicate: bool


# Resends are rare, and ON CONFLICT's speculative insertion costs PostgreSQL about a
# sixth of the statement's CPU per message (bench/insert_cost.py). So a batch is
# first inserted without it; only a batch that meets a stored pair (a unique
# violation, which inserts nothing) runs the statement as written in queries.sql.
_ON_CONFLICT = "ON CONFLICT (producer, session_id) DO NOTHING"
if queries["insert_messages"].count(_ON_CONFLICT) != 1:
    raise RuntimeError(f"sql/queries.sql: insert_messages must hold {_ON_CONFLICT!r} once")
INSERT_NEW_MESSAGES = queries["insert_messages"].replace(_ON_CONFLICT, "")
# its own name, so the in-memory double answers it (a stored pair: a unique violation)
add_statement("insert_new_messages", INSERT_NEW_MESSAGES)


def send_columns(batch: Sequence[Any], node_id: str) -> dict[str, Any]:
    """The array parameters every stored send carries (insert_messages, insert_delayed):
    one list per column, in batch order, and the storing node."""
    return {
        "topics": [m.topic for m in batch],
        "producers": [m.producer for m in batch],
        "session_ids": [m.session_id for m in batch],
        "produced_ms": [m.produced_ms for m in batch],
        "bodies": [m.body for m in batch],
        "node_id": node_id,
    }


def insert_messages_steps(batch: Sequence[NewMessage], node_id: str) -> Steps:
    """Store a batch and its deliveries: one statement, atomic on its own (the
    writers run it in autocommit); resent pairs are then read back. One
    StoredMessage per item, in order."""
    params = send_columns(batch, node_id)
    try:
        rows = yield Statement("insert_new_messages", params, may_fail=True)
    except psycopg.errors.UniqueViolation:
        rows = yield Statement("insert_messages", params)
    fresh = {(r[1], r[2]): StoredMessage(r[0], r[3], tuple(r[4]), False) for r in rows}
    missing = [m for m in batch if (m.producer, m.session_id) not in fresh]
    if missing:
        found = yield Statement(
            "find_messages",
            {
                "producers": [m.producer for m in missing],
                "session_ids": [m.session_id for m in missing],
            },
        )
        for r in found:
            fresh.setdefault((r[1], r[2]), StoredMessage(r[0], r[3], (), True))
    results = []
    seen: set[tuple[str, int]] = set()
    for m in batch:
        key = (m.producer, m.session_id)
        stored = fresh.get(key)
        if stored is None:
            raise StorageError(f"message {key} neither stored nor found")
        if key in seen and not stored.duplicate:
            # the same pair twice in one batch: the second is a resend
            stored = StoredMessage(stored.message_id, stored.published_ms, (), True)
        seen.add(key)
        results.append(stored)
    return results


def find_stored_steps(pairs: Sequence[tuple[str, int]]) -> Steps:
    """Which of the (producer, session id) pairs are stored: sends whose outcome was
    unknown (``Broker``'s check, until the store shows them)."""
    rows = yield Statement(
        "find_messages",
        {"producers": [p for p, _ in pairs], "session_ids": [s for _, s in pairs]},
    )
    return [(r[1], r[2]) for r in rows]


# prepared once per connection by the reactor-driven writers and acker (reactor_db)
HOT_STATEMENTS = (INSERT_NEW_MESSAGES, queries["insert_messages"], queries["ack_deliveries"])


def insert_messages(
    conn: psycopg.Connection, batch: Sequence[NewMessage], node_id: str
) -> list[StoredMessage]:
    """``insert_messages_steps`` over a blocking connection."""
    return run_steps(conn, insert_messages_steps(batch, node_id))


@dataclass(slots=True)
class AckRow:
    topic: str
    channel: str
    message_id: int
    first_ms: int
    acked_ms: int
    attempts: int
    consumer: str = ""  # the consumer that acknowledged it (the message trace)
    delivered_ms: int = 0  # when the acknowledged delivery was pushed


def ack_deliveries_steps(acks: Sequence[AckRow]) -> Steps:
    """Drop the acknowledged delivery rows and log them: one statement. Returns how
    many acks the batch held (acks of rows already gone, e.g. acked twice, change nothing)."""
    yield Statement(
        "ack_deliveries",
        {
            "topics": [a.topic for a in acks],
            "channels": [a.channel for a in acks],
            "message_ids": [a.message_id for a in acks],
            "first_ms": [a.first_ms for a in acks],
            "acked_ms": [a.acked_ms for a in acks],
            "attempts": [a.attempts for a in acks],
            "consumers": [a.consumer for a in acks],
            "delivered_ms": [a.delivered_ms for a in acks],
        },
    )
    return len(acks)


@dataclass(slots=True)
class BacklogRow:
    message_id: int
    producer: str
    session_id: int
    published_ms: int
    body: bytes
    attempts: int


def load_backlog_steps(
    topic: str, channel: str, after: int, limit: int, owner: str | None = None
) -> Steps:
    """A channel's stored copies after ``after``; in a cluster (``owner`` set) only the
    copies that node owns."""
    params: dict[str, Any] = {"topic": topic, "channel": channel, "after": after, "limit": limit}
    if owner is None:
        rows = yield Statement("load_backlog", params)
    else:
        rows = yield Statement("load_owned_backlog", dict(params, owner=owner))
    return [BacklogRow(r[0], r[1], r[2], r[3], bytes(r[4]), r[5]) for r in rows]


def load_backlog(
    conn: psycopg.Connection,
    topic: str,
    channel: str,
    after: int,
    limit: int,
    owner: str | None = None,
) -> list[BacklogRow]:
    """``load_backlog_steps`` over a blocking connection."""
    return run_steps(conn, load_backlog_steps(topic, channel, after, limit, owner))


def run_query_steps(name: str, params: dict[str, Any]) -> Steps:
    """The named statement of ``sql/queries.sql``; returns the rows it changed."""
    return (yield Statement(name, params, count=True))


def run_query(conn: psycopg.Connection, name: str, params: dict[str, Any]) -> int:
    """``run_query_steps`` over a blocking connection."""
    return run_steps(conn, run_query_steps(name, params))


def read_channel_state_steps() -> Steps:
    """Stored copies per (topic, channel), and the channels an operator paused."""
    depth_rows = yield Statement("channel_depths", {})
    pause_rows = yield Statement("channel_pauses", {})
    depths = {(t, c): n for t, c, n in depth_rows}
    held = {(t, c) for t, c in pause_rows}
    return depths, held


def read_channel_state(
    conn: psycopg.Connection,
) -> tuple[dict[tuple[str, str], int], set[tuple[str, str]]]:
    """``read_channel_state_steps`` over a blocking connection."""
    return run_steps(conn, read_channel_state_steps())


def sweep_messages_steps(retention_s: float, limit: int) -> Steps:
    """Drop up to ``limit`` fully acknowledged messages older than ``retention_s``;
    returns how many."""
    return (yield Statement("sweep_messages", {"retention_s": retention_s, "limit": limit}, count=True))


def sweep_messages(conn: psycopg.Connection, retention_s: float, limit: int) -> int:
    return run_steps(conn, sweep_messages_steps(retention_s, limit))
