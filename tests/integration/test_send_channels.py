"""Which channels a stored send is for, as the group commit answers it (``insert_messages``):
every channel of its topic that started below the message's id, in name order.

The statement builds a topic's list once per batch and hands it to every row newer than
all of the topic's channels; only a row older than some channel gets a list of its own.
These tests hold both branches to the rule.
"""

from __future__ import annotations

import registry
from dmq_server.db.messages import NewMessage, create_owner_steps, insert_messages_steps
from dmq_server.db.steps import run_steps
from dmq_server.db.worker import connect


def _send(conn, owner: int, *pairs: tuple[str, int]) -> list[tuple[str, tuple[str, ...]]]:
    batch = [NewMessage(topic, "p", n, 0, b"x") for topic, n in pairs]
    return [(m.topic, s.channels) for m, s in zip(batch, run_steps(conn, insert_messages_steps(batch, "node-1", owner)))]


def test_a_batch_over_topics_gets_each_topics_channels_in_name_order(pg_dsn):
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders")
        for channel in ("billing", "audit", "ship"):
            registry.add_channel(conn, "orders", channel)
        registry.create_topic(conn, "events")
        registry.add_channel(conn, "events", "log")
        registry.create_topic(conn, "quiet")
        owner = run_steps(conn, create_owner_steps("node-1"))
        got = _send(conn, owner, ("orders", 1), ("events", 2), ("quiet", 3), ("orders", 4))
    assert got == [("orders", ("audit", "billing", "ship")), ("events", ("log",)), ("quiet", ()),
                   ("orders", ("audit", "billing", "ship"))]


def test_a_channel_that_starts_above_a_row_is_not_among_its_channels(pg_dsn):
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "orders")
        registry.add_channel(conn, "orders", "billing")
        registry.add_channel(conn, "orders", "late")
        owner = run_steps(conn, create_owner_steps("node-1"))
        first = run_steps(conn, insert_messages_steps([NewMessage("orders", "p", 1, 0, b"x")], "node-1", owner))
        # 'late' starts after the second of the next two rows: only rows above it are its
        conn.execute("UPDATE dmq_channel SET start_id = %s WHERE name = 'late'", (first[0].message_id + 2,))
        got = _send(conn, owner, ("orders", 2), ("orders", 3), ("orders", 4))
    assert got == [("orders", ("billing",)), ("orders", ("billing",)), ("orders", ("billing", "late"))]
