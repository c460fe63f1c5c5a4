"""The chaos suite's checker counts what it claims to: lost, duplicated (delivered again
after the ack was durable), redelivered (before), unexpected; per channel."""

from __future__ import annotations

from tests.chaos.checker import History, check, throughput


def _counts(history: History) -> dict[str, dict]:
    return {c.channel: c.__dict__ for c in check(history)}


def test_an_acknowledged_send_missing_from_one_channel_is_lost_there_only():
    h = History(["a", "b"])
    for key, mid in ((b"p/1", 1), (b"p/2", 2)):
        h.attempt(key)
        h.ack(key, mid, now=1.0)
        h.deliver("a", key, mid, now=2.0)
    h.deliver("b", b"p/1", 1, now=2.0)
    counts = _counts(h)
    assert counts["a"]["lost"] == 0 and counts["b"]["lost"] == 1
    assert counts["b"]["lost_examples"] == ["p/2"]
    assert h.missing() == {"a": 0, "b": 1}


def test_a_redelivery_before_the_ack_is_durable_is_allowed_after_it_is_a_duplicate():
    h = History(["a"])
    for key, mid in ((b"p/1", 1), (b"p/2", 2)):
        h.attempt(key)
        h.ack(key, mid, now=1.0)
        h.deliver("a", key, mid, now=2.0)
        h.consumer_ack("a", mid, now=2.1)
    h.confirm([("a", 1), ("a", 2)], now=3.0)
    h.deliver("a", b"p/1", 1, now=2.5)  # redelivered while the ack was not yet durable
    h.deliver("a", b"p/2", 2, now=3.5)  # redelivered after: a broken promise
    (count,) = check(h)
    assert (count.redelivered, count.duplicated) == (1, 1)
    assert count.duplicated_examples == ["p/2"]
    assert not count.ok()


def test_a_seeks_replay_is_asked_for_until_its_own_ack_is_durable_then_a_push_is_a_duplicate():
    h = History(["a"])
    for key, mid in ((b"p/1", 1), (b"p/2", 2), (b"p/3", 3)):
        h.attempt(key)
        h.ack(key, mid, now=1.0)
        h.deliver("a", key, mid, now=2.0)
        h.consumer_ack("a", mid, now=2.1)
    h.confirm([("a", 1), ("a", 2), ("a", 3)], now=3.0, asked=2.9)
    assert h.unconfirmed() == []
    # a seek began at 4.0 (ids 1 and 2 replayed) and had committed by 4.5
    h.replay_acks_from(4.5)
    h.consumer_ack("a", 1, now=4.2)  # a late ack of the copy pushed before: not the replay's
    assert h.unconfirmed() == []
    for key, mid in ((b"p/1", 1), (b"p/2", 2)):
        h.deliver("a", key, mid, now=5.0)
        h.consumer_ack("a", mid, now=5.1)
    assert sorted(h.unconfirmed()) == [("a", 1), ("a", 2)]
    h.confirm([("a", 1)], now=5.3, asked=5.0)  # looked before id 1's replay ack was sent
    h.confirm([("a", 1), ("a", 2)], now=6.0, asked=5.9)
    assert h.unconfirmed() == []
    h.deliver("a", b"p/1", 1, now=5.5)  # again while the replay's ack was not yet durable
    h.deliver("a", b"p/2", 2, now=6.5)  # again after it: a broken promise
    h.deliver("a", b"p/3", 3, now=5.0)  # not replayed, pushed after its durable ack
    (count,) = check(h, replayed={"a": (4.0, {1, 2})})
    assert (count.replayed, count.redelivered, count.duplicated) == (3, 0, 2)
    assert sorted(count.duplicated_examples) == ["p/2", "p/3"]
    assert "ack of id 2's replay seen durable" in "\n".join(h.timeline("a", b"p/2"))


def test_a_delivery_nobody_sent_is_unexpected_and_an_unacknowledged_one_is_counted_apart():
    h = History(["a"])
    h.attempt(b"p/1")  # answered SEND_SERVER_ERROR, stored all the same
    h.deliver("a", b"p/1", 7, now=1.0)
    h.deliver("a", b"ghost/1", 8, now=1.0)
    (count,) = check(h)
    assert (count.unexpected, count.unacknowledged_delivered, count.lost) == (1, 1, 0)


def test_unconfirmed_lists_the_acks_not_yet_seen_durable():
    h = History(["a"])
    h.consumer_ack("a", 1, now=1.0)
    h.consumer_ack("a", 2, now=1.0)
    h.confirm([("a", 1)], now=2.0)
    assert h.unconfirmed() == [("a", 2)]


def test_throughput_counts_events_in_a_window():
    assert throughput([0.5, 1.0, 1.5, 2.5], 1.0, 2.0) == 2.0
    assert throughput([], 1.0, 1.0) == 0.0


def test_a_timeline_orders_the_pushes_and_acks_of_one_send_with_their_nodes():
    h = History(["a"])
    h.attempt(b"p/1")
    h.ack(b"p/1", 7, now=10.0)
    h.deliver("a", b"p/1", 7, now=10.5, node=1)
    h.consumer_ack("a", 7, now=11.0, node=1)
    h.deliver("a", b"p/1", 7, now=12.0, node=2)  # taken over: pushed again by another node
    h.consumer_ack("a", 7, now=12.5, node=2)
    h.confirm([("a", 7)], now=13.0)
    assert h.timeline("a", b"p/1", origin=10.0) == [
        "   +0.000 s  send acknowledged to its producer as id 7",
        "   +0.500 s  pushed id 7 by node 2",
        "   +1.000 s  ack of id 7 sent to node 2",
        "   +2.000 s  pushed id 7 by node 3",
        "   +2.500 s  ack of id 7 sent to node 3",
        "   +3.000 s  ack of id 7 seen durable",
    ]


def test_a_push_whose_priority_is_not_its_sends_is_counted_and_pushes_are_counted_per_priority():
    h = History(["a"])
    h.attempt(b"p/1", priority=7)
    h.attempt(b"p/2")
    h.ack(b"p/1", 1, now=1.0)
    h.ack(b"p/2", 2, now=1.0)
    h.deliver("a", b"p/1", 1, now=1.25, priority=7)
    h.deliver("a", b"p/2", 2, now=3.0, priority=0)
    h.deliver("a", b"p/1", 1, now=4.0, priority=0)  # redelivered without its priority
    for key, mid, wait in ((b"p/3", 3, 0.5), (b"p/4", 4, 5.0)):
        h.attempt(key)
        h.ack(key, mid, now=1.0)
        h.deliver("a", key, mid, now=1.0 + wait)
    (count,) = check(h)
    assert count.wrong_priority == 1 and count.wrong_priority_examples == ["p/1 7 pushed as [0]"]
    assert not count.ok()
    assert count.by_priority == {0: 4, 7: 1}
    assert count.wait_by_priority == {0: 2.0, 7: 0.25}  # the median from the ack to the first push
    assert h.timeline("a", b"p/1")[0] == "   +1.000 s  send acknowledged to its producer as id 1 (priority 7)"
    assert h.delivered_ids("a") == {1, 2, 3, 4}
