"""/pub and /mpub to a reliable topic stamp messages with the injected clock (they read
the wall clock before), so a producer time and a DPUB's due time follow the reactor."""

from __future__ import annotations

from twisted.internet.task import Clock

from dmq_server.broker import Published
from dmq_server.http.nsqd import NsqHttp


class Broker:
    topics = {"orders": object()}

    def __init__(self) -> None:
        self.sends: list[tuple] = []

    def publish_cb(self, topic, producer, session_id, body, produced_ms, done, **delay):
        self.sends.append((topic, body, produced_ms, delay))
        done(Published(len(self.sends), False))


class Context:
    http_producer = "nsq-http@test"

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.ids = iter(range(1, 100))

    def new_session_id(self) -> int:
        return next(self.ids)

    def resolve(self, topic, then) -> None:
        then(True)  # reliable


class Store:
    topics: dict = {}


def api(clock: Clock, broker: Broker) -> NsqHttp:
    return NsqHttp(
        store=Store(), ctx=Context(clock), broker=broker, options=None, cluster=None,
        addresses=lambda: (("127.0.0.1", 4150), ("127.0.0.1", 4151)),
        dmq_ping=None, dmq_stats=None, dmq_info=None,
    )


def test_http_publish_uses_the_injected_clock():
    clock, broker = Clock(), Broker()
    clock.advance(1_000_000.25)  # far from the wall clock
    answers: list = []
    api(clock, broker)._publish("orders", [b"a", b"b"], 0).addCallback(answers.append)
    assert answers == ["OK"]
    assert [s[2] for s in broker.sends] == [1_000_000_250, 1_000_000_250]
    assert all(s[3] == {} for s in broker.sends)


def test_http_deferred_publish_is_due_by_the_injected_clock():
    clock, broker = Clock(), Broker()
    clock.advance(2_000_000)
    api(clock, broker)._publish("orders", [b"later"], 1500)
    assert broker.sends == [("orders", b"later", 2_000_000_000, {"due_ms": 2_000_001_500})]
