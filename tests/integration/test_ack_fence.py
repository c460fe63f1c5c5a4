"""Acks from a node whose cursors were taken over do not become durable (PostgreSQL).

A node frozen past its ZooKeeper session (SIGSTOP, a paused VM) wakes with acks queued
in its acker, or unread in its consumers' sockets, for copies another node has claimed
meanwhile. Its flush can run before ZooKeeper tells it the session is gone. Were those
acks applied, the claiming node, which loaded the copies when it claimed them and knows
nothing of the acks, would push them after their ack was durable: a duplicate (the chaos
suite's node-pause counted one). In a cluster the ack statement therefore moves only the
cursors the proposing node still holds, checked on the locked row, and names the others;
their acks are neither applied nor logged, and the claiming node delivers the copies.

Counted here over a real claim (``claim_owners``): every copy is acknowledged durably
exactly once, by the node holding its cursor, and none is lost.
"""

from __future__ import annotations

import psycopg
import pytest

import registry
from dmq_server.db.dead_letter_steps import CopyRef, exhaust_deliveries_steps, record_attempts_steps
from dmq_server.db.messages import AckRow, CursorProgress, NewMessage, ack_deliveries_steps
from dmq_server.db.messages import create_owner_steps, insert_messages_steps, load_backlog_steps
from dmq_server.db.steps import run_steps
from dmq_server.db.takeover_steps import claim_owners
from dmq_server.db.worker import connect

from .support import db_rows

FROZEN, TAKER = "node-2", "node-1"


def _ack(owner: int, message_id: int, attempts: int = 1) -> AckRow:
    return AckRow("orders", "billing", message_id, 1_700_000_000_000, 1_700_000_001_000, attempts,
                  consumer="c", owner=owner, published_ms=1_699_999_999_000, counted=attempts > 1)


def _ack_as(conn: psycopg.Connection, node: str, owner: int, ids: list[int], fenced: bool = True,
            attempts: int = 1) -> list[tuple[str, str, int]]:
    """``node`` acknowledges ``ids`` as its store does: one batch, with the progress it
    knows (the acked ids as spans above its floor)."""
    progress = [CursorProgress("orders", "billing", owner, 0, [(i, i) for i in ids])]
    return run_steps(conn, ack_deliveries_steps([_ack(owner, i, attempts) for i in ids], progress, node, fenced))


def _pending(dsn: str) -> list[int]:
    return [r[0] for r in db_rows(dsn, "SELECT message_id FROM dmq_pending WHERE channel = 'billing' ORDER BY 1")]


def _logged(dsn: str) -> list[int]:
    return [r[0] for r in db_rows(dsn, "SELECT message_id FROM dmq_delivery_log WHERE channel = 'billing' ORDER BY 1")]


@pytest.fixture
def frozen(pg_dsn: str):
    """Ten messages stored by the frozen node's incarnation; it acknowledged the first
    three before it froze."""
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders")
        registry.add_channel(conn, "orders", "billing")
        owner = run_steps(conn, create_owner_steps(FROZEN))
        batch = [NewMessage("orders", "p", n, 0, b"x") for n in range(1, 11)]
        ids = [s.message_id for s in run_steps(conn, insert_messages_steps(batch, FROZEN, owner))]
        assert _ack_as(conn, FROZEN, owner, ids[:3]) == []
        yield conn, owner, ids


def test_acks_flushed_after_a_takeover_are_not_applied_and_the_taker_delivers_them(pg_dsn, frozen):
    conn, owner, ids = frozen
    claimed = claim_owners(conn, FROZEN, [owner], TAKER, [TAKER])
    assert claimed == [("orders", "billing", 1)]
    # the taker loads what is left, as its rescan does
    loaded = run_steps(conn, load_backlog_steps("orders", "billing", 0, 100, TAKER, 99))
    assert [r.message_id for r in loaded] == ids[3:]

    # the frozen node wakes and flushes acks it held for three more copies
    assert _ack_as(conn, FROZEN, owner, ids[3:6]) == [("orders", "billing", owner)]
    assert _pending(pg_dsn) == ids[3:]  # not durable: nothing the taker pushes is a duplicate
    assert _logged(pg_dsn) == ids[:3]  # nor logged: the report counts only durable acks

    # the taker delivers every loaded copy and its consumers' acks are durable
    assert _ack_as(conn, TAKER, owner, ids[3:]) == []
    assert _pending(pg_dsn) == []
    logged = _logged(pg_dsn)
    assert logged == ids  # each copy acknowledged durably exactly once: none lost, none twice
    assert db_rows(pg_dsn, "SELECT holder FROM dmq_cursor") == [(TAKER,)]


def test_a_fenced_ack_keeps_the_attempts_the_taker_counts(pg_dsn, frozen):
    """The attempts kept for a copy delivered again stay until its holder's ack."""
    conn, owner, ids = frozen
    run_steps(conn, record_attempts_steps([CopyRef("orders", "billing", ids[5], 2, owner)]))
    claim_owners(conn, FROZEN, [owner], TAKER, [TAKER])
    assert _ack_as(conn, FROZEN, owner, [ids[5]], attempts=2) == [("orders", "billing", owner)]
    assert db_rows(pg_dsn, "SELECT message_id, attempts FROM dmq_attempts") == [(ids[5], 2)]
    assert _ack_as(conn, TAKER, owner, [ids[5]], attempts=3) == []
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_attempts") == [(0,)]


def test_an_ack_before_the_claim_is_durable_and_not_loaded_by_the_taker(pg_dsn, frozen):
    """The other order: the frozen node's flush commits first; the claim and the taker's
    load that follow see it, so the taker never delivers those copies."""
    conn, owner, ids = frozen
    assert _ack_as(conn, FROZEN, owner, ids[3:6]) == []
    claim_owners(conn, FROZEN, [owner], TAKER, [TAKER])
    loaded = run_steps(conn, load_backlog_steps("orders", "billing", 0, 100, TAKER, 99))
    assert [r.message_id for r in loaded] == ids[6:]


def test_a_claim_waits_for_an_ack_in_progress_and_the_ack_wins(pg_dsn, frozen):
    """An ack statement and a claim on the same cursor row are ordered by its lock: the
    claim, started while the ack's transaction is open, sees the ack once it commits."""
    conn, owner, ids = frozen
    with connect(pg_dsn) as acking, connect(pg_dsn, autocommit=True) as claiming:
        assert _ack_as(acking, FROZEN, owner, ids[3:6]) == []  # uncommitted: holds the row
        claiming.execute("SET lock_timeout = '200ms'")
        with pytest.raises(psycopg.errors.LockNotAvailable):
            claim_owners(claiming, FROZEN, [owner], TAKER, [TAKER])
        acking.commit()
        claim_owners(claiming, FROZEN, [owner], TAKER, [TAKER])
    loaded = run_steps(conn, load_backlog_steps("orders", "billing", 0, 100, TAKER, 99))
    assert [r.message_id for r in loaded] == ids[6:]


def test_on_one_node_an_ack_moves_a_cursor_named_for_another_node(pg_dsn, frozen):
    """Without ZooKeeper nothing takes cursors over, and a server started again under
    another name (a new host name) must still finish what the old name stored."""
    conn, owner, ids = frozen
    assert _ack_as(conn, "renamed", owner, ids[3:], fenced=False) == []
    assert _pending(pg_dsn) == []
    assert _logged(pg_dsn) == ids


def test_a_node_whose_cursor_was_claimed_dead_letters_nothing_of_it(pg_dsn, frozen):
    """Its scan on waking may find copies past max_attempts: in a cluster they are not
    made dead letters (the taker delivers them), on one node they are."""
    conn, owner, ids = frozen
    claim_owners(conn, FROZEN, [owner], TAKER, [TAKER])
    refs = [CopyRef("orders", "billing", ids[3], 5, owner)]
    assert run_steps(conn, exhaust_deliveries_steps(refs, FROZEN, True)) == []
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_dead_letter") == [(0,)]
    assert _pending(pg_dsn) == ids[3:]
    assert run_steps(conn, exhaust_deliveries_steps(refs, TAKER, True)) == [("orders", "billing", ids[3])]
    assert db_rows(pg_dsn, "SELECT message_id FROM dmq_dead_letter") == [(ids[3],)]
    assert _pending(pg_dsn) == ids[4:]
