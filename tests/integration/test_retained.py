"""Retained messages and bytes per topic on PostgreSQL (``db.retained``, schema 22): the
sweep's pass counts each topic up to a settled id, in batches, from the topic's own index
range; the sweep's delete takes off exactly the rows it removes that were counted."""

from __future__ import annotations

import pytest

from dmq_server.db.messages import NewMessage, create_owner_steps, insert_messages_steps, sweep_all_steps
from dmq_server.db.retained import (
    Retained,
    count_plan_steps,
    count_topic_steps,
    retained_figures_steps,
)
from dmq_server.db.steps import Statement, run_steps
from dmq_server.db.worker import connect
from registry import pg as registry

pytestmark = pytest.mark.integration

SKEW_MS = 30_000


def _store(conn, topic: str, owner: int, bodies: list[bytes], age: str | None = None) -> list[int]:
    """Store ``bodies`` on ``topic``, published ``age`` ago (an interval) if given."""
    start = conn.execute("SELECT count(*) FROM dmq_message").fetchone()[0]
    batch = [NewMessage(topic, f"p-{topic}", start + n, 0, body) for n, body in enumerate(bodies)]
    ids = sorted(s.message_id for s in run_steps(conn, insert_messages_steps(batch, "node-1", owner)))
    if age is not None:
        conn.execute("UPDATE dmq_message SET published_at = now() - %s::interval WHERE id = ANY(%s)", (age, ids))
    return ids


def _count_pass(conn, limit: int = 50_000) -> list[tuple[str, int]]:
    """A pass's count as ReliableStore.sweep runs it: the plan, then each topic's batches
    until one is not full; the batches' sizes."""
    point, topics = run_steps(conn, count_plan_steps(SKEW_MS))
    batches = []
    for topic in topics:
        while True:
            counted = run_steps(conn, count_topic_steps(topic, point, limit))
            batches.append((topic, counted))
            if counted is None or counted < limit:
                break
    return batches


def _figures(conn) -> dict[str, tuple[int, int]]:
    return {t: (r.messages, r.bytes) for t, r in run_steps(conn, retained_figures_steps()).items()}


def test_each_topic_s_messages_and_bytes_are_counted_once_settled_and_a_sweep_takes_off_what_it_deleted(pg_dsn):
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "kept", retention_ms=7_200_000)
        registry.create_topic(conn, "brief", retention_ms=60_000)
        owner = run_steps(conn, create_owner_steps("node-1"))
        kept = _store(conn, "kept", owner, [b"k" * n for n in (1, 2, 3, 4)], "1 hour")
        brief = _store(conn, "brief", owner, [b"b" * 10] * 3, "1 hour")
        # published just now: not settled yet (their ids may still gain a committed row below)
        young = _store(conn, "kept", owner, [b"y" * 100] * 2)
        _count_pass(conn)
        assert _figures(conn) == {"kept": (4, 10), "brief": (3, 30)}
        as_of = run_steps(conn, retained_figures_steps())["kept"].as_of_ms
        now_ms = conn.execute("SELECT (extract(epoch FROM now()) * 1000)::bigint").fetchone()[0]
        assert as_of is not None and as_of <= now_ms - 3600_000 - SKEW_MS + 5000  # brief's last, an hour ago, less S
        assert _count_pass(conn) and _figures(conn)["kept"] == (4, 10)  # a pass again adds nothing
        # the young ones settle (as if a minute passed): the next pass adds them, and only them
        conn.execute("UPDATE dmq_message SET published_at = now() - interval '50 minutes' WHERE id = ANY(%s)",
                     (young,))
        _count_pass(conn)
        assert _figures(conn) == {"kept": (6, 210), "brief": (3, 30)}

        # brief's rows go past its minute; two more of brief, stored after the count, go in
        # the same sweep: they were never counted, so nothing of them is taken off
        late = _store(conn, "brief", owner, [b"L" * 1000] * 2, "1 hour")
        assert run_steps(conn, sweep_all_steps(600, 100)) == len(brief) + len(late)
        assert _figures(conn) == {"kept": (6, 210), "brief": (0, 0)}
        _count_pass(conn)
        assert _figures(conn) == {"kept": (6, 210), "brief": (0, 0)}
        assert [r[0] for r in conn.execute("SELECT id FROM dmq_message ORDER BY id")] == sorted(kept + young)


def test_a_sweep_between_counts_takes_off_exactly_the_counted_rows_it_deletes(pg_dsn):
    """Half of a topic's old rows counted, then all swept: the figures end at zero, not
    below (the other half was never added)."""
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "brief", retention_ms=60_000)
        registry.create_topic(conn, "other", retention_ms=7_200_000)
        owner = run_steps(conn, create_owner_steps("node-1"))
        _store(conn, "brief", owner, [b"a" * 7] * 4, "1 hour")
        _store(conn, "other", owner, [b"o" * 5] * 2, "1 hour")
        _count_pass(conn)
        assert _figures(conn) == {"brief": (4, 28), "other": (2, 10)}
        _store(conn, "brief", owner, [b"c" * 9] * 3, "1 hour")  # above counted_to
        assert run_steps(conn, sweep_all_steps(600, 100)) == 7
        assert _figures(conn) == {"brief": (0, 0), "other": (2, 10)}


def test_the_first_pass_over_more_rows_than_a_batch_counts_them_all_in_bounded_statements(pg_dsn):
    """120 settled rows of one topic (two incarnations) and 30 of another, in batches of 50:
    full batches, then the rest; every row counted once."""
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "big")
        registry.create_topic(conn, "small")
        first = run_steps(conn, create_owner_steps("node-1"))
        second = run_steps(conn, create_owner_steps("node-2"))
        _store(conn, "big", first, [b"1234"] * 70, "1 hour")
        _store(conn, "small", first, [b"s"] * 30, "1 hour")
        _store(conn, "big", second, [b"123456"] * 50, "1 hour")
        assert _count_pass(conn, limit=50) == [("big", 50), ("big", 50), ("big", 20), ("small", 30)]
        assert _figures(conn) == {"big": (120, 70 * 4 + 50 * 6), "small": (30, 30)}
        counted_to = conn.execute("SELECT counted_to FROM dmq_retained WHERE topic = 'big'").fetchone()[0]
        assert counted_to == conn.execute("SELECT max(id) FROM dmq_message").fetchone()[0]


def test_the_settle_time_is_held_back_by_an_open_writing_transaction(pg_dsn):
    """count_settle_time names the start of a transaction that wrote and is still open (a
    row it inserted could still commit below the count's point); none once it ends."""
    with connect(pg_dsn, autocommit=True) as conn, connect(pg_dsn) as writer:
        registry.create_topic(conn, "orders")
        owner = run_steps(conn, create_owner_steps("node-1"))
        started_ms = writer.execute("SELECT (extract(epoch FROM now()) * 1000)::bigint").fetchone()[0]
        assert run_steps(conn, _settle_time())[1] is None  # it has not written yet
        writer.execute("UPDATE dmq_owner SET node_id = node_id WHERE id = %s", (owner,))
        assert run_steps(conn, _settle_time())[1] == started_ms
        writer.rollback()
        assert run_steps(conn, _settle_time())[1] is None


def _settle_time():
    ((now_ms, oldest_writer_ms),) = yield Statement("count_settle_time", {})
    return now_ms, oldest_writer_ms


def test_a_deleted_topic_s_figures_go_once_its_rows_are_swept(pg_dsn):
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "gone")
        owner = run_steps(conn, create_owner_steps("node-1"))
        _store(conn, "gone", owner, [b"g"] * 3, "1 hour")
        _count_pass(conn)
        assert _figures(conn) == {"gone": (3, 3)}
        registry.delete_topic(conn, "gone")
        _count_pass(conn)
        assert _figures(conn) == {"gone": (3, 3)}  # its rows are still stored
        run_steps(conn, sweep_all_steps(600, 100))
        _count_pass(conn)
        assert run_steps(conn, retained_figures_steps()) == {}
        assert Retained  # the figures' type is what retained_figures_steps answers
