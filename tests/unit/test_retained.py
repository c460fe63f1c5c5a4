"""The retained figures' pure parts (dmq_server/db/retained.py): how one topic's figures
on several clusters add up, and the count's steps against the in-memory double."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock

from dmq_server.db.memory import MemoryDb
from dmq_server.db.retained import Retained, SettlePoint, count_topic_steps, retained_stats, settle_time

pytestmark = pytest.mark.unit


def test_a_topic_on_two_clusters_adds_up_and_is_exact_from_the_earlier_as_of():
    """A moved topic: messages and bytes add up; the as-of time is the earlier cluster's
    (before it both counted everything)."""
    figures = retained_stats([Retained(10, 1000, 5_000), None, Retained(3, 30, 4_000)])
    assert figures == {"retained_messages": 13, "retained_bytes": 1030, "retained_as_of": 4_000}


def test_a_cluster_whose_first_count_is_under_way_leaves_the_as_of_unknown():
    assert retained_stats([Retained(10, 1000, 5_000), Retained(7, 70, None)])["retained_as_of"] is None
    assert retained_stats([]) == {"retained_messages": 0, "retained_bytes": 0, "retained_as_of": None}


def _result(d):
    out = []
    d.addBoth(out.append)
    return out[0]


def test_the_double_counts_in_batches_up_to_the_point_only():
    """count_topic_steps on MemoryDb: a full batch says so and the next one goes on from
    where it stopped; rows above the point wait for a later one."""
    db = MemoryDb(Clock())
    db.topics["orders"] = {"retention_ms": None, "ttl_ms": None}  # registered: its figures stay
    for n in range(5):
        db.messages[n + 1] = _message(n + 1, "orders", b"x" * (n + 1))
    assert _result(db.run_steps(count_topic_steps, "orders", SettlePoint(4, 900), 3)) == 3
    assert db.retained["orders"] == [3, 3, 6, None]  # a full batch: no as-of yet
    assert _result(db.run_steps(count_topic_steps, "orders", SettlePoint(4, 900), 3)) == 1
    assert db.retained["orders"] == [4, 4, 10, 900]  # message 5 is above the point


def _message(message_id: int, topic: str, body: bytes):
    from dmq_server.db.memory import _Message

    return _Message(message_id, topic, "p", message_id, 0, 0, "", body)


def test_the_settle_time_is_a_skew_before_now_or_the_oldest_writer_s_start_if_earlier():
    assert settle_time(100_000, None, 30_000) == 70_000
    assert settle_time(100_000, 90_000, 30_000) == 70_000  # a writer of 10 s: the skew decides
    assert settle_time(100_000, 20_000, 30_000) == 20_000  # a writer open 80 s holds it back


def test_a_node_s_sweep_pass_counts_and_its_channel_state_read_shows_the_figures_in_stats():
    """Through the broker on the double: three sends of 5, 6 and 7 bytes, settled (published
    an hour ago); a sweep pass counts them, the next channel-state read brings the figures,
    and /stats' topic shows them; a fourth send, too young, is not counted yet."""
    from tests.unit.test_broker import Harness

    h = Harness(message_retention=86400.0)
    for n, body in enumerate((b"a" * 5, b"b" * 6, b"c" * 7)):
        h.send("orders", "p", n, body)
    h.settle()
    for m in h.db.messages.values():
        m.published_ms -= 3_600_000
    h.send("orders", "p", 9, b"young")
    h.settle()
    store = h.broker.reliable
    store.sweep()
    h.settle()
    store.read_channel_state()
    h.settle()
    (orders,) = [t for t in h.broker.stats()["topics"] if t["topic_name"] == "orders"]
    assert (orders["retained_messages"], orders["retained_bytes"]) == (3, 18)
    assert orders["retained_as_of"] is not None and orders["retained_as_of"] < h.clock.seconds() * 1000 - 3_600_000
    assert h.broker.retained("orders") == {k: orders[k] for k in ("retained_messages", "retained_bytes", "retained_as_of")}
