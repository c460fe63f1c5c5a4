"""An ordered topic across a cluster's nodes, the delivery side (issue 45 §2, 45-nodes-design
§3 and §4b): one node, the topic's orderer, delivers its channels; every node stores.

On one channel (``ReliableChannel.delivered_by``, ``order_here``, ``poll``) and on two
``ReliableStore``s sharing the in-memory database as two cluster nodes (two fences, two
incarnations), with a ``task.Clock``. Counted: every copy either node stored is pushed by
the orderer, once, in id order; the other node keeps, loads and pushes nothing.
"""

from __future__ import annotations

import math

import pytest
from twisted.internet.task import Clock

from dmq_client.wire.properties import NO_PROPERTIES, Properties, encode_properties
from dmq_server.core.options import Options
from dmq_server.core.publish import new_send
from dmq_server.db.memory import MemoryDb
from dmq_server.db.messages import BacklogRow
from dmq_server.reliable.channel import NO_ORDERER, Delivery, ReliableChannel, ReliableMessage
from dmq_server.reliable.horizon import OwnWrites
from dmq_server.reliable.store import Fence, ReliableStore, StoreWiring
from registry.model import TopicSpec

OWN, OTHER = 7, 8


class Consumer:
    def __init__(self, credit: int = 100):
        self.credit = credit
        self.in_flight = 0
        self.pushed: list[int] = []

    def push_many(self, channel: ReliableChannel, deliveries: list[Delivery]) -> None:
        self.pushed += [d.message.message_id for d in deliveries]


def _message(mid: int, owner: int = OWN, key: str | None = None) -> ReliableMessage:
    return ReliableMessage(mid, "ledger", "p", mid, 0, b"x", owner, key=key)


def _row(mid: int, owner: int) -> BacklogRow:
    return BacklogRow(mid, "p", mid, 0, b"x", 0, owner, "", None, 0)


def _channel(orderer: str | None = None) -> tuple[ReliableChannel, list[tuple[int, int]], Consumer]:
    """An ordered topic's channel with a consumer: delivered here as on one node, or, in a
    cluster, ordered here (``orderer`` "here") or by another node; its loads recorded."""
    loads: list[tuple[int, int]] = []
    channel = ReliableChannel(
        "ledger", "c", clock=Clock(), msg_timeout=30.0, mem_queue_size=100,
        load=lambda ch, after, limit: loads.append((after, limit)), on_acks=lambda *a: None, ordered=True,
    )
    if orderer == "here":
        channel.order_here()
    elif orderer is not None:
        channel.order_elsewhere(orderer)
    consumer = Consumer()
    channel.subscribe(consumer)
    return channel, loads, consumer


# -- one channel ---------------------------------------------------------------------


def test_a_channel_another_node_delivers_keeps_loads_and_pushes_nothing():
    channel, loads, consumer = _channel()
    assert loads == [(0, 100)]
    channel.loaded([_row(3, OWN)], 100)  # delivering here: the copy goes out
    assert consumer.pushed == [3]
    channel.order_elsewhere("n2")
    assert channel.in_flight == {} and consumer.in_flight == 0  # dropped: the orderer delivers it
    assert channel.ack(3) is False  # a later ack is refused
    for mid in (10, 11):
        channel.add(_message(mid))
    channel.add_many([_message(12), _message(13, OTHER)])
    channel.subscribe(Consumer())
    channel.poll()
    channel.pump()
    assert loads == [(0, 100)] and consumer.pushed == [3]  # no load, no push
    assert not channel.ready and not channel.known and channel.cursor.position == 0
    assert channel.stats()["delivered_by"] == "n2"


def test_a_touch_is_refused_while_delivery_is_paused():
    """A node whose session is in doubt does not extend a copy's timeout: the next orderer
    pushes the key again once the timeout has passed (its handover wait)."""
    channel, loads, consumer = _channel("here")
    channel.loaded([_row(3, OWN)], 100)
    assert consumer.pushed == [3]
    assert channel.touch(3, consumer) is None
    channel.paused = True
    assert channel.touch(3, consumer) == "delivery paused (this node's cluster session is in doubt)"
    channel.paused = False
    assert channel.touch(3, consumer) is None


def test_the_orderer_reads_every_copy_from_the_first_id_in_id_order():
    channel, loads, consumer = _channel()
    channel.order_elsewhere(NO_ORDERER)
    channel.loaded([_row(5, OWN)], 100)  # the load out then is stale: dropped
    assert consumer.pushed == [] and loads == [(0, 100)]
    loads.clear()
    channel.order_here()
    assert loads == [(0, 100)]  # from the first id
    channel.loaded([_row(4, OTHER), _row(5, OWN), _row(6, OTHER)], 100)
    assert consumer.pushed == [4, 5, 6]
    assert channel.stats()["delivered_by"] is None
    channel.order_here()  # already: nothing read again
    assert loads == [(0, 100)]


def test_an_own_arrival_above_another_nodes_unread_copy_is_read_with_it():
    """Another node committed 5 (visible, not handed here), then this node committed 6.
    Kept as on one node, 6 would move the position past 5, and no load would read 5 (lost);
    the orderer leaves 6 to a load, which reads both in id order."""
    channel, loads, consumer = _channel("here")
    channel.loaded([], 100)  # nothing stored yet: the position stays at 0, no backlog
    loads.clear()
    channel.add(_message(6))
    assert consumer.pushed == [] and loads == [(0, 100)]
    channel.loaded([_row(5, OTHER), _row(6, OWN)], 100)
    assert consumer.pushed == [5, 6]


def test_an_own_arrival_the_orderer_read_already_is_not_pushed_again():
    """The commit's answer comes after its copy was loaded, acknowledged and made durable
    (45-design "Still open" 3): at or below the position, a load read it already."""
    channel, loads, consumer = _channel("here")
    channel.loaded([_row(5, OWN)], 100)
    assert channel.ack(5)
    channel.ack_durable([5])
    channel.add(_message(5))
    assert consumer.pushed == [5] and not channel.ready


def test_arrivals_while_a_load_is_out_are_left_to_the_next_load():
    channel, loads, consumer = _channel("here")
    channel.add(_message(9))  # the load from 0 is out
    channel.loaded([_row(8, OTHER)], 100)  # its snapshot predates 9
    assert consumer.pushed == [8] and loads[-1] == (8, 100)
    channel.loaded([_row(9, OWN)], 100)
    assert consumer.pushed == [8, 9]


def test_the_poll_reads_only_with_consumers_and_no_load_out():
    loads: list[tuple[int, int]] = []
    channel = ReliableChannel(
        "ledger", "c", clock=Clock(), msg_timeout=30.0, mem_queue_size=100,
        load=lambda ch, after, limit: loads.append((after, limit)), on_acks=lambda *a: None, ordered=True,
    )
    channel.order_here()
    channel.poll()
    assert loads == []  # no consumer: idle
    consumer = Consumer()
    channel.subscribe(consumer)
    assert loads == [(0, 100)]
    channel.poll()
    assert loads == [(0, 100)]  # one out already
    channel.loaded([_row(2, OTHER)], 100)
    assert not channel.backlog
    channel.poll()
    assert loads[-1] == (2, 100) and consumer.pushed == [2]


def test_the_orderer_proposes_floors_over_every_owner():
    channel, loads, consumer = _channel("here")
    channel.loaded([_row(4, OTHER), _row(5, OWN), _row(6, OTHER)], 100)
    assert channel.ack(4) and channel.ack(6)
    writes = OwnWrites(OWN)
    assert writes.limit(OTHER) is None  # a live owner elsewhere: exact acks only ...
    limit = writes.limit(OTHER, orderer=True)
    assert limit == math.inf  # ... but the orderer's loads passed everything
    assert channel.progress(OTHER, [4, 6], limit) == (6, [])


def test_a_topic_no_longer_ordered_is_delivered_here_again():
    channel, loads, consumer = _channel("n2")
    assert loads == []
    channel.set_ordered(False)
    assert channel.delivered_by is None and loads == [(0, 100)]
    channel.loaded([_row(3, OWN)], 100)
    assert consumer.pushed == [3]


# -- two stores on one database: two cluster nodes --------------------------------------


class Node:
    def __init__(self, db: MemoryDb, clock: Clock, node_id: str, fenced: bool = True, **options: object):
        workers = {"writer0": db, "acker": db, "loader": db, "admin": db}
        fence = Fence(node_id, lambda: True) if fenced else None
        self.store = ReliableStore(Options(**options), clock, workers, node_id, lambda ok, why: None,
                                   StoreWiring(fence=fence))
        self.store.start(alone=not fenced)
        self.store.apply_topics({"ledger": TopicSpec("ledger", channels=("c",), ordered=True)})
        self.answers: list[object] = []
        self._session = 0

    def send(self, count: int, key: str | None = None) -> None:
        for _ in range(count):
            self._session += 1
            props = Properties(key=key) if key else NO_PROPERTIES
            send = new_send(topic="ledger", producer=self.store.node_id, session_id=self._session, body=b"x",
                            properties=props, status=encode_properties(props))
            self.store.store(send, self.answers.append)


@pytest.fixture
def nodes():
    clock = Clock()
    clock.advance(1_700_000_000)
    db = MemoryDb(clock)
    db.create_topic("ledger", ["c"], ordered=True)
    one, two = Node(db, clock, "n1"), Node(db, clock, "n2")

    def settle(seconds: float = 0.5) -> None:
        for _ in range(int(seconds * 100)):
            clock.advance(0.01)

    for node in (one, two):
        node.store.timers.startService()
    settle()
    yield db, one, two, settle
    for node in (one, two):
        node.store.timers.stopService()


def test_in_a_cluster_an_ordered_topic_waits_for_its_orderer(nodes):
    db, one, two, settle = nodes
    consumers = [Consumer(), Consumer()]
    for node, consumer in zip((one, two), consumers):
        node.store.subscribe("ledger", "c", consumer)
        assert node.store.ordered_topics() == {"ledger"}
        assert node.store.channel("ledger", "c").stats()["delivered_by"] == NO_ORDERER
    one.send(3)
    two.send(3)
    settle()
    assert len(one.answers) == len(two.answers) == 3  # stored on both
    assert consumers[0].pushed == consumers[1].pushed == []  # delivered by neither


def test_the_orderer_delivers_every_nodes_copies_in_id_order_and_polls_for_more(nodes):
    db, one, two, settle = nodes
    consumer, idle = Consumer(credit=1000), Consumer()
    one.store.subscribe("ledger", "c", consumer)
    two.store.subscribe("ledger", "c", idle)
    for _ in range(3):  # interleaved ids
        one.send(2)
        settle(0.05)
        two.send(2)
        settle(0.05)
    one.store.order_here("ledger")
    two.store.order_elsewhere("ledger", "n1")
    settle()
    stored = sorted(m.id for m in db.messages.values())
    assert len(stored) == 12 and {m.owner for m in db.messages.values()} == {
        one.store.incarnation, two.store.incarnation}
    assert consumer.pushed == stored
    # more stored on n2: not handed to n1, which reads them at its next poll
    two.send(4)
    settle()
    stored = sorted(m.id for m in db.messages.values())
    assert consumer.pushed == stored
    two.send(2)
    one.send(1)  # read with those stored on n2 before it
    settle()
    stored = sorted(m.id for m in db.messages.values())
    assert consumer.pushed == stored and idle.pushed == []
    assert two.store.channel("ledger", "c").stats()["delivered_by"] == "n1"
    # the orderer's acks are durable for every owner, and its floors pass everything
    assert one.store.ack_many("ledger", "c", list(consumer.pushed), consumer) == 0
    settle()
    assert not db.deliveries
    assert {key[2]: c.floor for key, c in db.cursors.items()} == {
        one.store.incarnation: stored[-1], two.store.incarnation: stored[-1]}


def test_a_keys_copies_stored_on_both_nodes_go_out_one_at_a_time_in_id_order(nodes):
    db, one, two, settle = nodes
    consumer = Consumer()
    one.store.order_here("ledger")
    one.store.subscribe("ledger", "c", consumer)
    for _ in range(3):
        two.send(1, key="k")
        settle(0.05)
        one.send(1, key="k")
        settle(0.05)
    settle()
    stored = sorted(m.id for m in db.messages.values())
    delivered = []
    while consumer.pushed:
        assert len(consumer.pushed) == 1  # one copy of the key out at a time
        mid = consumer.pushed.pop()
        delivered.append(mid)
        assert one.store.ack_many("ledger", "c", [mid], consumer) == 0
        settle(0.1)
    assert delivered == stored


def test_losing_the_topic_drops_what_the_orderer_held_and_refuses_its_acks(nodes):
    db, one, two, settle = nodes
    consumer = Consumer()
    one.store.order_here("ledger")
    one.store.subscribe("ledger", "c", consumer)
    two.send(2)
    settle()
    assert len(consumer.pushed) == 2
    one.store.order_elsewhere("ledger", None)
    assert one.store.ack_many("ledger", "c", consumer.pushed, consumer) == 2
    assert one.store.channel("ledger", "c").stats()["delivered_by"] == NO_ORDERER
    two.store.order_here("ledger")
    other = Consumer()
    two.store.subscribe("ledger", "c", other)
    settle()
    assert other.pushed == consumer.pushed  # delivered again by the new orderer


def test_a_topic_no_longer_ordered_is_delivered_by_each_node_again(nodes):
    db, one, two, settle = nodes
    consumers = [Consumer(), Consumer()]
    for node, consumer in zip((one, two), consumers):
        node.store.subscribe("ledger", "c", consumer)
        node.send(1)
    settle()
    assert [c.pushed for c in consumers] == [[], []]  # no orderer yet
    for node in (one, two):
        node.store.apply_topics({"ledger": TopicSpec("ledger", channels=("c",), ordered=False)})
        assert node.store.ordered_topics() == set()
    settle()
    # each node its own copy (only the cursors it holds are its to read)
    assert [len(c.pushed) for c in consumers] == [1, 1]
    # ordered again: waits for an orderer once more
    one.store.apply_topics({"ledger": TopicSpec("ledger", channels=("c",), ordered=True)})
    assert one.store.channel("ledger", "c").delivered_by == NO_ORDERER


def test_without_a_cluster_an_ordered_topic_is_delivered_as_before():
    clock = Clock()
    db = MemoryDb(clock)
    db.create_topic("ledger", ["c"], ordered=True)
    node = Node(db, clock, "solo", fenced=False)
    consumer = Consumer()
    node.store.subscribe("ledger", "c", consumer)
    node.send(2)
    for _ in range(20):
        clock.advance(0.01)
    channel = node.store.channel("ledger", "c")
    assert len(consumer.pushed) == 2 and channel.delivered_by is None and not channel.cursor.loads_only
