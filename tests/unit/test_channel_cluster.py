"""Unit tests of the channel's cluster behaviour: pause, rescan after a takeover,
forget after a lost registry session. No IO: a task.Clock, recording consumers and a
loader whose answers the test gives.
"""

from __future__ import annotations

from twisted.internet.task import Clock

from dmq_server.reliable.channel import ReliableChannel, Delivery, ReliableMessage
from dmq_server.db.messages import BacklogRow


class Consumer:
    def __init__(self, credit: int = 100):
        self.credit = credit
        self.in_flight = 0
        self.ids: list[int] = []

    def push_many(self, channel: ReliableChannel, deliveries: list[Delivery]) -> None:
        self.ids += [d.message.message_id for d in deliveries]


def make(mem: int = 10) -> tuple[ReliableChannel, list[tuple[int, int]]]:
    loads: list[tuple[int, int]] = []
    channel = ReliableChannel(
        "orders",
        "billing",
        clock=Clock(),
        msg_timeout=10.0,
        mem_queue_size=mem,
        load=lambda ch, after, limit: loads.append((after, limit)),
        on_acks=lambda ch, ds, ms, who: None,
    )
    return channel, loads


def rows(*ids: int) -> list[BacklogRow]:
    return [BacklogRow(i, "p", i, 0, b"x", 0) for i in ids]


def msg(i: int) -> ReliableMessage:
    return ReliableMessage(i, "orders", "p", i, 0, b"x")


def test_paused_channel_neither_pushes_nor_loads():
    """While paused (not registered, or the session in doubt) a channel pushes nothing
    and asks the loader for nothing; resuming pumps and loads."""
    channel, loads = make()
    channel.paused = True
    consumer = Consumer()
    channel.subscribe(consumer)
    assert loads == [] and consumer.ids == []
    channel.paused = False
    channel.pump()
    assert loads == [(0, 10)]
    channel.loaded(rows(1, 2), 10)
    assert consumer.ids == [1, 2]


def test_rescan_loads_again_from_the_first_id_skipping_what_is_held():
    """Claimed copies have ids below the cursor: rescan makes the next load start at 0,
    and copies already held (ready or in flight) are not taken twice."""
    channel, loads = make()
    consumer = Consumer(credit=1)
    channel.subscribe(consumer)
    channel.loaded(rows(5, 6), 10)  # our own copies; 5 in flight, 6 ready
    assert consumer.ids == [5] and channel.cursor.position == 6 and not channel.backlog
    channel.rescan()
    assert loads[-1] == (0, 9)
    channel.loaded(rows(2, 3, 5, 6), 9)  # 2 and 3 were claimed from a departed node
    assert sorted(d.message.message_id for d in channel.ready) == [2, 3, 6]
    consumer.credit = 10
    channel.pump()
    assert sorted(consumer.ids) == [2, 3, 5, 6]


def test_rescan_during_a_load_applies_after_it():
    """A rescan while a load is out takes effect when it returns: the following load
    starts at 0 again instead of after the rows that load returned."""
    channel, loads = make()
    channel.subscribe(Consumer(credit=0))
    assert loads == [(0, 10)]
    channel.rescan()
    channel.loaded(rows(7, 8), 10)
    assert channel.cursor.position == 0 and channel.backlog


def test_forget_drops_everything_held_and_frees_credit():
    """After a lost session nothing held may be pushed again: ready and in-flight copies
    go, consumers' credit is freed, an ack for a dropped copy is refused, and the next
    load starts from the first id."""
    channel, loads = make()
    consumer = Consumer(credit=2)
    channel.subscribe(consumer)
    channel.loaded(rows(1, 2, 3), 10)
    assert consumer.ids == [1, 2] and consumer.in_flight == 2
    channel.paused = True
    channel.forget()
    assert consumer.in_flight == 0
    assert not channel.ready and not channel.in_flight and not channel.known
    assert channel.cursor.position == 0 and channel.backlog
    assert channel.ack(1) is False
    channel.scan(1000.0)  # no deadline left to fire
    assert consumer.ids == [1, 2]


def test_forget_during_a_load_discards_its_rows():
    """Rows of a load that was out when the session was lost may belong to another node
    by now: they are dropped, as are copies that arrived meanwhile (they are stored,
    and the next load finds them if they are still ours)."""
    channel, loads = make()
    channel.subscribe(Consumer(credit=0))
    assert channel.loading
    channel.add(msg(20))  # arrives while loading
    channel.paused = True
    channel.forget()
    channel.loaded(rows(1, 2), 10)
    assert not channel.ready and channel.cursor.position == 0 and channel.backlog
    channel.paused = False
    channel.pump()
    assert loads[-1] == (0, 10)


def test_arrivals_after_forget_stay_in_the_database():
    """Copies committed after forget are not taken into memory (a takeover may be moving
    them); the next load brings them if they are still this node's."""
    channel, loads = make()
    channel.subscribe(Consumer())
    channel.loaded([], 10)
    channel.paused = True
    channel.forget()
    channel.add(msg(30))
    assert not channel.ready and 30 not in channel.known


def test_rescan_does_not_bring_back_a_copy_acked_while_it_loaded():
    """A rescan load may read a row whose ack commits before the load's answer arrives
    (the ack's durable callback runs first): that copy is not delivered again."""
    channel, loads = make()
    consumer = Consumer()
    channel.subscribe(consumer)
    channel.loaded(rows(1, 2), 10)
    assert consumer.ids == [1, 2]
    channel.ack(1)
    channel.rescan()  # a takeover claimed more rows
    assert channel.loading and loads[-1][0] == 0
    channel.ack_durable([1])  # the ack committed after the load's snapshot
    channel.loaded(rows(1, 3), 10)  # the snapshot still had row 1
    assert consumer.ids == [1, 2, 3]


def test_a_closed_gate_holds_every_push_until_it_opens():
    """The cluster's gate (a node that stood still asks ZooKeeper first): an ack read on
    waking pumps at once, and the gate is asked before anything held is pushed."""
    channel, loads = make()
    consumer = Consumer(credit=1)
    channel.subscribe(consumer)
    channel.loaded(rows(1, 2, 3), 10)
    assert consumer.ids == [1]
    asked: list[bool] = []
    open_ = False

    def gate() -> bool:
        asked.append(open_)
        return open_

    channel.gate = gate
    assert channel.ack(1)  # frees credit and pumps: the gate holds the push
    assert consumer.ids == [1] and asked == [False]
    open_ = True
    channel.pump()
    assert consumer.ids == [1, 2]
