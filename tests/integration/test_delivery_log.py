"""The delivery log on PostgreSQL: each acknowledged copy is logged exactly once, by the
statement that moves its cursor (``ack_deliveries``), whatever the batch mixes.

The statement reads each cursor of a batch once, as it was before the statement, and logs
an ack only if its copy was not done then: these tests hold it to that for batches that
mix channels and incarnations, repeat an ack, ack what a cursor passed long ago, or name a
channel that is no longer registered. The report of the data pipeline counts these rows.
Since schema version 10 the facts of one statement are one dmq_delivery_batch row, read
one fact per row through the dmq_delivery_log view.
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
    assert run_steps(conn, ack_deliveries_steps(acks, progress, "")) == []
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


def test_an_ack_among_done_ranges_is_not_logged_again_between_new_ones(pg_dsn, stored):
    """The statement decides per cursor whether a batch can go in as it came: a done range
    inside the batch's id span sends it through the per-ack check."""
    ids, conn = stored
    (o1, a), _ = sorted(ids.items())
    run_steps(conn, ack_deliveries_steps([_ack("billing", o1, a[2], "first")],
                                         [CursorProgress("orders", "billing", o1, 0, [(a[2], a[2])])], ""))
    again = [_ack("billing", o1, m, "again") for m in (a[1], a[2], a[3])]
    run_steps(conn, ack_deliveries_steps(again, [CursorProgress("orders", "billing", o1, a[3], [])], ""))
    assert _logged(pg_dsn) == [("billing", a[1], "again"), ("billing", a[2], "first"), ("billing", a[3], "again")]


def test_a_batch_is_one_row_and_reads_back_as_one_fact_per_ack(pg_dsn, stored):
    """Schema version 10: the acks of one statement are one dmq_delivery_batch row; the
    dmq_delivery_log view gives back each ack's own values, 0 times as NULL, and ids that
    follow the batch's first_fact in the order the acks came."""
    ids, conn = stored
    (o1, a), (o2, b) = sorted(ids.items())
    acks = [AckRow("orders", "billing", a[1], 0, 1_700_000_002_000, 3, consumer="c1", owner=o1,
                   published_ms=1_699_999_999_000, delivered_ms=1_700_000_001_500),
            AckRow("orders", "audit", b[0], 1_700_000_000_000, 1_700_000_001_000, 1, consumer="c2", owner=o2,
                   published_ms=1_699_999_998_000)]
    progress = [CursorProgress("orders", "billing", o1, a[1], []), CursorProgress("orders", "audit", o2, b[0], [])]
    run_steps(conn, ack_deliveries_steps(acks, progress, ""))
    (batch, first_fact, low, high, facts, acked), = db_rows(
        pg_dsn, "SELECT id, first_fact, low_id, high_id, cardinality(message_ids), "
                "(extract(epoch FROM acked_at) * 1000)::bigint FROM dmq_delivery_batch")
    assert (first_fact, low, high, facts, acked) == (batch << 20, a[1], b[0], 2, 1_700_000_002_000)
    ms = "(extract(epoch FROM {}) * 1000)::bigint"
    rows = db_rows(pg_dsn, f"SELECT id, channel, message_id, {ms.format('published_at')}, "
                           f"{ms.format('first_delivered_at')}, {ms.format('acked_at')}, attempts, consumer, "
                           f"{ms.format('delivered_at')}, ack_batch FROM dmq_delivery_log ORDER BY id")
    assert rows == [
        (first_fact, "billing", a[1], 1_699_999_999_000, None, 1_700_000_002_000, 3, "c1", 1_700_000_001_500, batch),
        (first_fact + 1, "audit", b[0], 1_699_999_998_000, 1_700_000_000_000, 1_700_000_001_000, 1, "c2", None, batch),
    ]


def test_a_batch_whose_acks_were_all_done_before_writes_no_row(pg_dsn, stored):
    ids, conn = stored
    (o1, a), _ = sorted(ids.items())
    first = [_ack("billing", o1, a[0])]
    progress = [CursorProgress("orders", "billing", o1, a[0], [])]
    run_steps(conn, ack_deliveries_steps(first, progress, ""))
    run_steps(conn, ack_deliveries_steps(first, progress, ""))
    run_steps(conn, ack_deliveries_steps([], progress, ""))
    assert db_rows(pg_dsn, "SELECT cardinality(message_ids) FROM dmq_delivery_batch") == [(1,)]


def test_the_trace_and_time_windows_reach_the_batches_through_their_brin_indexes(pg_dsn, stored):
    """Schema version 10: a message is found between a batch's lowest and highest id, a
    time window by a batch's newest ack, each through a BRIN index (an insert costs it
    almost nothing), filtered on the table under the view rather than after unnesting it."""
    from dmq_sql import queries

    ids, conn = stored
    (o1, a), _ = sorted(ids.items())
    run_steps(conn, ack_deliveries_steps([_ack("billing", o1, a[0])], [CursorProgress("orders", "billing", o1, a[0], [])], ""))
    conn.execute("SET enable_seqscan = off")
    trace = "\n".join(r[0] for r in conn.execute("EXPLAIN " + queries["trace_acks"], {"id": a[0]}))
    assert "dmq_delivery_batch_ids_brin" in trace
    window = "\n".join(r[0] for r in conn.execute(
        "EXPLAIN SELECT count(*) FROM dmq_delivery_log WHERE ack_batch_at >= now() - interval '1 hour'"))
    assert "dmq_delivery_batch_acked_brin" in window
    assert conn.execute(queries["trace_acks"], {"id": a[0]}).fetchall()[0][:2] == ("orders", "billing")


def test_packed_array_parameters_reach_postgresql_as_sent(pg_dsn):
    """The list types of dmq_server.db.arrays (the hot statements' parameters) are read by
    PostgreSQL as the values the server meant, NULLs and empty arrays included."""
    from dmq_server.db.arrays import BoolArray, ByteaArray, Int4Array, Int8Array, TextArray

    params = {"a": Int8Array([2**63 - 1, -1, 0]), "b": Int4Array([7, -(2**31)]), "c": BoolArray([True, False]),
              "d": TextArray(["zählung", None, ""]), "e": ByteaArray([b"\x00\xff", b""]), "f": Int8Array()}
    with connect(pg_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT %(a)b::bigint[], %(b)b::integer[], %(c)b::boolean[], %(d)b::text[], "
                           "%(e)b::bytea[], cardinality(%(f)b::bigint[])", params).fetchone()
    assert row == ([2**63 - 1, -1, 0], [7, -(2**31)], [True, False], ["zählung", None, ""], [b"\x00\xff", b""], 0)
