"""Acks of copies pushed before a seek do not move the cursors the seek wrote (PostgreSQL).

A seek (``dmq channel seek``) writes a channel's cursors anew and raises the channel's
epoch (schema 21); every node proposes its acks with the epoch it pushed the copies in.
Applied over the seek, an ack of a copy pushed before it would merge its floor back over
the replay the seek asked for: the copies between would never be delivered again. So
``ack_deliveries`` and ``exhaust_deliveries`` move a cursor only with a proposal of its
epoch or a later one, tested on the row as locked (a seek and an ack are ordered either
way), and on the channel's epoch for a cursor with no row yet.

The seek here is what ``seek_channel`` writes: every cursor of the channel at its start,
nothing done above it, the new epoch. Counted: after each refused proposal every copy
the seek made pending is still pending, and none of the refused acks is logged.
"""

from __future__ import annotations

import threading

import psycopg
import pytest

import registry
from dmq_server.db.dead_letter_steps import CopyRef, exhaust_deliveries_steps
from dmq_server.db.messages import AckRow, CursorProgress, NewMessage, ack_deliveries_steps
from dmq_server.db.messages import create_owner_steps, insert_messages_steps
from dmq_server.db.steps import run_steps
from dmq_server.db.worker import connect

from .support import db_rows, wait_for
from .test_ack_fence import _logged, _pending

pytestmark = pytest.mark.integration

NODE = "node-1"


def _ack_in(conn: psycopg.Connection, owner: int, ids: list[int], epoch: int) -> list[tuple[str, str, int]]:
    """Acks of ``ids`` on billing, as a store proposes them for copies pushed in ``epoch``."""
    acks = [AckRow("orders", "billing", i, 1_700_000_000_000, 1_700_000_001_000, 1, consumer="c", owner=owner,
                   published_ms=1_699_999_999_000, epoch=epoch) for i in ids]
    progress = [CursorProgress("orders", "billing", owner, 0, [(i, i) for i in ids], epoch)]
    return run_steps(conn, ack_deliveries_steps(acks, progress, NODE))


def _seek_to_start(conn: psycopg.Connection) -> int:
    """billing's cursors at its start, nothing done, the next epoch (as seek_channel)."""
    (epoch,) = conn.execute("UPDATE dmq_channel SET epoch = epoch + 1 WHERE topic = 'orders' AND name = 'billing' "
                            "RETURNING epoch").fetchone()
    conn.execute("UPDATE dmq_cursor k SET floor = c.start_id, done = '{}', epoch = %s FROM dmq_channel c "
                 "WHERE k.topic = c.topic AND k.channel = c.name AND c.topic = 'orders' AND c.name = 'billing'",
                 (epoch,))
    return epoch


@pytest.fixture
def acked(pg_dsn: str):
    """Six messages on orders/billing, all acknowledged in epoch 0."""
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders")
        registry.add_channel(conn, "orders", "billing")
        owner = run_steps(conn, create_owner_steps(NODE))
        batch = [NewMessage("orders", "p", n, 0, b"x") for n in range(6)]
        ids = [s.message_id for s in run_steps(conn, insert_messages_steps(batch, NODE, owner))]
        assert _ack_in(conn, owner, ids, 0) == []
        assert _pending(pg_dsn) == []
        yield conn, owner, ids


def test_an_ack_of_the_epoch_before_a_seek_is_refused_and_one_of_its_epoch_applies(pg_dsn, acked):
    conn, owner, ids = acked
    epoch = _seek_to_start(conn)
    assert _pending(pg_dsn) == ids
    assert _ack_in(conn, owner, ids[:3], epoch - 1) == [("orders", "billing", owner)]
    assert _pending(pg_dsn) == ids  # the replay stands
    assert _logged(pg_dsn) == ids  # the refused acks are not logged (the first six are)
    assert _ack_in(conn, owner, ids[:3], epoch) == []
    assert _pending(pg_dsn) == ids[3:]
    assert _logged(pg_dsn) == sorted(ids + ids[:3])


def test_an_ack_waiting_for_the_seeks_lock_is_refused_once_the_seek_commits(pg_dsn, acked):
    """The ack statement starts while the seek's transaction holds the cursor row: it
    waits, and its test runs on the row the seek wrote (its snapshot still shows the old
    epoch on the channel)."""
    conn, owner, ids = acked
    more = [s.message_id for s in run_steps(conn, insert_messages_steps(
        [NewMessage("orders", "p", n, 0, b"x") for n in range(6, 8)], NODE, owner))]
    with connect(pg_dsn) as seeking, connect(pg_dsn, autocommit=True) as acking:
        epoch = _seek_to_start(seeking)  # uncommitted: holds billing's row and its cursor's
        pid = acking.info.backend_pid
        answer: list[object] = []
        # acks of copies pending in the statement's snapshot (all new: one statement)
        thread = threading.Thread(target=lambda: answer.append(_ack_in(acking, owner, more, epoch - 1)))
        thread.start()
        wait_for(lambda: db_rows(pg_dsn, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = %s",
                                 pid) == [("Lock",)])
        seeking.commit()
        thread.join(10)
    assert answer == [[("orders", "billing", owner)]]
    assert _pending(pg_dsn) == ids + more
    assert _logged(pg_dsn) == ids


def test_a_cursor_with_no_row_takes_no_ack_older_than_its_channel(pg_dsn, acked):
    """An incarnation with no cursor row yet (the seek wrote every row there was): the
    proposal is compared with the channel's epoch."""
    conn, _, _ = acked
    epoch = _seek_to_start(conn)
    other = run_steps(conn, create_owner_steps("node-2"))
    later = [s.message_id for s in run_steps(conn, insert_messages_steps(
        [NewMessage("orders", "q", n, 0, b"y") for n in range(2)], "node-2", other))]
    assert _ack_in(conn, other, later, epoch - 1) == [("orders", "billing", other)]
    assert set(later) <= set(_pending(pg_dsn))
    assert _ack_in(conn, other, later, epoch) == []
    assert not set(later) & set(_pending(pg_dsn))


def test_a_copy_pushed_before_a_seek_is_not_dead_lettered_after_it(pg_dsn, acked):
    conn, owner, ids = acked
    epoch = _seek_to_start(conn)
    assert run_steps(conn, exhaust_deliveries_steps([CopyRef("orders", "billing", ids[0], 5, owner, epoch - 1)],
                                                    NODE)) == []
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_dead_letter") == [(0,)]
    assert _pending(pg_dsn) == ids
    assert run_steps(conn, exhaust_deliveries_steps([CopyRef("orders", "billing", ids[0], 5, owner, epoch)],
                                                    NODE)) == [("orders", "billing", ids[0])]
    assert _pending(pg_dsn) == ids[1:]
