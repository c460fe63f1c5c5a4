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
