"""The retention sweep on PostgreSQL (``sweep_messages``): it removes exactly the messages
past the retention window that every channel is done with, walking only the ids below the
first message still inside the window."""

from __future__ import annotations

import pytest

from dmq_server.db.messages import CursorProgress, ack_deliveries_steps, sweep_batch_steps, sweep_messages_steps
from dmq_server.db.steps import STATEMENTS, run_steps
from dmq_server.db.worker import connect

from .test_delivery_log import _ack
from .test_depth_count import store_billing

pytestmark = pytest.mark.integration


def test_old_messages_every_channel_is_done_with_go_and_nothing_else(pg_dsn):
    with connect(pg_dsn, autocommit=True) as conn:
        owner, ids = store_billing(conn, 10)
        # the first six were published an hour ago; billing is done with all but the third
        conn.execute("UPDATE dmq_message SET published_at = now() - interval '1 hour' WHERE id <= %s", (ids[5],))
        done = [m for m in ids if m != ids[2]]
        run_steps(conn, ack_deliveries_steps([_ack("billing", owner, m) for m in done],
                                             [CursorProgress("orders", "billing", owner, ids[1], [(ids[3], ids[9])])], ""))
        assert run_steps(conn, sweep_messages_steps(600, 100)) == 5  # ids 0, 1, 3, 4, 5
        left = [r[0] for r in conn.execute("SELECT id FROM dmq_message ORDER BY id").fetchall()]
        assert left == [ids[2], *ids[6:]]  # the unacknowledged old one, and the recent ones
        assert run_steps(conn, sweep_messages_steps(600, 100)) == 0
        # a bounded batch: the lowest first
        conn.execute("UPDATE dmq_message SET published_at = now() - interval '1 hour'")
        assert run_steps(conn, sweep_messages_steps(600, 2)) == 2
        left = [r[0] for r in conn.execute("SELECT id FROM dmq_message ORDER BY id").fetchall()]
        assert left == [ids[2], ids[8], ids[9]]


def test_with_nothing_old_stored_a_sweep_reads_a_few_index_entries_and_no_table(pg_dsn):
    """The sweep runs every --sweep-interval whatever is stored: with only recent messages it
    finds the lowest id inside the window and stops, without a scan of the table (the
    earlier `id IN (subquery)` form read every stored message) and without JIT (a server
    connection has it off: it compiled for 0.3-0.45 s a statement of a millisecond)."""
    with connect(pg_dsn, autocommit=True) as conn:
        assert conn.execute("SHOW jit").fetchone()[0] == "off"
        owner, ids = store_billing(conn, 3000)
        conn.execute("ANALYZE dmq_message")

        def reads() -> tuple[int, int]:
            conn.execute("SELECT pg_stat_force_next_flush()")
            seq, idx = conn.execute(
                "SELECT seq_scan, coalesce(idx_tup_fetch, 0) FROM pg_stat_user_tables WHERE relname = 'dmq_message'"
            ).fetchone()
            return seq, idx

        before = reads()
        assert run_steps(conn, sweep_messages_steps(600, 10000)) == 0
        after = reads()
        assert after[0] == before[0]  # no sequential scan of dmq_message
        assert after[1] - before[1] <= 5  # the lowest id and the first inside the window, not 3,000
        # two thirds old, none acknowledged: the sweep walks the old ids by the primary key
        conn.execute("UPDATE dmq_message SET published_at = now() - interval '1 hour' WHERE id < %s", (ids[2000],))
        conn.execute("ANALYZE dmq_message")
        plan = "\n".join(r[0] for r in conn.execute(
            "EXPLAIN " + _sweep_sql(), {"retention_s": 600, "below": ids[2000], "limit": 10000}).fetchall())
        assert "Seq Scan on dmq_message" not in plan, plan
        before = reads()
        assert run_steps(conn, sweep_messages_steps(600, 10000)) == 0  # billing still needs them
        assert reads()[0] == before[0]
        # the next batch looks for the window's start from the last one: it passes none of
        # the 2,000 old messages billing holds (the candidates' walk still reads them)
        assert run_steps(conn, sweep_batch_steps(600, 10000)) == (0, ids[2000])
        before = reads()
        bounds = conn.execute(STATEMENTS["sweep_bounds"], {"retention_s": 600, "start": ids[2000]}).fetchone()
        assert bounds == (ids[0], ids[2000])
        assert reads()[1] - before[1] <= 5  # not the 2,000


def _sweep_sql() -> str:
    return STATEMENTS["sweep_messages"]
