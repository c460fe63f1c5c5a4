"""Unit tests of what a reliable channel tells the message trace and ``/metrics``: why a
delivered copy came back (timeout, consumer gone, REQ), which consumer held an acknowledged
copy, the delivery counters and the publish -> deliver histogram. No IO: a ``task.Clock``
and recording consumers (``test_channel``'s harness)."""

from __future__ import annotations

from twisted.internet.task import Clock

from dmq_server.core.buckets import Buckets
from dmq_server.reliable.channel import CONSUMER_GONE, REQUEUED, TIMEOUT, ReliableChannel, Delivery

from .test_channel import TIMEOUT as MSG_TIMEOUT
from .test_channel import FakeConsumer, message


class Recorder:
    """A channel whose returns and acks are recorded with the consumer that held the copy."""

    def __init__(self) -> None:
        self.clock = Clock()
        self.clock.advance(2.0)  # message(n) was published at 1 s + n ms
        self.returns: list[tuple[int, str, str, int, float]] = []
        self.acks: list[tuple[int, str, float]] = []
        self.latency = Buckets((0.5, 1.0, 5.0))
        self.channel = ReliableChannel(
            "orders", "billing", clock=self.clock, msg_timeout=MSG_TIMEOUT, mem_queue_size=100,
            load=lambda channel, after, limit: channel.loaded([], limit),
            on_acks=self._acks, on_return=self._returned, deliver_latency=self.latency,
        )

    def _returned(self, channel: ReliableChannel, delivery: Delivery, reason: str) -> None:
        self.returns.append((delivery.message.message_id, reason, delivery.consumer.name,
                             delivery.attempts, delivery.delivered_at))

    def _acks(self, channel: ReliableChannel, deliveries: list[Delivery], acked_ms: int, consumer: object) -> None:
        for delivery in deliveries:  # the consumer that held it is still named on it
            self.acks.append((delivery.message.message_id, delivery.consumer.name, delivery.delivered_at))


def test_each_return_is_reported_with_its_reason_and_the_consumer_that_held_it() -> None:
    """A timeout, a disconnect and a REQ each report the copy, why it came back and who held
    it, before the copy is handed to anyone else; the copy is delivered again each time."""
    r = Recorder()
    a, b = FakeConsumer("a", credit=1), FakeConsumer("b", credit=0)
    r.channel.subscribe(a)
    r.channel.subscribe(b)
    r.channel.add(message(1))
    assert a.ids == [1]
    r.clock.advance(MSG_TIMEOUT + 1)
    r.channel.scan(r.clock.seconds())
    assert r.returns == [(1, TIMEOUT, "a", 1, 2.0)]
    assert a.ids == [1, 1]  # delivered again at once (a has credit back)
    r.channel.unsubscribe(a)
    assert r.returns[-1][:4] == (1, CONSUMER_GONE, "a", 2)
    b.credit = 1
    r.channel.pump()
    assert b.ids == [1]
    assert r.channel.requeue(1, b, delay=5.0) is None
    assert r.returns[-1][:4] == (1, REQUEUED, "b", 3)
    # the deferral ending is not another return
    r.clock.advance(6.0)
    r.channel.scan(r.clock.seconds())
    assert len(r.returns) == 3 and b.ids == [1, 1]


def test_an_ack_reports_the_consumer_that_held_the_copy_then_frees_its_credit() -> None:
    r = Recorder()
    a = FakeConsumer("a", credit=1)
    r.channel.subscribe(a)
    r.channel.add(message(1))
    r.clock.advance(3.0)
    assert r.channel.ack(1)
    assert r.acks == [(1, "a", 2.0)]
    assert a.in_flight == 0 and r.returns == []


def test_counters_and_the_publish_to_deliver_histogram() -> None:
    """Every push counts as a delivery; a push of a copy delivered before also as a
    redelivery; only the first delivery is observed, as its age since publishing."""
    r = Recorder()
    a = FakeConsumer("a", credit=10)
    r.channel.subscribe(a)
    r.channel.add(message(1))  # published at 1.001 s, delivered at 2 s: 0.999 s
    r.clock.advance(MSG_TIMEOUT + 1)
    r.channel.scan(r.clock.seconds())  # delivered again: not observed
    stats = r.channel.stats()
    assert (stats["delivery_count"], stats["redelivery_count"]) == (2, 1)
    assert r.latency.count == 1
    assert r.latency.snapshot()[0] == [("0.5", 0), ("1.0", 1), ("5.0", 1), ("+Inf", 1)]


def test_locate_says_where_this_node_holds_a_copy() -> None:
    r = Recorder()
    a = FakeConsumer("a", credit=1)
    r.channel.subscribe(a)
    r.channel.add(message(1))
    r.channel.add(message(2))
    assert r.channel.locate(1) == {"state": "in_flight", "attempts": 1, "consumer": "a",
                                   "delivered_at": 2.0, "deadline": 2.0 + MSG_TIMEOUT}
    assert r.channel.locate(2) == {"state": "ready", "attempts": 0}
    assert r.channel.requeue(1, a, delay=5.0) is None
    assert r.channel.locate(1)["state"] == "deferred"
    assert r.channel.locate(3) is None
    assert r.channel.consumer_stats() == [{"name": "a", "credit": 1, "in_flight": 1}]
