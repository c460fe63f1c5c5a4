"""The delivery log on PostgreSQL: each acknowledged copy is logged exactly once, by the
statement that moves its cursor (``ack_deliveries``), whatever the batch mixes.

The statement reads each cursor of a batch once, as it was before the statement, and logs
an ack only if its copy was not done then: these tests hold it to that for batches that
mix channels and incarnations, repeat an ack, ack what a cursor passed long ago, or name a
channel that is no longer registered. The report of the data pipeline counts these rows.
"""

from __future__ import annotations

from collections.abc import Iterator

import psycopg
import pytest

import registry
from dmq_server.db.messages import (
    AckRow,
    CursorProgress,
    NewMessage,
    ack_deliveries_steps,
    create_owner_steps,
    insert_messages_steps,
)
from dmq_server.db.steps import run_steps
from dmq_server.db.worker import connect

from .support import db_rows


@pytest.fixture
def stored(pg_dsn: str) -> Iterator[tuple[dict[int, list[int]], psycopg.Connection]]:
    """Topic orders (billing, audit); 4 messages stored by each of two incarnations."""
    with connect(pg_dsn, autocommit=True) as conn:
        yield _store(conn), conn


def _store(conn: psycopg.Connection) -> dict[int, list[int]]:
    registry.create_topic(conn, "orders")
    registry.add_channel(conn, "orders", "billing")
    registry.add_channel(conn, "orders", "audit")
    ids: dict[int, list[int]] = {}
    for node in ("node-1", "node-2"):
        owner = run_steps(conn, create_owner_steps(node))
        batch = [NewMessage("orders", node, n, 0, b"x") for n in range(1, 5)]
        ids[owner] = [s.message_id for s in run_steps(conn, insert_messages_steps(batch, node, owner))]
    return ids


def _ack(channel: str, owner: int, message_id: int, consumer: str = "c") -> AckRow:
    return AckRow("orders", channel, message_id, 1_700_000_000_000, 1_700_000_001_000, 1,
                  consumer=consumer, owner=owner, published_ms=1_699_999_999_000)


def _logged(dsn: str) -> list[tuple[str, int, str]]:
    return db_rows(dsn, "SELECT channel, message_id, consumer FROM dmq_delivery_log ORDER BY channel, message_id, id")


def test_a_batch_of_two_channels_and_two_incarnations_logs_each_ack_once(pg_dsn, stored):
    ids, conn = stored
    (o1, a), (o2, b) = sorted(ids.items())
    acks = [_ack("billing", o1, a[0]), _ack("audit", o1, a[0]), _ack("billing", o2, b[1]),
            _ack("audit", o2, b[0]), _ack("audit", o2, b[1])]
    progress = [CursorProgress("orders", "billing", o1, a[0], []), CursorProgress("orders", "audit", o1, a[0], []),
                CursorProgress("orders", "billing", o2, 0, [(b[1], b[1])]),
                CursorProgress("orders", "audit", o2, b[1], [])]
    assert run_steps(conn, ack_deliveries_steps(acks, progress, "")) == 5
    assert _logged(pg_dsn) == sorted([("audit", a[0], "c"), ("audit", b[0], "c"), ("audit", b[1], "c"),
                                      ("billing", a[0], "c"), ("billing", b[1], "c")])


def test_an_ack_whose_copy_was_done_before_is_not_logged_again(pg_dsn, stored):
    ids, conn = stored
    (o1, a), _ = sorted(ids.items())
    first = [_ack("billing", o1, a[0], "first"), _ack("billing", o1, a[2], "first")]
    run_steps(conn, ack_deliveries_steps(first, [CursorProgress("orders", "billing", o1, a[0], [(a[2], a[2])])], ""))
    # a[0] is under the floor now and a[2] in a done span: only a[1] is new
    again = [_ack("billing", o1, m, "again") for m in (a[0], a[1], a[2])]
    run_steps(conn, ack_deliveries_steps(again, [CursorProgress("orders", "billing", o1, a[2], [])], ""))
    assert _logged(pg_dsn) == [("billing", a[0], "first"), ("billing", a[1], "again"), ("billing", a[2], "first")]
    assert db_rows(pg_dsn, "SELECT floor, isempty(done) FROM dmq_cursor WHERE channel = 'billing'") == [(a[2], True)]


def test_an_ack_for_a_channel_no_longer_registered_is_not_logged(pg_dsn, stored):
    ids, conn = stored
    (o1, a), _ = sorted(ids.items())
    conn.execute("DELETE FROM dmq_channel WHERE topic = 'orders' AND name = 'audit'")
    acks = [_ack("audit", o1, a[0]), _ack("billing", o1, a[0])]
    progress = [CursorProgress("orders", "billing", o1, a[0], [])]
    run_steps(conn, ack_deliveries_steps(acks, progress, ""))
    assert _logged(pg_dsn) == [("billing", a[0], "c")]


def test_the_log_is_found_by_time_through_a_brin_index(pg_dsn):
    """Schema version 9: the time index costs an insert almost nothing (BRIN)."""
    rows = db_rows(pg_dsn, "SELECT indexname, indexdef FROM pg_indexes WHERE tablename = 'dmq_delivery_log' "
                           "AND indexdef LIKE %s", "%(acked_at)%")
    assert [(name, "USING brin" in definition) for name, definition in rows] == [("dmq_delivery_log_acked_brin", True)]
