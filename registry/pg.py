"""The single-node registry, kept in PostgreSQL tables (``dmq_topic``, ``dmq_channel``).

``PgRegistry(conn)`` implements ``registry.interface.Registry``; the module-level
functions (``create_topic(conn, ...)`` and so on) are the same operations for
callers holding a connection. Each takes an open connection from
``dmq_server.db.worker.connect`` (or any psycopg connection) and runs in its own transaction.

``mirror_topics(conn, specs)`` is the other direction in a cluster: ZooKeeper holds
the registry, and every node copies what it sees there into these tables, because
the group commit (``insert_messages``) reads ``dmq_channel`` to decide which
channels get a delivery row. It runs in the caller's transaction, serialised
between nodes by an advisory lock, and is idempotent.
"""

from __future__ import annotations

from typing import Any, Sequence

from dmq_sql import queries

from .interface import Registry, check_name, check_settings
from .model import NodeInfo, RegistryError, TopicSpec

__all__ = [
    "PgRegistry",
    "list_topics",
    "topic_of_row",
    "RegistryError",
    "topics",
    "get_topic",
    "create_topic",
    "delete_topic",
    "add_channel",
    "remove_channel",
    "mirror_topics",
    "mirror_changes",
    "clusters",
    "check_cluster",
    "place_topic",
]


def topic_of_row(r: Sequence[Any]) -> TopicSpec:
    """A topic from a row of ``list_topics`` (its columns, in their order)."""
    return TopicSpec(r[0], r[1], r[2], r[3], r[4], r[5], tuple(r[6]), r[7], tuple(r[8]), bool(r[9]), r[10],
                     (r[11], r[12]))


def list_topics(conn: Any) -> list[TopicSpec]:
    """Every topic with its channels, in the caller's transaction."""
    return [topic_of_row(r) for r in conn.execute(queries["list_topics"])]


def topics(conn: Any) -> list[TopicSpec]:
    with conn.transaction():
        return list_topics(conn)


def get_topic(conn: Any, name: str) -> TopicSpec:
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
    cluster: str = "main",
    ordered: bool = False,
    retention_ms: int | None = None,
) -> None:
    check_name("topic", name)
    check_settings(store, msg_timeout_ms, ordered, retention_ms)
    with conn.transaction():
        check_cluster(conn, cluster)
        row = conn.execute(
            queries["create_topic"],
            {
                "name": name,
                "store": store,
                "msg_timeout_ms": msg_timeout_ms,
                "rate_limit": rate_limit,
                "ttl_ms": ttl_ms,
                "max_attempts": max_attempts,
                "cluster": cluster,
                "ordered": ordered,
                "retention_ms": retention_ms,
            },
        ).fetchone()
    if row is None:
        raise RegistryError(f"topic {name!r} already exists")


def clusters(conn: Any) -> dict[str, int]:
    """The clusters dmq nodes have registered on this (the main) database: name -> id slot."""
    return {name: slot for name, slot in conn.execute(queries["list_clusters"])}


def check_cluster(conn: Any, cluster: str) -> None:
    """RegistryError unless a node started with ``--pg-cluster`` naming ``cluster``."""
    known = clusters(conn)
    if cluster not in known:
        raise RegistryError(
            f"unknown cluster {cluster!r}: the clusters are {', '.join(sorted(known))} "
            "(a cluster is known once a node started with --pg-cluster NAME=DSN)"
        )


def place_topic(conn: Any, name: str, cluster: str, draining: Sequence[str]) -> tuple[str, tuple[str, ...]]:
    """Set a topic's cluster and the clusters it drains from; returns the old pair."""
    check_name("topic", name)
    with conn.transaction():
        check_cluster(conn, cluster)
        row = conn.execute(
            queries["place_topic"], {"name": name, "cluster": cluster, "draining": list(draining)}
        ).fetchone()
    if row is None:
        raise RegistryError(f"no such topic {name!r}")
    return row[0], tuple(row[1])


def delete_topic(conn: Any, name: str) -> None:
    check_name("topic", name)
    with conn.transaction():
        row = conn.execute(queries["delete_topic"], {"name": name}).fetchone()
    if row is None:
        raise RegistryError(f"no such topic {name!r}")


def add_channel(conn: Any, topic: str, name: str) -> None:
    check_name("topic", topic)
    check_name("channel", name)
    get_topic(conn, topic)
    with conn.transaction():
        row = conn.execute(queries["add_channel"], {"topic": topic, "name": name}).fetchone()
    if row is None:
        raise RegistryError(f"channel {name!r} already exists on topic {topic!r}")


def remove_channel(conn: Any, topic: str, name: str) -> None:
    check_name("topic", topic)
    check_name("channel", name)
    get_topic(conn, topic)
    with conn.transaction():
        row = conn.execute(queries["remove_channel"], {"topic": topic, "name": name}).fetchone()
    if row is None:
        raise RegistryError(f"no channel {name!r} on topic {topic!r}")


def mirror_topics(conn: Any, specs: Sequence[Any]) -> bool:
    """Make ``dmq_topic``/``dmq_channel`` equal to ``specs`` (ZooKeeper's view).

    Returns whether anything changed. A topic or channel that disappears takes its
    undelivered copies with it, exactly as ``dmq topic delete`` does on one node.
    """
    conn.execute(queries["lock_registry_mirror"])
    changes = mirror_changes(list_topics(conn), specs)
    for name, params in changes:
        conn.execute(queries[name], params)
    return bool(changes)


def mirror_changes(
    current: Sequence[TopicSpec], specs: Sequence[Any], removals: bool = True
) -> list[tuple[str, dict[str, Any]]]:
    """The statements (query name, parameters) that make the tables holding ``current``
    equal to ``specs``, in the order to run them (the server runs them as steps:
    ``dmq_server.db.topic_steps``). Without ``removals`` nothing is deleted: ``specs`` is a
    view kept from an earlier read, which may predate a topic or channel created since
    (deleting its rows would drop its cursors, and the channel, registered again, would
    start after its stored messages)."""
    have = {row.name: row for row in current}
    wanted = {spec.name: spec for spec in specs}
    changes: list[tuple[str, dict[str, Any]]] = []
    for name in sorted(set(have) - set(wanted)) if removals else ():
        changes.append(("delete_topic", {"name": name}))
    for name, spec in sorted(wanted.items()):
        row = have.get(name)
        settings = (
            spec.store, spec.msg_timeout_ms, spec.rate_limit, spec.ttl_ms, spec.max_attempts, spec.cluster,
            tuple(spec.draining), spec.ordered, spec.retention_ms, spec.version,
        )
        if row is None or settings != (
            row.store,
            row.msg_timeout_ms,
            row.rate_limit,
            row.ttl_ms,
            row.max_attempts,
            row.cluster,
            row.draining,
            row.ordered,
            row.retention_ms,
            row.version,
        ):
            # (an older version than the row's is refused by the statement itself: the
            # guard holds for every writer, the CLI's and older code's reads included)
            changes.append((
                "upsert_topic",
                {
                    "name": name,
                    "store": spec.store,
                    "msg_timeout_ms": spec.msg_timeout_ms,
                    "rate_limit": spec.rate_limit,
                    "ttl_ms": spec.ttl_ms,
                    "max_attempts": spec.max_attempts,
                    "cluster": spec.cluster,
                    "draining": list(spec.draining),
                    "ordered": spec.ordered,
                    "retention_ms": spec.retention_ms,
                    "registry_epoch": spec.version[0],
                    "version": spec.version[1],
                },
            ))
        channels = set(row.channels) if row is not None else set()
        for channel in sorted(set(spec.channels) - channels):
            changes.append(("add_channel", {"topic": name, "name": channel}))
        for channel in sorted(channels - set(spec.channels)) if removals else ():
            changes.append(("remove_channel", {"topic": name, "name": channel}))
    return changes


class PgRegistry(Registry):
    """The Registry interface over one PostgreSQL connection (autocommit)."""

    def __init__(self, conn: Any, local_node: NodeInfo | None = None):
        self.conn = conn
        self._local = local_node

    def topics(self) -> list[TopicSpec]:
        return topics(self.conn)

    def get_topic(self, name: str) -> TopicSpec:
        return get_topic(self.conn, name)

    def create_topic(self, name: str, **settings: Any) -> None:
        create_topic(self.conn, name, **settings)

    def clusters(self) -> list[str]:
        return sorted(clusters(self.conn))

    def place_topic(self, name: str, cluster: str, draining: Sequence[str]) -> tuple[str, tuple[str, ...]]:
        return place_topic(self.conn, name, cluster, draining)

    def delete_topic(self, name: str) -> None:
        delete_topic(self.conn, name)

    def add_channel(self, topic: str, name: str) -> None:
        add_channel(self.conn, topic, name)

    def remove_channel(self, topic: str, name: str) -> None:
        remove_channel(self.conn, topic, name)

    def nodes(self) -> list[NodeInfo]:
        """A single node does not register anywhere: only itself, if it said who it is."""
        return [self._local] if self._local is not None else []

    def close(self) -> None:
        self.conn.close()
