"""Migration 0011 on a database holding delivery batches: new batches are compressed with
lz4, the old ones keep pglz, and both read back through the ``dmq_delivery_log`` view as
they were written (real PostgreSQL, Debian's build, which has lz4).

The ack statement writes one batch row of arrays per statement; past PostgreSQL's TOAST
threshold (a batch of about a hundred acks) the row is compressed on the acknowledgement
path, and pglz cost more CPU there than lz4 does (bench/ack_cost.py)."""

from __future__ import annotations

import psycopg
import pytest

from dmq_server.db.schema import migrate
from dmq_sql import migrations

from .support import db_rows
from .test_migrate_cursors import _migrate_to

pytestmark = pytest.mark.integration

ACKS = 300  # a batch well past the TOAST threshold (about 2 kB a row)
ARRAYS = ("topics", "channels", "message_ids", "published_ms", "first_ms", "acked_ms", "attempts",
          "consumers", "delivered_ms")
LOG = "SELECT id, message_id, topic, channel, acked_at, attempts, consumer FROM dmq_delivery_log ORDER BY id"


def _insert_batch(dsn: str, batch: int, first_id: int) -> None:
    """A batch of ACKS facts shaped as the ack statement writes one: parallel arrays."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO dmq_delivery_batch (id, first_fact, acked_at, low_id, high_id, topics, channels, "
            "message_ids, published_ms, first_ms, acked_ms, attempts, consumers, delivered_ms) "
            "SELECT %(batch)s, %(batch)s::bigint << 20, to_timestamp(1700000000), %(first)s, %(first)s + %(n)s - 1, "
            "array_agg('orders'::text), array_agg('billing'::text), array_agg(%(first)s + i), "
            "array_agg(1700000000000 + i), array_agg(1700000000500 + i), array_agg(1700000001000 + i), "
            "array_agg(1 + i %% 3), array_agg('dmq 127.0.0.1:' || (40000 + i %% 7)), array_agg(1700000000700 + i) "
            "FROM generate_series(0, %(n)s - 1) AS i",
            {"batch": batch, "first": first_id, "n": ACKS},
        )


def _methods(dsn: str, batch: int) -> set[str | None]:
    columns = ", ".join(f"pg_column_compression({name})" for name in ARRAYS)
    (row,) = db_rows(dsn, f"SELECT {columns} FROM dmq_delivery_batch WHERE id = %s", batch)
    return set(row)


def test_new_batches_are_lz4_and_old_ones_read_back_unchanged(pg_empty_dsn):
    _migrate_to(pg_empty_dsn, 10)
    with psycopg.connect(pg_empty_dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO dmq_topic (name) VALUES ('orders')")
        conn.execute("INSERT INTO dmq_channel (topic, name) VALUES ('orders', 'billing')")
    _insert_batch(pg_empty_dsn, 1, 1000)
    assert "pglz" in _methods(pg_empty_dsn, 1)  # version 10: the default method
    before = db_rows(pg_empty_dsn, LOG)
    assert len(before) == ACKS

    assert migrate(pg_empty_dsn) == [v for v, _, _ in migrations() if v > 10]

    assert db_rows(pg_empty_dsn, LOG) == before  # the old batch reads as it did
    assert "pglz" in _methods(pg_empty_dsn, 1)  # and was not rewritten
    _insert_batch(pg_empty_dsn, 2, 1000 + ACKS)
    methods = _methods(pg_empty_dsn, 2)
    assert "lz4" in methods and "pglz" not in methods
    after = db_rows(pg_empty_dsn, LOG)
    assert after[:ACKS] == before
    assert [r[1] for r in after[ACKS:]] == list(range(1000 + ACKS, 1000 + 2 * ACKS))
    assert {r[6] for r in after[ACKS:]} == {f"dmq 127.0.0.1:{40000 + i}" for i in range(7)}
