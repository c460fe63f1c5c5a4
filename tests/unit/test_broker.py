"""Unit tests of ``Broker`` with its real writers (GroupCommitWriter, AckBatcher) on the
in-memory database (``dmq_server.db.memory``) and a ``task.Clock``: no PostgreSQL.

The reliable promise is checked by counting: every id acknowledged to a producer
and every id pushed to a consumer is recorded, and each test asserts that no
acknowledged id is missing from any of its topic's channels, also when a batch's
answer is lost (the broker must rescan the store) or PostgreSQL refuses one row of a
batch (the writer must bisect and fail only that send).
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
from twisted.internet.task import Clock

from dmq_server.broker import Broker, Published, PublishRejected
from dmq_server.core.options import Options
from dmq_server.db.errors import StorageError
from dmq_server.db.memory import MemoryDb

NODE = "node-1"


class Consumer:
    """What a protocol's subscription is to a channel: credit, and pushes recorded."""

    def __init__(self, credit: int = 1000):
        self.credit = credit
        self.in_flight = 0
        self.pushed: list[tuple[str, int]] = []  # (channel, message id)

    def push(self, channel: Any, delivery: Any) -> None:
        self.pushed.append((channel.name, delivery.message.message_id))


class Harness:
    def __init__(self, db_delay: float = 0.0, **options: Any):
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.db = MemoryDb(self.clock, delay=db_delay)
        self.db.create_topic("orders", ["billing", "audit"])
        self.db.create_topic("limited", ["c"], rate_limit=1)
        roles = {"writer0": self.db, "acker": self.db, "loader": self.db, "admin": self.db}
        self.broker = Broker(Options(**options), self.clock, roles, NODE)
        self.acknowledged: dict[tuple[str, int], int] = {}  # (producer, session) -> id the producer was told
        self.answers: dict[tuple[str, int], Any] = {}
        started = self.broker.start()
        self.settle()
        assert started.called

    def send(
        self, topic: str, producer: str, session_id: int, body: bytes = b"b", *, resend: bool = True,
        due_ms: int | None = None,
    ) -> None:
        """One send through the broker (its publish API lives here only)."""
        key = (producer, session_id)

        def done(outcome: Any) -> None:
            self.answers[key] = outcome
            if isinstance(outcome, Published):
                self.acknowledged[key] = outcome.message_id

        self.broker.publish_cb(topic, producer, session_id, body, 0, done, due_ms, resend)

    def subscribe(self, topic: str, channel: str, consumer: Consumer) -> Any:
        d = self.broker.subscribe(topic, channel, consumer)
        self.settle()
        return d

    def settle(self, seconds: float = 1.0) -> None:
        """Let the database answer and the timers (ack flush, scan) run."""
        for _ in range(int(seconds * 100)):
            self.clock.advance(0.01)

    def ack_all(self, topic: str, consumer: Consumer) -> None:
        for channel, message_id in consumer.pushed:
            assert self.broker.ack(topic, channel, message_id, consumer) is None

    def assert_none_lost(self, topic: str, consumers: dict[str, Consumer]) -> None:
        """Every id acknowledged to a producer was pushed on every channel of the topic."""
        for name, consumer in consumers.items():
            delivered = {mid for ch, mid in consumer.pushed if ch == name}
            lost = set(self.acknowledged.values()) - delivered
            assert not lost, f"{name}: acknowledged but never delivered: {sorted(lost)}"


@pytest.fixture
def h() -> Harness:
    return Harness()


def test_publish_is_stored_delivered_to_each_channel_and_acked(h):
    billing, audit = Consumer(), Consumer()
    h.subscribe("orders", "billing", billing)
    h.subscribe("orders", "audit", audit)
    for i in range(50):
        h.send("orders", "p", i, b"m%d" % i)
    h.settle()
    assert len(h.acknowledged) == 50
    assert len(set(h.acknowledged.values())) == 50
    h.assert_none_lost("orders", {"billing": billing, "audit": audit})
    assert Counter(mid for _, mid in billing.pushed + audit.pushed) == Counter(
        {mid: 2 for mid in h.acknowledged.values()}
    )  # each copy pushed once per channel
    assert {m.id for m in h.db.messages.values()} == set(h.acknowledged.values())
    h.ack_all("orders", billing)
    h.ack_all("orders", audit)
    h.settle()
    assert not h.db.deliveries  # every ack made durable
    assert len(h.db.delivery_log) == 100
    assert h.broker.acker.acked == 100


def test_a_resend_is_answered_from_the_stored_row_and_delivered_once(h):
    billing = Consumer()
    h.subscribe("orders", "billing", billing)
    h.send("orders", "p", 1)
    h.settle()
    first = h.answers[("p", 1)]
    h.answers.clear()
    h.send("orders", "p", 1)  # the producer did not hear the answer and sends again
    h.settle()
    again = h.answers[("p", 1)]
    assert isinstance(again, Published) and again.duplicate and again.message_id == first.message_id
    assert billing.pushed == [("billing", first.message_id)]
    assert len(h.db.messages) == 1


def test_a_plain_send_of_a_stored_pair_is_refused(h):
    h.send("orders", "p", 1, resend=False)
    h.settle()
    h.send("orders", "p", 1, resend=False)
    h.settle()
    answer = h.answers[("p", 1)]
    assert isinstance(answer, PublishRejected) and answer.reason == "invalid"
    assert "UP_PRODUCER_RESEND" in answer.description
    assert len(h.db.messages) == 1


def test_a_send_over_the_rate_limit_becomes_a_dead_letter(h):
    h.send("limited", "p", 1)
    h.send("limited", "p", 2)
    h.settle()
    assert isinstance(h.answers[("p", 1)], Published)
    refused = h.answers[("p", 2)]
    assert isinstance(refused, PublishRejected) and refused.reason == "rate_limited"
    assert "recorded as dead letter" in refused.description
    letters = list(h.db.dead_letters.values())
    assert [(d["reason"], d["producer"], d["session_id"]) for d in letters] == [("rate_limited", "p", 2)]
    assert len(h.db.messages) == 1


def test_a_batch_of_unknown_outcome_is_found_by_a_rescan():
    h = Harness(db_delay=0.005)
    billing, audit = Consumer(), Consumer()
    h.subscribe("orders", "billing", billing)
    h.subscribe("orders", "audit", audit)
    h.send("orders", "p", 0)
    h.settle()
    # the next batch commits, but its answer is lost
    h.db.fail_next("insert_new_messages", "unknown")
    for i in range(1, 21):
        h.send("orders", "p", i)
    h.settle()
    failed = [k for k, v in h.answers.items() if isinstance(v, StorageError)]
    assert failed, "the injected failure did not reach a send"
    assert h.broker.unknown_outcomes == 1
    # the producers retry what failed, as the client library does
    for producer, session_id in failed:
        h.send("orders", producer, session_id)
    h.settle()
    assert all(isinstance(h.answers[k], Published) and h.answers[k].duplicate for k in failed)
    assert len(h.acknowledged) == 21
    # the copies of the lost batch were handed to no channel by the commit: the
    # rescan found them in the store
    h.assert_none_lost("orders", {"billing": billing, "audit": audit})
    assert {m.id for m in h.db.messages.values()} == set(h.acknowledged.values())


def test_a_refused_row_fails_only_its_own_send():
    h = Harness(db_delay=0.005)
    billing = Consumer()
    h.subscribe("orders", "billing", billing)
    h.send("orders", "p", 0)  # goes alone; the next sends wait for it and form one batch
    h.db.fail_next("insert_new_messages", "refused", times=100, when=lambda p: "bad" in p["producers"])
    for i in range(1, 8):
        h.send("orders", "p", i)
    h.send("orders", "bad", 1)
    h.settle()
    refused = h.answers[("bad", 1)]
    assert isinstance(refused, PublishRejected) and refused.reason == "invalid"
    assert sorted(k for k in h.answers if k != ("bad", 1)) == [("p", i) for i in range(8)]
    assert all(isinstance(h.answers[("p", i)], Published) for i in range(8))
    assert h.broker.writer.batches > 2  # the batch was split
    h.assert_none_lost("orders", {"billing": billing})
    assert ("bad", 1) not in {(m.producer, m.session_id) for m in h.db.messages.values()}


def test_acks_survive_a_failed_ack_batch(h):
    billing = Consumer()
    h.subscribe("orders", "billing", billing)
    for i in range(5):
        h.send("orders", "p", i)
    h.settle()
    h.db.fail_next("ack_deliveries", "lost")
    h.ack_all("orders", billing)
    h.settle(2)  # the batch fails, waits, and is retried
    assert not [k for k in h.db.deliveries if k[1] == "billing"]
    assert h.broker.acker.acked == 5


def test_an_ack_by_another_consumer_is_refused(h):
    billing, stranger = Consumer(), Consumer(credit=0)
    h.subscribe("orders", "billing", billing)
    h.subscribe("orders", "billing", stranger)
    h.send("orders", "p", 1)
    h.settle()
    [(_, message_id)] = billing.pushed
    assert h.broker.ack("orders", "billing", message_id, stranger) is not None
    h.settle()
    assert ("orders", "billing", message_id) in h.db.deliveries


def test_pause_empty_and_channel_state_go_through_the_store(h):
    billing = Consumer()
    h.subscribe("orders", "billing", billing)
    paused = h.broker.pause_channel("orders", "billing")
    h.settle()
    assert paused.called and ("orders", "billing") in h.db.pauses
    h.send("orders", "p", 1)
    h.settle()
    assert billing.pushed == []  # held while paused; stored
    emptied = h.broker.empty_channel("orders", "billing")
    h.settle()
    counts: list[int] = []
    emptied.addCallback(counts.append)
    assert counts == [1]
    h.broker.pause_channel("orders", "billing", paused=False)
    h.settle(1)
    assert billing.pushed == [] and h.broker.channels[("orders", "billing")].stored_count == 0


def test_a_delayed_send_is_stored_in_the_delay_table_once(h):
    billing = Consumer()
    h.subscribe("orders", "billing", billing)
    due = int(h.clock.seconds() * 1000) + 60_000
    h.send("orders", "p", 1, due_ms=due)
    h.settle()
    first = h.answers[("p", 1)]
    h.send("orders", "p", 1, due_ms=due)
    h.settle()
    again = h.answers[("p", 1)]
    assert isinstance(first, Published) and not first.duplicate
    assert isinstance(again, Published) and again.duplicate and again.message_id == first.message_id
    assert [(d["producer"], d["session_id"], d["due_ms"]) for d in h.db.delayed.values()] == [("p", 1, due)]
    assert billing.pushed == [] and not h.db.messages  # not due: nothing delivered yet
