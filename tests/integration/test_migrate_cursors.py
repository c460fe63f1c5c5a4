"""Migration 0007 on a database with waiting messages: delivery rows become cursors.

A database at schema version 6 is filled the way the old server left it: messages of two
nodes, a delivery row per channel for every copy not yet acknowledged (some delivered
before, with attempts; one channel added after some messages were stored, so it never got
their rows), acknowledged copies in the delivery log. After ``migrate()`` the view of the
copies waiting (``dmq_pending``) must hold exactly the old delivery rows with their
attempts, and a real server started on the database must deliver exactly those copies,
each once, and nothing that was acknowledged before the migration.
"""

from __future__ import annotations

import psycopg
import pytest

from dmq_client.wire import Command
from dmq_sql import migrations
from dmq_server.db.schema import migrate
from dmq_server.db.worker import connect

from .support import db_rows

pytestmark = pytest.mark.integration


def _migrate_to(dsn: str, version: int) -> None:
    """The schema as a server of ``version`` left it."""
    assert migrate(dsn, up_to=version) == list(range(1, version + 1))


def _fill_version_6(dsn: str) -> dict[tuple[str, int], int]:
    """The old layout, as the old server wrote it; returns {(channel, message id): attempts}
    of the copies still waiting."""
    waiting: dict[tuple[str, int], int] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO dmq_topic (name) VALUES ('orders')")
        conn.execute("INSERT INTO dmq_channel (topic, name) VALUES ('orders', 'billing')")
        ids = []
        for i in range(60):
            node = "node-a:4150" if i % 3 else "node-b:4150"
            if i == 30:  # a channel registered later: its copies start here
                conn.execute("INSERT INTO dmq_channel (topic, name) VALUES ('orders', 'audit')")
            channels = ["billing"] if i < 30 else ["billing", "audit"]
            (mid,) = conn.execute(
                "INSERT INTO dmq_message (topic, producer, session_id, node_id, body) "
                "VALUES ('orders', 'p', %s, %s, %s) RETURNING id",
                (i, node, b"m%d" % i),
            ).fetchone()
            ids.append(mid)
            # another topic's message between them (ids interleave in one sequence)
            conn.execute(
                "INSERT INTO dmq_message (topic, producer, session_id, node_id, body) VALUES ('other', 'q', %s, %s, 'x')",
                (i, node),
            )
            for channel in channels:
                acked = (i % 4 == 0 and channel == "billing") or (i % 5 == 0 and channel == "audit")
                if acked:
                    conn.execute(
                        "INSERT INTO dmq_delivery_log (message_id, topic, channel, published_at, acked_at, attempts) "
                        "VALUES (%s, 'orders', %s, now(), now(), 1)",
                        (mid, channel),
                    )
                    continue
                attempts = 2 if i % 7 == 0 else 0
                owner = node if i % 11 else "node-c:4150"  # some copies were taken over
                conn.execute(
                    "INSERT INTO dmq_delivery (topic, channel, message_id, attempts, owner) "
                    "VALUES ('orders', %s, %s, %s, %s)",
                    (channel, mid, attempts, owner),
                )
                waiting[(channel, mid)] = attempts
    return waiting


def test_waiting_copies_survive_the_migration_and_are_delivered_once(pg_empty_dsn, make_server):
    _migrate_to(pg_empty_dsn, 6)
    waiting = _fill_version_6(pg_empty_dsn)
    assert migrate(pg_empty_dsn) == [v for v, _, _ in migrations() if v > 6]

    pending = db_rows(pg_empty_dsn, "SELECT channel, message_id, attempts FROM dmq_pending")
    assert {(c, m): a for c, m, a in pending} == waiting and len(pending) == len(waiting)
    owners = db_rows(pg_empty_dsn, "SELECT node_id, retired_at IS NOT NULL FROM dmq_owner ORDER BY node_id")
    assert owners == [("node-a:4150", True), ("node-b:4150", True)]
    with connect(pg_empty_dsn, autocommit=True) as conn:  # the old table is gone
        assert conn.execute("SELECT to_regclass('dmq_delivery')").fetchone()[0] is None

    server = make_server(dsn=pg_empty_dsn)
    received: dict[str, list[int]] = {"billing": [], "audit": []}
    with server.client() as billing, server.client() as audit:
        for client, channel in ((billing, "billing"), (audit, "audit")):
            assert client.subscribe("orders", channel).command == Command.SUBSCRIBE_ACK
        for client, channel in ((billing, "billing"), (audit, "audit")):
            while (push := client.receive(timeout=2.0)) is not None:
                received[channel].append(push.message_id)
                client.ack(push)
    for channel in ("billing", "audit"):
        expected = sorted(m for c, m in waiting if c == channel)
        assert sorted(received[channel]) == expected, f"{channel}: delivered {len(received[channel])}"
        assert len(set(received[channel])) == len(received[channel])
