"""The retention sweep on PostgreSQL (``sweep_plan_steps``, ``sweep_topic``): it removes
exactly the messages past their topic's retention that every channel is done with, and
reads of each topic only its own index range, below the first message still inside that
topic's window."""

from __future__ import annotations

import psycopg
import pytest

from dmq_server.db.messages import (
    MAX_ID,
    CursorProgress,
    NewMessage,
    SweepTarget,
    ack_deliveries_steps,
    create_owner_steps,
    insert_messages_steps,
    sweep_all_steps,
    sweep_plan_steps,
    sweep_topic_steps,
)
from dmq_server.db.steps import run_steps
from dmq_server.db.worker import connect
from registry import pg as registry

from .test_delivery_log import _ack
from .test_depth_count import store_billing

pytestmark = pytest.mark.integration


def _left(conn) -> list[int]:
    return [r[0] for r in conn.execute("SELECT id FROM dmq_message ORDER BY id").fetchall()]


def _reads(conn) -> tuple[int, int]:
    """dmq_message's sequential scans and rows fetched by index so far."""
    conn.execute("SELECT pg_stat_force_next_flush()")
    return conn.execute(
        "SELECT seq_scan, coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables WHERE relname = 'dmq_message'"
    ).fetchone()


def _store(conn, topic: str, owner: int, count: int, age: str | None = None) -> list[int]:
    """``count`` new messages of ``topic``, published ``age`` ago (an interval) if given."""
    batch = [NewMessage(topic, f"p-{topic}-{age}", n, 0, b"x") for n in range(count)]
    ids = sorted(s.message_id for s in run_steps(conn, insert_messages_steps(batch, "node-1", owner)))
    if age is not None:
        conn.execute("UPDATE dmq_message SET published_at = now() - %s::interval WHERE id = ANY(%s)", (age, ids))
    return ids


def test_old_messages_every_channel_is_done_with_go_and_nothing_else(pg_dsn):
    with connect(pg_dsn, autocommit=True) as conn:
        owner, ids = store_billing(conn, 10)
        # the first six were published an hour ago; billing is done with all but the third
        conn.execute("UPDATE dmq_message SET published_at = now() - interval '1 hour' WHERE id <= %s", (ids[5],))
        done = [m for m in ids if m != ids[2]]
        run_steps(conn, ack_deliveries_steps([_ack("billing", owner, m) for m in done],
                                             [CursorProgress("orders", "billing", owner, ids[1], [(ids[3], ids[9])])], ""))
        assert run_steps(conn, sweep_all_steps(600, 100)) == 5  # ids 0, 1, 3, 4, 5
        assert _left(conn) == [ids[2], *ids[6:]]  # the unacknowledged old one, and the recent ones
        assert run_steps(conn, sweep_all_steps(600, 100)) == 0
        # what went is noted: the highest id, and the newest publish time (an hour ago)
        swept_id, swept_ms, age_s = conn.execute(
            "SELECT swept_id, swept_ms, extract(epoch FROM now()) - swept_ms / 1000.0 FROM dmq_retention "
            "WHERE topic = 'orders'").fetchone()
        assert swept_id == ids[5] and 3590 < age_s < 3610
        # a bounded batch: the lowest first, and where the next one starts
        conn.execute("UPDATE dmq_message SET published_at = now() - interval '1 hour'")
        target = SweepTarget("orders", 600, MAX_ID)
        assert run_steps(conn, sweep_topic_steps(target, 2)) == (2, ids[7])
        assert _left(conn) == [ids[2], ids[8], ids[9]]
        assert run_steps(conn, sweep_topic_steps(target, 2, ids[7])) == (2, ids[9])
        assert run_steps(conn, sweep_topic_steps(target, 2, ids[9])) == (0, ids[9])
        assert _left(conn) == [ids[2]]


def test_each_topic_keeps_its_own_retention_and_a_deleted_topics_rows_go_at_the_default(pg_dsn):
    """kept (retention 2 h) and brief (1 min) and plain (the default, 10 min) each have
    messages from 5 minutes and 1 hour ago, all acknowledged; gone was deleted with its
    messages stored. The sweep's plan names every stored topic with its retention; kept's
    messages all stay, brief's both ages go, plain's hour-old ones go, and gone's hour-old."""
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "kept", retention_ms=7_200_000)
        registry.create_topic(conn, "brief", retention_ms=60_000)
        registry.create_topic(conn, "plain")
        registry.create_topic(conn, "gone")
        registry.create_topic(conn, "unused", retention_ms=1000)  # registered, nothing stored
        owner = run_steps(conn, create_owner_steps("node-1"))
        topics = ("kept", "brief", "plain", "gone")
        stored = {topic: _store(conn, topic, owner, 4, "1 hour") for topic in topics}  # ids follow time
        for topic in topics:
            stored[topic] += _store(conn, topic, owner, 3, "5 minutes")
        registry.delete_topic(conn, "gone")
        targets, starts = run_steps(conn, sweep_plan_steps(600, {}))
        assert sorted((t.topic, t.retention_s) for t in targets) == [
            ("brief", 60), ("gone", 600), ("plain", 600)]  # kept: nothing 2 h old
        assert sorted(starts) == [60, 600, 7200]
        assert run_steps(conn, sweep_all_steps(600, 100)) == 4 + 3 + 4 + 4
        assert _left(conn) == sorted(stored["kept"] + stored["plain"][4:] + stored["gone"][4:])
        swept = dict(conn.execute("SELECT topic, swept_id FROM dmq_retention").fetchall())
        assert swept == {"brief": stored["brief"][-1], "plain": stored["plain"][3], "gone": stored["gone"][3]}


def test_a_topic_swept_reads_none_of_another_topics_retained_messages(pg_dsn):
    """The cost the per-topic sweep exists for: kept holds 3,000 acknowledged messages of
    an hour ago (retention 1 day), stored before brief's 20 old ones. Sweeping reads
    brief's rows and a few index entries, none of kept's; with nothing old at all it reads
    a few index entries and no table (and without JIT: a server connection has it off; it
    compiled for 0.3-0.45 s a statement of a millisecond)."""
    with connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SHOW jit").fetchone()[0] == "off"
        registry.create_topic(conn, "kept", retention_ms=86_400_000)
        registry.create_topic(conn, "brief")
        owner = run_steps(conn, create_owner_steps("node-1"))
        kept = _store(conn, "kept", owner, 3000)
        brief = _store(conn, "brief", owner, 20)
        conn.execute("ANALYZE dmq_message")

        before = _reads(conn)
        assert run_steps(conn, sweep_all_steps(600, 10000)) == 0
        after = _reads(conn)
        assert after[0] == before[0]  # no sequential scan of dmq_message
        # a row per topic and one more (the loose scan), three per retention (the bounds) and,
        # on a first pass, four more (the ends of the search for its start; 18 in all here):
        # not 3,000
        assert after[1] - before[1] <= 20, after

        conn.execute("UPDATE dmq_message SET published_at = now() - interval '1 hour'")
        conn.execute("ANALYZE dmq_message")
        targets, starts = run_steps(conn, sweep_plan_steps(600, {}))
        assert [(t.topic, t.below) for t in targets] == [("brief", MAX_ID)]
        before = _reads(conn)
        assert run_steps(conn, sweep_topic_steps(targets[0], 10000)) == (20, brief[-1])
        after = _reads(conn)
        assert after[0] == before[0]
        # brief's rows, twice each (the candidates' scan, the delete by id), and the loose scan
        # of its incarnations: not kept's 3,000
        assert after[1] - before[1] <= 2 * 20 + 6, after
        assert _left(conn) == kept
        # the next pass's walks start past what this one passed: none of kept's rows is
        # walked again for the default retention (nothing stored is inside that window)
        assert starts == {600: brief[-1] + 1, 86400: kept[0]}


def test_a_first_pass_finds_its_window_by_a_search_not_a_walk_of_another_topics_rows(pg_dsn):
    """A server's first pass has no start for a retention (``sweep_start_steps``): kept's
    3,000 messages of two hours ago (retention 1 day) lie below brief's, all older than
    brief's 10-minute window. The walk to that window starts from a binary search's row,
    so it fetches a few dozen rows (log2 of the ids' span, a probe each), not kept's 3,000;
    and what it answers is what the walk from id 0 answered."""
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "kept", retention_ms=86_400_000)
        registry.create_topic(conn, "brief")
        owner = run_steps(conn, create_owner_steps("node-1"))
        kept = _store(conn, "kept", owner, 3000, "2 hours")
        old = _store(conn, "brief", owner, 5, "1 hour")
        brief = _store(conn, "brief", owner, 20)
        conn.execute("ANALYZE dmq_message")

        before = _reads(conn)
        targets, starts = run_steps(conn, sweep_plan_steps(600, {}))
        after = _reads(conn)
        assert after[0] == before[0]  # no sequential scan of dmq_message
        assert after[1] - before[1] <= 60, after
        assert [(t.topic, t.below) for t in targets] == [("brief", brief[0])]
        assert starts == {600: brief[0], 86400: kept[0]}
        # from id 0, as before: the same answer, after reading every row of kept
        before = _reads(conn)
        assert run_steps(conn, sweep_plan_steps(600, {600: 0, 86400: 0})) == (targets, starts)
        assert _reads(conn)[1] - before[1] >= 3000
        assert run_steps(conn, sweep_all_steps(600, 10000)) == len(old)
        assert _left(conn) == kept + brief


def test_a_topic_another_node_is_sweeping_is_skipped(pg_dsn):
    with connect(pg_dsn, autocommit=True) as conn, psycopg.connect(pg_dsn) as other:
        owner, ids = store_billing(conn, 3)
        registry.delete_topic(conn, "orders")  # nothing waits for its rows any more
        conn.execute("UPDATE dmq_message SET published_at = now() - interval '1 hour'")
        other.execute("SELECT pg_advisory_xact_lock(7361006, hashtext('orders'))")  # held until it ends
        target = SweepTarget("orders", 600, MAX_ID)
        assert run_steps(conn, sweep_topic_steps(target, 100)) is None
        other.rollback()
        assert run_steps(conn, sweep_topic_steps(target, 100)) == (3, ids[-1])


def test_a_sweep_waits_for_a_seek_of_the_topic_under_way(pg_dsn):
    """A seek holds the topic's seek lock (7361005) until it commits: the sweep of the
    topic waits for it, then sees what it wrote."""
    with connect(pg_dsn, autocommit=True) as conn, psycopg.connect(pg_dsn) as seeking:
        owner, ids = store_billing(conn, 3)
        registry.delete_topic(conn, "orders")
        conn.execute("UPDATE dmq_message SET published_at = now() - interval '1 hour'")
        seeking.execute("SELECT pg_advisory_xact_lock(7361005, hashtext('orders'))")
        conn.execute("SET lock_timeout = '200ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            run_steps(conn, sweep_topic_steps(SweepTarget("orders", 600, MAX_ID), 100))
        seeking.rollback()
        assert run_steps(conn, sweep_topic_steps(SweepTarget("orders", 600, MAX_ID), 100)) == (3, ids[-1])
