"""An ordered topic's orderer claims its cursors; the previous holder's acks then move
nothing (issue 45 across nodes, PostgreSQL).

One node at a time delivers an ordered topic: the winner of its ZooKeeper lock claims
every cursor of the topic before its first load (``claim_ordered_cursors``). A node that
held some of them (the previous orderer, frozen or partitioned) may still flush acks;
fenced by the cursor's holder, they must leave the cursor as it was, so the copy stays
waiting for the new orderer. The contract cases (test_memory_db_contract.py) hold the
double to the same answers; this test reads the rows themselves.
"""

from __future__ import annotations

import psycopg

import registry
from dmq_server.db.messages import AckRow, CursorProgress, NewMessage, ack_deliveries_steps
from dmq_server.db.messages import create_owner_steps, insert_messages_steps
from dmq_server.db.orderer_steps import Claimed, claim_ordered_cursors, release_ordered_cursors
from dmq_server.db.steps import run_steps
from dmq_server.db.worker import connect

from .support import db_rows

OLD, NEW = "node-1", "node-2"


def _ack(conn: psycopg.Connection, node: str, owner: int, message_id: int) -> list[tuple[str, str, int]]:
    acks = [AckRow("ledger", "c", message_id, 1_700_000_000_000, 1_700_000_001_000, 1, owner=owner)]
    progress = [CursorProgress("ledger", "c", owner, message_id, [])]
    return run_steps(conn, ack_deliveries_steps(acks, progress, node, True))


def _cursors(dsn: str) -> list[tuple]:
    return db_rows(dsn, "SELECT owner, holder, floor, done::text FROM dmq_cursor WHERE topic = 'ledger' ORDER BY owner")


def test_after_a_claim_the_old_holders_acks_leave_the_cursor_as_it_was(pg_dsn):
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "ledger", ordered=True)
        registry.add_channel(conn, "ledger", "c")
        mine, theirs = run_steps(conn, create_owner_steps(OLD)), run_steps(conn, create_owner_steps(NEW))
        ids = [s.message_id for s in run_steps(conn, insert_messages_steps(
            [NewMessage("ledger", "p", n, 0, b"x") for n in range(1, 5)], OLD, mine))]
        assert _ack(conn, OLD, mine, ids[0]) == []  # the old orderer's own cursor, its floor at ids[0]
        before = _cursors(pg_dsn)
        assert [(owner, holder) for owner, holder, _, _ in before] == [(mine, OLD)]

        assert claim_ordered_cursors(conn, "ledger", NEW) == Claimed(1, frozenset({OLD}))  # taken from OLD
        claimed = _cursors(pg_dsn)
        assert [(owner, holder, floor) for owner, holder, floor, _ in claimed] == [(mine, NEW, before[0][2])]

        assert _ack(conn, OLD, mine, ids[1]) == [("ledger", "c", mine)]  # refused, named
        assert _cursors(pg_dsn) == claimed  # floor and done ranges as they were
        waiting = db_rows(pg_dsn, "SELECT message_id, holder FROM dmq_pending WHERE topic = 'ledger' ORDER BY 1")
        assert waiting == [(i, NEW) for i in ids[1:]]
        assert _ack(conn, NEW, mine, ids[1]) == []
        assert _cursors(pg_dsn)[0][2] == ids[1]

        # the topic is no longer ordered: the live incarnation's node delivers its copies again
        assert release_ordered_cursors(conn, "ledger", NEW) == 1
        assert [(owner, holder) for owner, holder, _, _ in _cursors(pg_dsn)] == [(mine, OLD)]
        assert _ack(conn, NEW, mine, ids[2]) == [("ledger", "c", mine)]
        assert theirs not in [owner for owner, _, _, _ in _cursors(pg_dsn)]  # nothing stored: no cursor opened
