"""The depth count's slices on PostgreSQL (``depth_slice_steps``, reliable/depths.py):
a pass of small slices adds up to the one-statement count (``channel_depths``) whatever
the cursors hold (floors, done spans above them, two incarnations, an interleaved topic),
and a pass starts at the lowest cursor floor, not at the first message retention
keeps."""

from __future__ import annotations

import pytest

import registry
from dmq_server.db.messages import (
    CursorProgress,
    NewMessage,
    ack_deliveries_steps,
    create_owner_steps,
    depth_slice_steps,
    insert_messages_steps,
)
from dmq_server.db.steps import STATEMENTS, run_steps
from dmq_server.db.worker import connect

from .test_delivery_log import _ack

pytestmark = pytest.mark.integration


def _whole(conn) -> dict[tuple[str, str], int]:
    from dmq_sql import load_queries
    from pathlib import Path

    queries = load_queries((Path(__file__).resolve().parents[2] / "sql" / "queries.sql").read_text())
    return {(t, c): n for t, c, n in conn.execute(queries["channel_depths"]).fetchall()}


def store_billing(conn, count: int) -> tuple[int, list[int]]:
    """Topic orders with channel billing, ``count`` messages stored by one incarnation:
    (the incarnation, the ids in order)."""
    registry.create_topic(conn, "orders")
    registry.add_channel(conn, "orders", "billing")
    owner = run_steps(conn, create_owner_steps("node-1"))
    batch = [NewMessage("orders", "p", n, 0, b"x") for n in range(count)]
    return owner, sorted(s.message_id for s in run_steps(conn, insert_messages_steps(batch, "node-1", owner)))


def _pass(conn, rows: int) -> tuple[dict[tuple[str, str], int], list[tuple[int, int | None]]]:
    sums: dict[tuple[str, str], int] = {}
    slices: list[tuple[int, int | None]] = []
    low = None
    while True:
        low, high, counts, _ = run_steps(conn, depth_slice_steps(low, rows))
        slices.append((low, high))
        for key, n in counts.items():
            sums[key] = sums.get(key, 0) + n
        if high is None:
            return sums, slices
        low = high


def test_small_slices_add_up_to_the_whole_count(pg_dsn):
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders")
        registry.add_channel(conn, "orders", "billing")
        registry.add_channel(conn, "orders", "audit")
        registry.create_topic(conn, "clicks")
        registry.add_channel(conn, "clicks", "stats")
        ids: dict[int, list[int]] = {}
        for node in ("node-1", "node-2"):
            owner = run_steps(conn, create_owner_steps(node))
            for n in range(1, 16):  # orders and clicks interleaved in id order
                for topic in ("orders", "clicks"):
                    batch = [NewMessage(topic, f"{node}-{topic}", n, 0, b"x")]
                    stored = run_steps(conn, insert_messages_steps(batch, node, owner))
                    if topic == "orders":
                        ids.setdefault(owner, []).append(stored[0].message_id)
        (o1, a), (o2, b) = sorted(ids.items())
        # billing: o1's first five done (a floor), o1's 8th and 9th done above it (a span);
        # audit: o2's 3rd done out of order
        acks = [_ack("billing", o1, m) for m in a[:5] + a[7:9]] + [_ack("audit", o2, b[2])]
        progress = [CursorProgress("orders", "billing", o1, a[4], [(a[7], a[8])]),
                    CursorProgress("orders", "audit", o2, 0, [(b[2], b[2])])]
        assert run_steps(conn, ack_deliveries_steps(acks, progress, "")) == []
        whole = _whole(conn)
        assert whole == {("orders", "billing"): 30 - 7, ("orders", "audit"): 30 - 1, ("clicks", "stats"): 30}
        sums, slices = _pass(conn, rows=4)
        # 60 messages, 4 at a time; the 15th slice ends on the last message, an empty 16th ends the pass
        assert sums == whole and len(slices) == 16
        assert _pass(conn, rows=1000) == (whole, [(slices[0][0], None)])


def test_a_pass_starts_at_the_lowest_floor(pg_dsn):
    """Acknowledged messages that retention keeps (below every floor) are not walked."""
    with connect(pg_dsn, autocommit=True) as conn:
        owner, ids = store_billing(conn, 20)
        acks = [_ack("billing", owner, m) for m in ids[:15]]
        run_steps(conn, ack_deliveries_steps(acks, [CursorProgress("orders", "billing", owner, ids[14], [])], ""))
        low, high, counts, lowest = run_steps(conn, depth_slice_steps(None, 3))
        assert low == ids[14] and high == ids[17] and counts == {("orders", "billing"): 3}
        assert lowest == {("orders", "billing"): ids[15]}
        # nothing pending: a pass of one empty slice
        acks = [_ack("billing", owner, m) for m in ids[15:]]
        run_steps(conn, ack_deliveries_steps(acks, [CursorProgress("orders", "billing", owner, ids[19], [])], ""))
        low, high, counts, lowest = run_steps(conn, depth_slice_steps(None, 3))
        assert counts == {} and lowest == {}
        # later incarnations (each server start is one) have no cursor of billing: one with
        # no message of orders waits for nothing, and the pass still starts at the floor, not
        # at the channel's start below every retained message; one with messages from its
        # first one on
        run_steps(conn, create_owner_steps("node-2"))
        assert conn.execute(STATEMENTS["depth_scan_start"]).fetchone() == (ids[19],)
        third = run_steps(conn, create_owner_steps("node-3"))
        [stored] = run_steps(conn, insert_messages_steps([NewMessage("orders", "p3", 1, 0, b"x")], "node-3", third))
        assert conn.execute(STATEMENTS["depth_scan_start"]).fetchone() == (stored.message_id - 1,)
