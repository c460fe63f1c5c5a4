"""/pub and /mpub to a reliable topic stamp messages with the injected clock (they read
the wall clock before), so a producer time and a DPUB's due time follow the reactor."""

from __future__ import annotations

from twisted.internet.task import Clock

from dmq_server.core.publish import Published
from dmq_server.http.nsqd import NsqHttp


class Broker:
    topics = {"orders": object()}

    def __init__(self) -> None:
        self.sends: list[tuple] = []

    def publish(self, request, done):
        """A reliable topic's broker: one request per /pub or /mpub, answered later."""
        self.sends.append((request.topic, request.bodies, request.produced_ms, request.due_ms))
        self.answer = lambda: done(Published(len(self.sends), False, len(request.bodies)))


class Context:
    http_producer = "nsq-http@test"

    def __init__(self, clock: Clock) -> None:
        self.clock = clock


def api(clock: Clock, broker: Broker) -> NsqHttp:
    return NsqHttp(
        ctx=Context(clock), broker=broker, options=None, cluster=None,
        addresses=lambda: (("127.0.0.1", 4150), ("127.0.0.1", 4151)),
        dmq_ping=None, dmq_stats=None, dmq_info=None,
    )


def test_http_publish_uses_the_injected_clock():
    clock, broker = Clock(), Broker()
    clock.advance(1_000_000.25)  # far from the wall clock
    answers: list = []
    api(clock, broker)._publish("orders", [b"a", b"b"], 0).addCallback(answers.append)
    assert broker.sends == [("orders", [b"a", b"b"], 1_000_000_250, None)]
    assert answers == []
    broker.answer()
    assert answers == ["OK"]


def test_http_deferred_publish_is_due_by_the_injected_clock():
    clock, broker = Clock(), Broker()
    clock.advance(2_000_000)
    api(clock, broker)._publish("orders", [b"later"], 1500)
    assert broker.sends == [("orders", [b"later"], 2_000_000_000, 2_000_001_500)]
