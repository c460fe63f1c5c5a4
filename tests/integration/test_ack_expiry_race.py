"""An ack batch and an expiry pass on the same copy, interleaved by PostgreSQL's locks.

The expiry locks a channel's cursor rows (``FOR UPDATE SKIP LOCKED``), dead-letters the
copies past their time to live and marks them done; the ack statement merges its done
ranges into the same rows and logs each ack not done before. Here the ack statement starts
while an expiry transaction holds the cursor row, with the copy already dead-lettered and
marked done in it, and waits for the row; the expiry then commits. Each copy must end as
one thing: dead-lettered or acknowledged. (Read from the ack statement's snapshot, the
cursor did not show the expiry's mark, so the ack was logged as new too: found by
test_expiry_crash.py, two runs in ten.) A cursor row the ack statement's snapshot does not
hold cannot be locked by it: the sweep commits the rows it opens in a transaction of its
own, before it expires anything, and a statement that began before that commit meets the
row only in its upsert, which fails it, to be run again (the last test).
"""

from __future__ import annotations

import threading

import psycopg
import pytest

import registry
from dmq_server.db.dead_letter_steps import expire_deliveries_steps, open_ttl_cursors_steps
from dmq_server.db import messages as m
from dmq_server.db.schema import migrate
from dmq_server.db.steps import run_steps
from dmq_server.db.worker import connect

from .support import db_rows, wait_for

pytestmark = pytest.mark.integration

ACK_STATEMENT = "%Make a batch of acknowledgements durable%"  # ack_deliveries' first comment line


def _outcomes(dsn: str, message_id: int) -> tuple[int, int]:
    """(dead letters, delivery-log entries) of the copy on channel c."""
    letters = db_rows(dsn, "SELECT count(*) FROM dmq_dead_letter WHERE channel = 'c' AND message_id = %s", message_id)
    logged = db_rows(dsn, "SELECT count(*) FROM dmq_delivery_log WHERE channel = 'c' AND message_id = %s", message_id)
    return letters[0][0], logged[0][0]


@pytest.mark.parametrize("cursor", ["stored before", "opened by this sweep"])
def test_an_ack_waiting_on_an_expiry_is_not_logged_for_the_copy_it_expired(pg_dsn, cursor):
    """The cursor row stored by an earlier pass, or opened by this sweep's first
    transaction (committed before the expiry's, as reliable.dead_letters runs them)."""
    migrate(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "t", ttl_ms=1000)
        registry.add_channel(conn, "t", "c")
        owner = run_steps(conn, m.create_owner_steps("node-1"))
        (stored,) = run_steps(conn, m.insert_messages_steps([m.NewMessage("t", "p", 1, 0, b"x")], "node-1", owner))
        (now_ms,) = conn.execute("SELECT (extract(epoch FROM now()) * 1000)::bigint").fetchone()
        assert run_steps(conn, open_ttl_cursors_steps()) == 1
        if cursor == "stored before":  # a pass before the copy's time
            assert run_steps(conn, expire_deliveries_steps(now_ms, 10)) == []
    message_id = stored.message_id
    expiry = psycopg.connect(pg_dsn)
    try:
        rows = run_steps(expiry, expire_deliveries_steps(now_ms + 5_000, 10))  # its transaction left open
        assert rows == [("t", "c", message_id)]
        answer: list[object] = []

        def ack() -> None:
            with connect(pg_dsn, autocommit=True) as conn:
                answer.append(run_steps(conn, m.ack_deliveries_steps(
                    [m.AckRow("t", "c", message_id, now_ms, now_ms + 10, 1, "consumer", now_ms, owner, now_ms)],
                    [m.CursorProgress("t", "c", owner, 0, [(message_id, message_id)])], "node-1")))

        acker = threading.Thread(target=ack, daemon=True)
        acker.start()
        holder = expiry.info.backend_pid
        wait_for(lambda: db_rows(pg_dsn, "SELECT 1 FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid)) "
                                 "AND query LIKE %s", holder, ACK_STATEMENT), timeout=15)
        expiry.commit()
        acker.join(15)
        assert answer == [[]]  # the cursor moved (nothing refused)
    finally:
        expiry.close()
    assert _outcomes(pg_dsn, message_id) == (1, 0)
    (done,) = db_rows(pg_dsn, "SELECT done::text FROM dmq_cursor WHERE topic = 't' AND channel = 'c'")
    assert done == (f"{{[{message_id},{message_id + 1})}}",)


def test_an_ack_that_began_before_the_sweep_opened_its_cursor_is_not_logged_for_the_copy_expired(pg_dsn):
    """The cursor row of channel c does not exist when the ack statement takes its
    snapshot; the sweep opens it and expires the copy in it (both committed) while the
    statement waits on another cursor of its batch (c0's row, held here). The statement
    then meets c's row only in its upsert, which finds it there: it fails whole and runs
    again with a snapshot that holds the expiry's mark. Without that, it read c as never
    opened and logged the ack of a copy that is also a dead letter."""
    migrate(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "t", ttl_ms=1000)
        registry.add_channel(conn, "t", "c0")
        owner = run_steps(conn, m.create_owner_steps("node-1"))
        run_steps(conn, m.insert_messages_steps([m.NewMessage("t", "p", 1, 0, b"w")], "node-1", owner))
        assert run_steps(conn, open_ttl_cursors_steps()) == 1  # c0's row, before c exists
        registry.add_channel(conn, "t", "c")
        (stored,) = run_steps(conn, m.insert_messages_steps([m.NewMessage("t", "p", 2, 0, b"x")], "node-1", owner))
        (now_ms,) = conn.execute("SELECT (extract(epoch FROM now()) * 1000)::bigint").fetchone()
    message_id = stored.message_id
    held = psycopg.connect(pg_dsn)
    sweep = psycopg.connect(pg_dsn, autocommit=True)
    answer: list[object] = []
    try:
        held.execute("SELECT 1 FROM dmq_cursor WHERE topic = 't' AND channel = 'c0' FOR UPDATE")

        def ack() -> None:
            with connect(pg_dsn, autocommit=True) as conn:
                answer.append(run_steps(conn, m.ack_deliveries_steps(
                    [m.AckRow("t", "c", message_id, now_ms, now_ms + 10, 1, "consumer", now_ms, owner, now_ms)],
                    [m.CursorProgress("t", "c0", owner, 0, []),  # first: the statement waits on its row
                     m.CursorProgress("t", "c", owner, 0, [(message_id, message_id)])], "node-1")))

        acker = threading.Thread(target=ack, daemon=True)
        acker.start()
        wait_for(lambda: db_rows(pg_dsn, "SELECT 1 FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid)) "
                                 "AND query LIKE %s", held.info.backend_pid, ACK_STATEMENT), timeout=15)
        # the sweep's two transactions, as reliable.dead_letters runs them; had the waiting
        # statement written c's row already, opening it would wait on the statement: fail fast
        sweep.execute("SET lock_timeout = '5s'")
        assert run_steps(sweep, open_ttl_cursors_steps()) == 1  # c's row, after the ack's snapshot
        assert run_steps(sweep, expire_deliveries_steps(now_ms + 5_000, 10)) == [("t", "c", message_id)]
        held.commit()
        acker.join(15)
        assert answer == [[]]  # both cursors moved (nothing refused)
    finally:
        held.close()
        sweep.close()
    assert _outcomes(pg_dsn, message_id) == (1, 0)
    (done,) = db_rows(pg_dsn, "SELECT done::text FROM dmq_cursor WHERE topic = 't' AND channel = 'c'")
    assert done == (f"{{[{message_id},{message_id + 1})}}",)
