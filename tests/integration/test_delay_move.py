"""move_due against real PostgreSQL: the messages it returns are the rows it stored.

The statement draws message ids before inserting and finds the stored rows again
by id; these tests pin that the returned ids, times and channels are the stored
ones, that a row whose pair is already a message is taken but not stored twice,
and that it holds when many rows fell due after the last ANALYZE (the case the
id-based lookup exists for)."""

from __future__ import annotations

import time

from dmq_server.db.delays import move_due
from dmq_server.db.worker import connect


def _queue(conn, rows: list[tuple[str, int]], due_ms: int, channel: str | None = None) -> None:
    conn.execute(
        "INSERT INTO dmq_delay (fragment, due_ms, topic, channel, producer, session_id, body) "
        "SELECT 1, %s, 'orders', %s, u.producer, u.session_id, convert_to(u.producer || u.session_id, 'UTF8') "
        "FROM unnest(%s::text[], %s::bigint[]) AS u(producer, session_id)",
        (due_ms, channel, [p for p, _ in rows], [s for _, s in rows]),
    )


def _move(dsn: str, owner: int, limit: int = 1000):
    with connect(dsn) as conn:
        with conn.transaction():
            return move_due(conn, (1,), 1, int(time.time() * 1000), limit, "node-1", owner)


def test_moved_messages_are_the_stored_rows(pg_dsn, topic, owner):
    now = int(time.time() * 1000)
    with connect(pg_dsn, autocommit=True) as conn:
        (old,) = conn.execute(
            "INSERT INTO dmq_message (topic, producer, session_id, owner, body) VALUES ('orders', 'p', 2, %s, 'old') "
            "RETURNING id",
            (owner,),
        ).fetchone()
        _queue(conn, [("p", 1), ("p", 2), ("p", 3)], now - 10)
        _queue(conn, [("p", 9)], now + 3_600_000)  # not due
    taken, moved = _move(pg_dsn, owner)
    assert taken == 3  # the stored pair is taken off the delay table too
    assert sorted((m.producer, m.session_id) for m in moved) == [("p", 1), ("p", 3)]
    with connect(pg_dsn, autocommit=True) as conn:
        stored = {
            r[0]: r[1:]
            for r in conn.execute(
                "SELECT id, producer, session_id, (extract(epoch FROM published_at) * 1000)::bigint, body "
                "FROM dmq_message"
            )
        }
        deliveries = conn.execute("SELECT message_id, channel FROM dmq_pending ORDER BY message_id").fetchall()
        left = conn.execute("SELECT producer, session_id FROM dmq_delay").fetchall()
    for m in moved:
        assert stored[m.message_id] == (m.producer, m.session_id, m.published_ms, m.body)
        assert m.channels == ("billing",)
        assert m.channel is None  # a delayed send: for every channel (the names are all of them)
    assert all(m.owner == owner for m in moved)
    # the moved messages wait on the channel, as the one stored before does
    assert deliveries == sorted([(m.message_id, "billing") for m in moved] + [(old, "billing")])
    assert len(stored) == 3  # the old row and the two new ones
    assert left == [("p", 9)]


def test_many_rows_due_after_the_last_analyze_all_move_once(pg_dsn, topic, owner):
    now = int(time.time() * 1000)
    with connect(pg_dsn, autocommit=True) as conn:
        _queue(conn, [("future", i) for i in range(5000)], now + 3_600_000)
        conn.execute("ANALYZE dmq_delay")  # the statistics know of no due row
        _queue(conn, [("due", i) for i in range(3000)], now - 10, channel="billing")
    moved = []
    for _ in range(3):
        taken, batch = _move(pg_dsn, owner, limit=1000)
        assert taken == 1000
        moved += batch
    assert _move(pg_dsn, owner)[0] == 0
    assert len({m.message_id for m in moved}) == 3000
    assert {m.channel for m in moved} == {"billing"}  # rows for one channel say which
    with connect(pg_dsn, autocommit=True) as conn:
        pairs = conn.execute(
            "SELECT m.producer, m.session_id FROM dmq_message m JOIN dmq_pending d ON d.message_id = m.id "
            "WHERE m.id = ANY(%s)",
            ([m.message_id for m in moved],),
        ).fetchall()
    assert sorted(pairs) == sorted((m.producer, m.session_id) for m in moved)
    assert {p for p, _ in pairs} == {"due"}
