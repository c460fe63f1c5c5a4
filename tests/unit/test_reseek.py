"""A node learning of a seek (issue 46): the broker with its real writers and acker on the
in-memory database and a ``task.Clock``.

A seek rewrites a channel's cursors in PostgreSQL with a new epoch (``dmq channel seek``,
made here by writing the double's cursors as the seek statement does). The node must
deliver again every copy the seek made the channel's, once each, whatever it was doing
when it learned: copies in flight, acks queued for the acker, acks being made durable.
Counted: the ids pushed after the seek are exactly the copies the seek made pending, and
after acknowledging them nothing is pending; no ack of a copy pushed before the seek
moves a cursor written by it.
"""

from __future__ import annotations

from collections import Counter

from tests.unit.test_broker import Consumer, Harness


def _seek_to_start(h: Harness, channel: str) -> None:
    """What ``seek_channel`` leaves in the database for a seek of ``channel`` to its first
    message: each cursor at the channel's start, nothing done above it, a new epoch."""
    start = h.db.start_ids[("orders", channel)]
    for (topic, name, _), cursor in h.db.cursors.items():
        if (topic, name) == ("orders", channel):
            cursor.floor, cursor.done = start, []
    key = ("orders", channel)
    h.db.channel_epochs[key] = h.db.channel_epochs.get(key, 0) + 1


def _pending(h: Harness, channel: str) -> set[int]:
    return {mid for (_, name, mid) in h.db.deliveries if name == channel}


def _pushed(h: Harness, count: int) -> tuple[Consumer, list[int]]:
    """``count`` messages sent to orders and pushed to a consumer of billing: it, and the ids."""
    consumer = Consumer()
    h.subscribe("orders", "billing", consumer)
    for i in range(count):
        h.send("orders", "p", i)
    h.settle()
    ids = sorted(h.acknowledged.values())
    assert sorted(mid for _, mid in consumer.pushed) == ids
    return consumer, ids


def _store_and_ack(h: Harness, count: int) -> tuple[Consumer, list[int]]:
    consumer, ids = _pushed(h, count)
    h.ack_all("orders", consumer)
    h.settle()
    assert not _pending(h, "billing")
    return consumer, ids


def test_a_seek_learned_at_the_channel_state_read_delivers_every_sought_copy_again_once():
    h = Harness()
    billing, ids = _store_and_ack(h, 10)
    _seek_to_start(h, "billing")
    assert _pending(h, "billing") == set(ids)
    billing.pushed.clear()
    h.broker.reliable.read_channel_state()
    h.settle()
    channel = h.broker.reliable.channels[("orders", "billing")]
    assert channel.epoch == 1 and channel.seek_count == 1
    assert Counter(mid for _, mid in billing.pushed) == Counter(ids)  # each once
    h.ack_all("orders", billing)
    h.settle()
    assert not _pending(h, "billing")
    # the second acks are logged: the copies were done, the seek made them pending again
    assert Counter(row["message_id"] for row in h.db.delivery_log) == Counter({mid: 2 for mid in ids})


def test_acks_of_copies_pushed_before_a_seek_are_refused_and_the_copies_pushed_again():
    """The seek commits while the consumer holds its copies; its acks, made durable after,
    propose the old epoch: refused, not logged; the node reads the channels' state at once,
    learns of the seek and pushes every copy again."""
    h = Harness()
    billing, ids = _pushed(h, 5)
    _seek_to_start(h, "billing")  # this node does not know yet
    before = [mid for _, mid in billing.pushed]
    h.ack_all("orders", billing)
    h.settle(0.2)  # the acker's flush and its answer; then the state read
    store = h.broker.reliable
    assert store.acks_fenced == 5
    assert not h.db.delivery_log  # refused: not logged
    assert _pending(h, "billing") == set(ids)
    pushed_again = [mid for _, mid in billing.pushed[len(before):]]
    assert sorted(pushed_again) == ids
    billing.pushed[:] = [("billing", mid) for mid in pushed_again]
    h.ack_all("orders", billing)
    h.settle()
    assert not _pending(h, "billing")
    assert sorted(row["message_id"] for row in h.db.delivery_log) == ids


def test_acks_still_queued_when_the_node_learns_of_a_seek_are_dropped():
    """Acks queued for the acker (not flushed yet) when the channel-state read brings the
    seek: they go, never applied over the seek's cursors, and the copies come again."""
    h = Harness(ack_flush_interval=5.0)
    billing, ids = _pushed(h, 5)
    h.ack_all("orders", billing)  # queued: the acker flushes in 5 s
    store = h.broker.reliable
    assert store.acker.pending == 5
    _seek_to_start(h, "billing")
    billing.pushed.clear()
    store.read_channel_state()
    h.settle(0.1)
    assert store.acker.pending == 0
    h.settle(6)
    assert _pending(h, "billing") == set(ids) and store.acks_fenced == 0
    assert sorted(mid for _, mid in billing.pushed) == ids


def test_a_channel_opened_after_a_seek_starts_in_its_epoch():
    """The channel-state read gives the epochs of every sought channel: a channel this
    node opens later proposes that epoch, and its acks apply (no later read teaches it)."""
    h = Harness(channel_state_interval=3600.0)
    store = h.broker.reliable
    h.db.create_topic("later", ["c"])
    h.db.channel_epochs[("later", "c")] = 3
    store.read_channel_state()
    h.settle()
    assert ("later", "c") not in store.channels
    h.settle(3)  # the registry refresh finds the topic
    consumer = Consumer()
    h.subscribe("later", "c", consumer)
    for i in range(4):
        h.send("later", "p", i)
    h.settle()
    assert store.channels[("later", "c")].epoch == 3 and store.channels[("later", "c")].seek_count == 0
    for _, mid in consumer.pushed:
        assert h.broker.ack("later", "c", mid, consumer) is None
    h.settle()
    assert sorted(row["message_id"] for row in h.db.delivery_log) == sorted(h.acknowledged.values())
    assert store.acks_fenced == 0


def test_a_seek_learned_while_acks_are_being_made_durable_delivers_their_copies_again():
    """The ack batch is applied (before the seek commits) but its answer comes after the
    node learned of the seek: the copies are the seek's to deliver again. The node forgot
    even what was finishing when it learned, so the load after it pushes them, and the
    late answer (an older epoch) changes nothing."""
    h = Harness(db_delay=0.05)
    billing, ids = _pushed(h, 5)
    store = h.broker.reliable
    channel = store.channels[("orders", "billing")]
    h.ack_all("orders", billing)
    while not h.db.delivery_log:  # the batch is applied; its answer is 50 ms away
        h.clock.advance(0.001)
    assert set(channel.finishing) == set(ids)
    _seek_to_start(h, "billing")
    billing.pushed.clear()
    store.reseek(channel, 1)  # what the channel-state read does with the epoch it reads
    h.settle()
    assert sorted(mid for _, mid in billing.pushed) == ids
    assert _pending(h, "billing") == set(ids)


def test_a_channel_first_loaded_after_a_seek_it_has_not_heard_of_takes_its_epoch():
    """Another node stored the messages and the channel was sought since this node's
    last channel-state read; the channel's first load here reads the sought cursors and
    their epoch: it takes the epoch as its own, so its consumer gets each copy once and
    its acks apply (no refusal, no second reading)."""
    from dmq_server.db.messages import NewMessage, create_owner_steps, insert_messages_steps

    h = Harness(channel_state_interval=3600.0)
    store = h.broker.reliable
    h.db.create_topic("later", ["c"])
    h.settle(3)  # the registry refresh finds the topic
    other: list[int] = []
    h.db.run_steps(create_owner_steps, "node-2").addCallback(other.append)
    stored: list[int] = []
    h.db.run_steps(insert_messages_steps, [NewMessage("later", "q", n, 0, b"x") for n in range(4)], "node-2",
                   other[0]).addCallback(lambda rows: stored.extend(s.message_id for s in rows))
    h.settle()
    h.db.channel_epochs[("later", "c")] = 2  # sought: every copy stays pending
    consumer = Consumer()
    h.subscribe("later", "c", consumer)
    h.settle()
    channel = store.channels[("later", "c")]
    assert channel.epoch == 2 and channel.seek_count == 0
    assert sorted(mid for _, mid in consumer.pushed) == sorted(stored)
    for _, mid in consumer.pushed:
        assert h.broker.ack("later", "c", mid, consumer) is None
    h.settle()
    assert store.acks_fenced == 0 and not {mid for (t, _, mid) in h.db.deliveries if t == "later"}
    assert sorted(mid for _, mid in consumer.pushed) == sorted(stored)  # each once
