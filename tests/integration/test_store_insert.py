"""insert_messages against real PostgreSQL: the first try without ON CONFLICT, and
the fallback when a batch holds a resend, in autocommit (the writers) and inside a
caller's transaction."""

from __future__ import annotations

import pytest

from dmq_server.db.messages import NewMessage, insert_messages
from dmq_server.db.worker import connect


def _msg(producer: str, session_id: int, body: bytes = b"x") -> NewMessage:
    return NewMessage("orders", producer, session_id, 0, body)


def _counts(dsn: str) -> tuple[int, int]:
    with connect(dsn, autocommit=True) as conn:
        messages = conn.execute("SELECT count(*) FROM dmq_message").fetchone()[0]
        deliveries = conn.execute("SELECT count(*) FROM dmq_pending").fetchone()[0]
    return messages, deliveries


@pytest.mark.parametrize("autocommit", [True, False], ids=["autocommit", "transaction"])
def test_a_batch_with_resends_stores_each_pair_once(pg_dsn, topic, autocommit, owner):
    with connect(pg_dsn, autocommit=autocommit) as conn:
        first = insert_messages(conn, [_msg("p", 1), _msg("p", 2)], "node-1", owner)
        assert [s.duplicate for s in first] == [False, False]
        assert all(s.channels == ("billing",) for s in first)

        # a stored pair, a new one, and the new one again in the same batch
        mixed = insert_messages(conn, [_msg("p", 2), _msg("p", 3), _msg("p", 3)], "node-1", owner)
        if not autocommit:
            conn.commit()
    assert mixed[0].duplicate and mixed[0].message_id == first[1].message_id
    assert not mixed[1].duplicate and mixed[1].channels == ("billing",)
    assert mixed[2].duplicate and mixed[2].message_id == mixed[1].message_id
    assert _counts(pg_dsn) == (3, 3)  # one row and one delivery per pair


def test_the_callers_transaction_survives_the_fallback(pg_dsn, topic, owner):
    """The failed first try is rolled back to its savepoint, not the whole transaction."""
    with connect(pg_dsn) as conn:
        with conn.transaction():
            conn.execute("INSERT INTO dmq_topic (name) VALUES ('audit')")
            insert_messages(conn, [_msg("q", 7)], "node-1", owner)
            again = insert_messages(conn, [_msg("q", 7), _msg("q", 8)], "node-1", owner)
            assert [s.duplicate for s in again] == [True, False]
    with connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM dmq_topic WHERE name = 'audit'").fetchone()[0] == 1
    assert _counts(pg_dsn) == (2, 2)


@pytest.mark.parametrize("statement", ["first try", "as written"])
def test_the_producers_clock_and_the_commit_time_are_stored_to_the_millisecond(pg_dsn, topic, owner, statement):
    """produced_ms becomes produced_at by interval arithmetic, every allowed value read
    back as the same milliseconds (the far end of year 9999 included; 0 is none); each
    answer's published_ms is its row's published_at, the same for the whole batch. The
    statement as written (after a resend) stores them alike."""
    produced = [1, 999, 1_700_000_000_123, 4_102_444_800_001, 123_456_789_012_345, 253_402_300_799_999, 0]
    batch = [NewMessage("orders", "clock", n, ms, b"x") for n, ms in enumerate(produced, 1)]
    with connect(pg_dsn, autocommit=True) as conn:
        if statement == "as written":
            insert_messages(conn, [_msg("clock", 100)], "node-1", owner)
            batch.append(_msg("clock", 100))  # a resend: the fallback statement stores the batch
        stored = insert_messages(conn, batch, "node-1", owner)
        rows = conn.execute(
            "SELECT id, (extract(epoch FROM produced_at) * 1000)::bigint, "
            "(extract(epoch FROM published_at) * 1000)::bigint FROM dmq_message "
            "WHERE producer = 'clock' AND session_id < 100 ORDER BY session_id").fetchall()
    assert [r[1] for r in rows] == [ms or None for ms in produced]
    assert [s.message_id for s in stored[:len(produced)]] == [r[0] for r in rows]
    assert {s.published_ms for s in stored[:len(produced)]} == {r[2] for r in rows} and len({r[2] for r in rows}) == 1


def test_a_batch_is_stored_in_the_statements_lock_order_and_answered_in_its_own(pg_dsn, topic, owner):
    """The rows go in sorted by (producer, session id), whatever order the sends came in
    (one lock order for concurrent writers, and the server sends them presorted so that
    PostgreSQL's sort has nothing to do); each send is answered with its own row."""
    batch = [_msg(f"p{i % 3}", 10 - i // 3) for i in range(9)]  # producers interleaved, ids falling
    with connect(pg_dsn, autocommit=True) as conn:
        stored = insert_messages(conn, batch, "node-1", owner)
        rows = conn.execute("SELECT id, producer, session_id FROM dmq_message ORDER BY id").fetchall()
    assert [(r[1], r[2]) for r in rows] == sorted((m.producer, m.session_id) for m in batch)
    by_pair = {(r[1], r[2]): r[0] for r in rows}
    assert [s.message_id for s in stored] == [by_pair[(m.producer, m.session_id)] for m in batch]


def test_inside_a_callers_transaction_the_first_try_is_the_callers_to_roll_back(pg_dsn, topic, owner):
    """The first try runs in a savepoint of the caller's transaction, even as the
    transaction's first statement: the caller's rollback takes it back, with or without
    the fallback (``conn.transaction()`` there was a transaction of its own, committed)."""
    with connect(pg_dsn) as conn:
        insert_messages(conn, [_msg("p", 1)], "node-1", owner)  # the first try stores it
        conn.rollback()
        assert _counts(pg_dsn) == (0, 0)
        insert_messages(conn, [_msg("p", 2)], "node-1", owner)
        conn.commit()
        insert_messages(conn, [_msg("p", 2), _msg("p", 3)], "node-1", owner)  # a resend: the fallback
        conn.rollback()
    assert _counts(pg_dsn) == (1, 1)
