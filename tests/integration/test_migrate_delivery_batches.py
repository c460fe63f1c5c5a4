"""Migration 0010 on a database whose delivery log holds rows: a row per ack becomes a batch.

A database at schema version 9 is filled the way the old server and the archive left it:
log rows with and without a consumer and delivery times (rows from before version 6 have
neither), the first rows already archived and trimmed, and one id the old log gave out to a
transaction that never committed. After ``migrate()`` the ``dmq_delivery_log`` view must
read back exactly the old rows, ids included; a new acknowledgement through a real server
must get a batch id above every id the old log gave out and every archived range (or the
archive would take it for a straggler, or skip it), and a fact id above every old one; and
the archive's next range must hold exactly the rows it had not archived, old and new.
"""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import psycopg
import pytest

from dmq_client.wire import Command
from dmq_pipeline.database import queries as PIPELINE
from dmq_server.db.schema import migrate
from dmq_sql import migrations

from .support import db_rows, wait_for
from .test_migrate_cursors import _migrate_to

pytestmark = pytest.mark.integration

COLUMNS = ("id, message_id, topic, channel, published_at, first_delivered_at, acked_at, attempts, "
           "consumer, delivered_at")
BASE_MS = 1_700_000_000_000


def _fill_version_9(dsn: str) -> None:
    """Eight log rows of which the archive trimmed the first three, and id 9 given out
    and never committed."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO dmq_topic (name) VALUES ('orders')")
        conn.execute("INSERT INTO dmq_channel (topic, name) VALUES ('orders', 'billing')")
        for i in range(8):
            old = i < 2  # logged before version 6: no consumer, no delivery time
            conn.execute(
                "INSERT INTO dmq_delivery_log (message_id, topic, channel, published_at, first_delivered_at, "
                "acked_at, attempts, consumer, delivered_at) VALUES (%s, 'orders', 'billing', "
                "to_timestamp(%s / 1000.0), CASE WHEN %s THEN to_timestamp(%s / 1000.0) END, "
                "to_timestamp(%s / 1000.0), %s, %s, CASE WHEN %s THEN to_timestamp(%s / 1000.0) END)",
                (100 + i, BASE_MS + i, i % 2 == 0, BASE_MS + 500 + i, BASE_MS + 2_000 + i, 1 + i % 3,
                 None if old else f"consumer-{i}", not old, BASE_MS + 1_000 + i),
            )
        conn.execute("SELECT nextval(pg_get_serial_sequence('dmq_delivery_log', 'id'))")  # id 9, never committed
        conn.execute("DELETE FROM dmq_delivery_log WHERE id <= 3")
        conn.execute("INSERT INTO dmq_archive_batch (low_id, high_id, state, planned_rows, rows) "
                     "VALUES (0, 3, 'trimmed', 3, 3)")


def test_log_rows_read_back_unchanged_and_new_acks_follow_them(pg_empty_dsn, make_server):
    _migrate_to(pg_empty_dsn, 9)
    _fill_version_9(pg_empty_dsn)
    before = db_rows(pg_empty_dsn, f"SELECT {COLUMNS} FROM dmq_delivery_log ORDER BY id")
    assert [r[0] for r in before] == [4, 5, 6, 7, 8]

    assert migrate(pg_empty_dsn) == [v for v, _, _ in migrations() if v > 9]

    assert db_rows(pg_empty_dsn, f"SELECT {COLUMNS} FROM dmq_delivery_log ORDER BY id") == before
    assert db_rows(pg_empty_dsn, "SELECT id, first_fact, cardinality(message_ids) FROM dmq_delivery_batch "
                                 "ORDER BY id") == [(i, i, 1) for i in (4, 5, 6, 7, 8)]

    server = make_server(dsn=pg_empty_dsn)
    with server.client() as producer, server.client() as consumer:
        assert consumer.subscribe("orders", "billing").command == Command.SUBSCRIBE_ACK
        reply = producer.send("orders", b"after the migration")
        assert reply.command == Command.SEND_SUCCESS_ACK
        push = consumer.receive(timeout=10)
        assert push is not None and push.message_id == reply.message_id
        consumer.ack(push)
        wait_for(lambda: db_rows(pg_empty_dsn, "SELECT count(*) FROM dmq_delivery_log") == [(6,)])

    (fact_id, message_id, batch), = db_rows(
        pg_empty_dsn, "SELECT id, message_id, ack_batch FROM dmq_delivery_log WHERE id > 8")
    assert message_id == reply.message_id
    assert batch == 10 and fact_id == 10 << 20  # above id 9, which the old log gave out

    with psycopg.connect(pg_empty_dsn, autocommit=True) as conn:
        cutoff = datetime.now(timezone.utc) + timedelta(minutes=1)
        planned = conn.execute(PIPELINE["next_archive_range"], {"low": 3, "cutoff": cutoff, "max_rows": 100}).fetchone()
        assert planned == (6, 10)  # the five old rows not archived yet and the new one
        assert conn.execute(PIPELINE["archive_stragglers"], {"watermark": 3}).fetchone() == (0,)
