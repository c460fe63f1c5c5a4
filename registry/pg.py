"""The single-node registry, kept in PostgreSQL tables (``dmq_topic``, ``dmq_channel``).

Each operation takes an open connection from ``dmq_server.store.connect`` and
runs in its own transaction; errors are ``RegistryError`` with a message an
operator can act on (unknown name, duplicate, invalid name).
"""

from __future__ import annotations

from typing import Any

from dmq_client.wire import valid_name
from dmq_server.store import TopicRow, list_topics
from dmq_sql import queries

__all__ = [
    "RegistryError",
    "topics",
    "get_topic",
    "create_topic",
    "delete_topic",
    "add_channel",
    "remove_channel",
]


class RegistryError(Exception):
    """A registry operation was refused; the message says why."""


def _check(kind: str, name: str) -> None:
    if not valid_name(name):
        raise RegistryError(
            f"invalid {kind} name {name!r}: use 1-64 characters from [.a-zA-Z0-9_-], "
            "optionally ending in #ephemeral"
        )


def topics(conn: Any) -> list[TopicRow]:
    with conn.transaction():
        return list_topics(conn)


def get_topic(conn: Any, name: str) -> TopicRow:
    for row in topics(conn):
        if row.name == name:
            return row
    raise RegistryError(f"no such topic {name!r}")


def create_topic(
    conn: Any,
    name: str,
    *,
    store: str = "reliable",
    msg_timeout_ms: int = 60000,
    rate_limit: int | None = None,
    ttl_ms: int | None = None,
    max_attempts: int | None = None,
) -> None:
    _check("topic", name)
    if store not in ("reliable", "fast"):
        raise RegistryError(f"invalid store {store!r}: use reliable or fast")
    if msg_timeout_ms <= 0:
        raise RegistryError("message timeout must be positive")
    with conn.transaction():
        row = conn.execute(
            queries["create_topic"],
            {
                "name": name,
                "store": store,
                "msg_timeout_ms": msg_timeout_ms,
                "rate_limit": rate_limit,
                "ttl_ms": ttl_ms,
                "max_attempts": max_attempts,
            },
        ).fetchone()
    if row is None:
        raise RegistryError(f"topic {name!r} already exists")


def delete_topic(conn: Any, name: str) -> None:
    _check("topic", name)
    with conn.transaction():
        row = conn.execute(queries["delete_topic"], {"name": name}).fetchone()
    if row is None:
        raise RegistryError(f"no such topic {name!r}")


def add_channel(conn: Any, topic: str, name: str) -> None:
    _check("topic", topic)
    _check("channel", name)
    get_topic(conn, topic)
    with conn.transaction():
        row = conn.execute(queries["add_channel"], {"topic": topic, "name": name}).fetchone()
    if row is None:
        raise RegistryError(f"channel {name!r} already exists on topic {topic!r}")


def remove_channel(conn: Any, topic: str, name: str) -> None:
    _check("topic", topic)
    _check("channel", name)
    get_topic(conn, topic)
    with conn.transaction():
        row = conn.execute(queries["remove_channel"], {"topic": topic, "name": name}).fetchone()
    if row is None:
        raise RegistryError(f"no channel {name!r} on topic {topic!r}")
