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

from dmq_server.broker import Broker, Fence
from dmq_server.core.errors import Exiting, Invalid, NoTopic, QueueFailed, RateLimited
from dmq_server.core.publish import Published, PublishRequest, Send
from dmq_server.core.options import Options
from dmq_server.db.storage_errors import StorageError
from dmq_server.db.memory import MemoryDb
from dmq_server.fast.fast_store import FastStore
from dmq_server.reliable.writer import PARALLEL_MIN
from dmq_server.reliable import store as reliable_store
from tests.unit.test_nsq_store import FakeClient, MemoryBackend

NODE = "node-1"


class Consumer:
    """What a protocol's subscription is to a channel: credit, and pushes recorded."""

    def __init__(self, credit: int = 1000):
        self.credit = credit
        self.in_flight = 0
        self.pushed: list[tuple[str, int]] = []  # (channel, message id)

    def push_many(self, channel: Any, deliveries: Any) -> None:
        self.pushed += [(channel.name, d.message.message_id) for d in deliveries]


class Harness:
    def __init__(self, db_delay: float = 0.0, fence: Fence | None = None, **options: Any):
        self.clock = Clock()
        self.clock.advance(1_700_000_000)
        self.db = MemoryDb(self.clock, delay=db_delay)
        self.db.create_topic("orders", ["billing", "audit"])
        self.db.create_topic("limited", ["c"], rate_limit=1)
        self.db.create_topic("clicks", store="fast")
        roles = {"writer0": self.db, "acker": self.db, "loader": self.db, "admin": self.db}
        self.fast = FastStore(self.clock, None, node_id=1, backend_factory=lambda name: MemoryBackend())
        self.fast.start()
        self.broker = Broker(Options(**options), self.clock, roles, NODE, fast=self.fast, fence=fence)
        self.acknowledged: dict[tuple[str, int], int] = {}  # (producer, session) -> id the producer was told
        self.answers: dict[tuple[str, int], Any] = {}
        started = self.broker.start()
        self.settle()
        assert started.called
        # the periodic jobs, as the service tree runs them once the broker's stage is up
        self.fast.timers.startService()
        self.broker.timers.startService()
        self.settle()

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

        self.broker.publish(one_send(topic, producer, body, session_id, resend=resend, due_ms=due_ms), done)

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
    assert h.broker.reliable.acker.acked == 100


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
    assert isinstance(answer, Invalid) and answer.code == "E_INVALID"
    assert "UP_PRODUCER_RESEND" in answer.description
    assert len(h.db.messages) == 1
    assert f"already stored (message {h.acknowledged[('p', 1)]})" in answer.description


def test_a_plain_delayed_send_of_a_stored_pair_is_refused(h):
    """The delay table's group commit refuses a stored pair as the message table's does:
    the stored entry's id is in the refusal, and nothing is stored twice."""
    due = int(h.clock.seconds() * 1000) + 60_000
    h.send("orders", "p", 1, due_ms=due, resend=False)
    h.settle()
    first = h.answers[("p", 1)]
    h.send("orders", "p", 1, due_ms=due, resend=False)
    h.settle()
    answer = h.answers[("p", 1)]
    assert isinstance(first, Published) and isinstance(answer, Invalid) and answer.code == "E_INVALID"
    assert f"already stored (message {first.message_id})" in answer.description
    assert len(h.db.delayed) == 1


def test_a_send_over_the_rate_limit_becomes_a_dead_letter(h):
    h.send("limited", "p", 1)
    h.send("limited", "p", 2)
    h.settle()
    assert isinstance(h.answers[("p", 1)], Published)
    refused = h.answers[("p", 2)]
    assert isinstance(refused, RateLimited) and refused.status.startswith("E_RATE_LIMITED topic 'limited'")
    assert "recorded as dead letter" in refused.description
    letters = list(h.db.dead_letters.values())
    assert [(d["reason"], d["producer"], d["session_id"]) for d in letters] == [("rate_limited", "p", 2)]
    assert len(h.db.messages) == 1


def _two_channels_after_one_send() -> tuple[Harness, Consumer, Consumer]:
    """A harness with a consumer on each channel of ``orders`` and one message stored
    (the next sends wait for its commit and form one batch)."""
    h = Harness(db_delay=0.005)
    billing, audit = Consumer(), Consumer()
    h.subscribe("orders", "billing", billing)
    h.subscribe("orders", "audit", audit)
    h.send("orders", "p", 0)
    h.settle()
    return h, billing, audit


def test_a_batch_of_unknown_outcome_is_found_by_a_rescan():
    h, billing, audit = _two_channels_after_one_send()
    # the next batch commits, but its answer is lost
    h.db.fail_next("insert_new_messages", "unknown")
    for i in range(1, 21):
        h.send("orders", "p", i)
    h.settle()
    failed = [k for k, v in h.answers.items() if isinstance(v, StorageError)]
    assert failed, "the injected failure did not reach a send"
    assert h.broker.reliable.unknown_outcomes == 1
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


def test_a_batch_cut_off_that_commits_after_every_rescan_is_still_delivered():
    """The answer to a batch is lost and its commit becomes visible only later, after
    the rescans that followed the failure and the next successful commit (a commit cut
    off by --pg-timeout while it waited for its synchronous standby, released when a
    standby came back). The broker keeps looking for the sends of unknown outcome, and
    the channels read them once the store shows them."""
    from dmq_server.db.messages import NewMessage, insert_messages_steps

    h, billing, audit = _two_channels_after_one_send()
    h.db.fail_next("insert_new_messages", "lost")  # nothing visible yet
    for i in range(1, 11):
        h.send("orders", "p", i)
    h.settle()
    failed = sorted(k for k, v in h.answers.items() if isinstance(v, StorageError))
    assert failed and h.broker.reliable.unknown_outcomes == 1
    h.send("orders", "q", 1)  # the next commit succeeds: the rescans run and find nothing
    h.settle()
    # now the cut-off transaction ends, committed
    late = [NewMessage("orders", p, s, 0, b"b") for p, s in failed]
    h.db.run_steps(insert_messages_steps, late, NODE, h.broker.reliable.writes.owner)
    h.settle(3.0)
    for producer, session_id in failed:  # the producers' resends are answered as duplicates
        h.send("orders", producer, session_id)
    h.settle()
    assert all(isinstance(h.answers[k], Published) and h.answers[k].duplicate for k in failed)
    h.assert_none_lost("orders", {"billing": billing, "audit": audit})


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
    assert isinstance(refused, Invalid)
    assert sorted(k for k in h.answers if k != ("bad", 1)) == [("p", i) for i in range(8)]
    assert all(isinstance(h.answers[("p", i)], Published) for i in range(8))
    assert h.broker.reliable.writer.batches > 2  # the batch was split
    h.assert_none_lost("orders", {"billing": billing})
    assert ("bad", 1) not in {(m.producer, m.session_id) for m in h.db.messages.values()}


def test_acks_survive_a_failed_ack_batch(h):
    billing = Consumer()
    h.subscribe("orders", "billing", billing)
    for i in range(5):
        h.send("orders", "p", i)
    h.settle()
    h.db.fail_next("ack_new_deliveries", "lost")
    h.ack_all("orders", billing)
    h.settle(2)  # the batch fails, waits, and is retried
    assert not [k for k in h.db.deliveries if k[1] == "billing"]
    assert h.broker.reliable.acker.acked == 5


def test_acks_flushed_after_another_node_took_the_cursor_are_not_made_durable():
    """In a cluster, acks still queued when another node claimed the cursor (this node
    froze past its ZooKeeper session) are refused by the ack statement: not counted
    durable, not logged, and the copies forgotten here, so only the new holder delivers
    them; the acks flushed before the claim stay durable."""
    h = Harness(fence=Fence(NODE, lambda: True))  # a cluster node: its acks are fenced
    store = h.broker.reliable
    billing = Consumer()
    h.subscribe("orders", "billing", billing)
    for i in range(5):
        h.send("orders", "p", i)
    h.settle()
    ids = [mid for _, mid in billing.pushed]
    assert len(ids) == 5
    for mid in ids[:2]:
        assert h.broker.ack("orders", "billing", mid, billing) is None
    h.settle()
    for mid in ids[2:]:
        assert h.broker.ack("orders", "billing", mid, billing) is None
    # before the acker's flush, another node claims the cursor of this incarnation
    [cursor] = [c for (topic, name, _), c in h.db.cursors.items() if (topic, name) == ("orders", "billing")]
    cursor.holder = "node-2"
    h.settle()
    waiting = sorted(mid for (topic, name, mid) in h.db.deliveries if name == "billing")
    assert waiting == ids[2:]  # still the new holder's to deliver: nothing it pushes is a duplicate
    assert sorted(row["message_id"] for row in h.db.delivery_log) == ids[:2]
    assert store.acks_fenced == 3
    acks = h.broker.stats()["acks"]
    assert (acks["durable"], acks["fenced"]) == (2, 3)
    channel = store.channels[("orders", "billing")]
    assert not set(ids) & (channel.known | set(channel.finishing))  # forgotten here


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


def test_an_unpause_made_while_the_channel_state_read_is_out_is_not_undone_by_it():
    """The periodic read of every node's pauses began before the operator's unpause here
    and answers after it: what it read is older than the unpause (the CI failure of
    test_the_same_channel_operations_on_the_cli_the_console_and_the_admin_api)."""
    h = Harness(db_delay=0.05)
    billing = Consumer()
    h.subscribe("orders", "billing", billing)
    h.broker.pause_channel("orders", "billing")
    h.settle()
    h.send("orders", "p", 1)
    h.settle()
    assert billing.pushed == []
    channel = h.broker.channels[("orders", "billing")]
    applied: list[bool] = []
    h.broker.reliable.read_channel_state().addCallback(applied.append)  # reads the pause now, applies it later
    unpaused = h.broker.pause_channel("orders", "billing", paused=False)
    h.clock.advance(0.06)
    assert unpaused.called and not applied and channel.held is False
    h.settle()
    assert applied and channel.held is False
    assert [mid for _, mid in billing.pushed] == [h.acknowledged[("p", 1)]]
    h.broker.reliable.read_channel_state()  # the next read sees the unpause stored
    h.settle()
    assert channel.held is False and ("orders", "billing") not in h.db.pauses


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


# -- routing: one request value, one answer, the store chosen by the topic ---------------
def one_send(topic: str, producer: str, body: bytes, session_id: int, *, resend: bool = True,
             due_ms: int | None = None) -> PublishRequest:
    """A dmq protocol's send: one message with its producer's session id."""
    send = Send(topic=topic, producer=producer, session_id=session_id, body=body, resend=resend)
    return PublishRequest(topic=topic, producer=producer, sends=[send], due_ms=due_ms)


def publish(h: Harness, request: PublishRequest) -> list[Any]:
    """``request`` through ``Broker.publish``; the answers ``done`` got (one, or none yet)."""
    answers: list[Any] = []
    h.broker.publish(request, answers.append)
    return answers


def test_a_batch_is_answered_once_after_every_body_is_stored():
    """An MPUB-like request (no session ids: the broker numbers the bodies) gets one
    answer, only once all three are committed, and each is delivered."""
    h = Harness(db_delay=0.005)
    billing = Consumer()
    h.subscribe("orders", "billing", billing)
    answers = publish(h, PublishRequest(topic="orders", producer="nsq:peer@x", bodies=[b"a", b"b", b"c"]))
    assert answers == []  # not before commit
    h.settle()
    [answer] = answers
    assert isinstance(answer, Published) and answer.count == 3
    stored = {m.id for m in h.db.messages.values()}
    assert len(stored) == 3 and answer.message_id in stored
    assert {mid for _, mid in billing.pushed} == stored
    assert len({(m.producer, m.session_id) for m in h.db.messages.values()}) == 3
    assert h.broker.reliable.writer.batches == 1  # the bodies reach the group commit together


def test_a_batch_with_one_refused_body_answers_that_failure_once(h):
    """The countdown waits for every body; the answer is the failure, and the bodies
    stored before it stay stored and delivered (a producer's retry may store them twice)."""
    billing = Consumer()
    h.subscribe("orders", "billing", billing)
    h.db.fail_next("insert_new_messages", "refused", times=100, when=lambda p: b"bad" in p["bodies"])
    answers = publish(h, PublishRequest(topic="orders", producer="nsq:peer@x", bodies=[b"ok1", b"bad", b"ok2"]))
    h.settle()
    [answer] = answers
    assert isinstance(answer, Invalid)
    bodies = sorted(m.body for m in h.db.messages.values())
    assert bodies == [b"ok1", b"ok2"] and len(billing.pushed) == 2


def test_an_empty_batch_is_published_at_once(h):
    assert publish(h, PublishRequest(topic="orders", producer="nsq-http@x", bodies=[])) == [Published(0, False, 0)]


def test_a_dmq_send_to_a_registered_fast_topic_goes_to_the_fast_store(h):
    """dmq clients reach fast topics: answered before publish returns, with the fast
    store's id, and the message is in the fast topic (not in PostgreSQL)."""
    [answer] = publish(h, one_send("clicks", "p", b"hit", 7, resend=False))
    assert isinstance(answer, Published) and not answer.duplicate
    topic = h.fast.topics["clicks"]
    assert topic.message_count == 1
    [message] = topic.memory
    assert int(message.id, 16) == answer.message_id and message.body == b"hit"
    assert not h.db.messages


def test_a_delayed_send_to_a_fast_topic_is_deferred_there(h):
    due = int(h.clock.seconds() * 1000) + 5_000
    [answer] = publish(h, one_send("clicks", "p", b"later", 1, due_ms=due))
    assert isinstance(answer, Published)
    [message] = h.fast.topics["clicks"].memory
    assert message.deferred == 5.0


def test_an_unregistered_name_is_refused_for_dmq_and_made_fast_for_nsq(h):
    """One registry refresh decides; dmq's rule refuses the name, NSQ's makes a fast topic."""
    refreshes = h.db.names_run().count("list_topics")
    answers = publish(h, one_send("nowhere", "p", b"x", 1))
    h.clock.advance(0.001)  # the refresh's answer, before any periodic one
    assert h.db.names_run().count("list_topics") == refreshes + 1
    h.settle()
    assert len(answers) == 1 and isinstance(answers[0], NoTopic)
    assert answers[0].status == "E_NO_TOPIC topic 'nowhere' is not registered or has no channel"
    assert "nowhere" not in h.fast.topics
    answers = publish(h, PublishRequest(topic="nowhere", producer="nsq:peer@x", bodies=[b"x"], create_fast=True))
    h.settle()
    assert len(answers) == 1 and isinstance(answers[0], Published)
    assert h.fast.topics["nowhere"].message_count == 1
    again = publish(h, PublishRequest(topic="nowhere", producer="nsq:peer@x", bodies=[b"y"], create_fast=True))
    assert isinstance(again[0], Published)  # known now: answered at once, no refresh


def test_an_unknown_name_while_the_registry_is_unreadable_is_not_made_fast(h):
    """A name the cache does not know may be a reliable topic registered a moment ago:
    while the registry cannot be read, it is refused with the storage error, never
    published to a fast topic of the same name."""
    h.db.fail_next("list_topics", "refused")
    answers = publish(h, PublishRequest(topic="fresh", producer="nsq:peer@x", bodies=[b"x"], create_fast=True))
    h.settle()
    assert len(answers) == 1 and answers[0].code == "E_STORAGE"
    assert "fresh" not in h.fast.topics


def test_fast_store_failures_are_fatal_errors(h):
    """A fast topic closing answers Exiting; a failing disk queue answers QueueFailed
    and marks the fast store unhealthy. Both are fatal (NSQ closes, as nsqd does)."""
    topic = h.fast.get_topic("clicks")
    topic.exiting = True
    [answer] = publish(h, one_send("clicks", "p", b"x", 1))
    assert isinstance(answer, Exiting) and answer.fatal and answer.status == "E_EXITING exiting"
    topic.exiting = False

    def broken(messages: Any) -> None:
        raise OSError("disk full")

    topic.put_many = broken
    [answer] = publish(h, one_send("clicks", "p", b"x", 2))
    assert isinstance(answer, QueueFailed) and answer.fatal and "disk full" in answer.description
    assert h.fast.health_error is not None


def test_every_check_runs_for_both_stores(h):
    """One set of rules: an oversized body or a bad producer is refused the same way
    whether the topic is reliable or fast, and nothing is stored."""
    big = b"x" * (h.broker.options.max_msg_size + 1)
    for topic in ("orders", "clicks"):
        [answer] = publish(h, PublishRequest(topic=topic, producer="p", bodies=[b"ok", big]))
        assert isinstance(answer, Invalid) and answer.code == "E_BAD_BODY"
        [answer] = publish(h, one_send(topic, "p\x00", b"ok", 1))
        assert isinstance(answer, Invalid) and "control character" in answer.description
    h.settle()
    assert not h.db.messages and "clicks" not in h.fast.topics


def test_copies_a_silent_consumer_holds_are_redelivered_and_none_is_lost(h):
    """The fault: a consumer takes copies and stops acknowledging (it stopped reading; its
    credit is gone), touching some and requeueing two with a delay before it goes quiet.
    The broker's scan timer (the service tree's TimerService, on the clock) and the shared
    deadline tracker hand every copy to another consumer once its deadline passes, a
    touched one only after its extended deadline. Counted: every id acknowledged to a
    producer is acknowledged on both channels; nothing stays in flight or stored."""
    silent, audit, worker = Consumer(credit=10), Consumer(), Consumer()
    h.subscribe("orders", "billing", silent)
    h.subscribe("orders", "audit", audit)
    channel = h.broker.channels[("orders", "billing")]
    for i in range(30):
        h.send("orders", "p", i, b"m%d" % i)
    h.settle()
    assert len(h.acknowledged) == 30 and len(silent.pushed) == 10
    h.ack_all("orders", audit)  # the other channel is consumed normally
    held = [mid for _, mid in silent.pushed]
    acked: list[int] = []

    def worker_acks() -> set[int]:
        """The worker acknowledges whatever it was handed since it last looked."""
        for name, mid in worker.pushed[len(acked):]:
            assert h.broker.ack("orders", name, mid, worker) is None
            acked.append(mid)
        h.settle()
        return set(acked)

    h.clock.advance(30)
    silent.credit = 0  # it stops reading (no more credit: nothing new is pushed to it)
    for mid in held[:4]:
        assert channel.touch(mid, silent) is None  # deadline now + 60 s
    for mid in held[4:6]:
        assert channel.requeue(mid, silent, 5.0) is None  # back in 5 s, to whoever has credit
    h.subscribe("orders", "billing", worker)
    assert not set(held) & worker_acks()  # the other 20 copies; the held ones wait
    h.clock.advance(6)
    assert worker_acks() & set(held) == set(held[4:6])  # the requeue delay ended
    h.clock.advance(25)  # 61 s after the push: the untouched copies time out
    assert worker_acks() & set(held) == set(held[4:])  # the touched ones not yet
    h.clock.advance(30)  # the touched ones' extended deadline
    assert worker_acks() >= set(held)
    assert sorted(acked) == sorted(h.acknowledged.values())  # each once: none redelivered twice
    h.assert_none_lost("orders", {"billing": worker, "audit": audit})
    assert not channel.in_flight and not h.db.deliveries  # every copy acked, durably
    assert channel.timeout_count == 8  # 4 untouched + 4 touched; the 2 requeued are no timeout


def test_a_registered_fast_topics_rate_limit_refuses_a_whole_request():
    """A fast topic's rate_limit is the broker's, as a reliable topic's is: within the
    limit the batch is stored; over it the whole request is refused (no partial MPUB),
    nothing reaches the fast store, and no dead letter is written (the fast store has
    none). A second later the bucket has refilled."""
    h = Harness()
    h.db.create_topic("metered", store="fast", rate_limit=3)
    h.broker.refresh_registry()
    h.settle()
    [answer] = publish(h, PublishRequest(topic="metered", producer="p", bodies=[b"1", b"2", b"3"]))
    assert isinstance(answer, Published) and answer.count == 3
    [answer] = publish(h, PublishRequest(topic="metered", producer="p", bodies=[b"4"]))
    assert isinstance(answer, RateLimited) and answer.code == "E_RATE_LIMITED"
    assert h.fast.topics["metered"].message_count == 3
    assert not h.db.dead_letters
    h.clock.advance(1)
    [answer] = publish(h, PublishRequest(topic="metered", producer="p", bodies=[b"4"]))
    assert isinstance(answer, Published)


def test_a_fast_topic_made_on_first_use_takes_a_run_at_once_and_others_take_the_whole_path():
    """A run of bodies (an NSQ read's PUBs) to a fast topic the registry does not name
    is put on its queues in one call and each body answered with that outcome, before
    ``publish_each`` returns; a registered fast topic takes the whole way (its rate
    limit refuses the second body), as does a reliable one (each answered after its
    commit) and a name not known yet (refused for a producer without NSQ's rule)."""
    h = Harness()
    h.db.create_topic("metered", store="fast", rate_limit=1)
    h.broker.refresh_registry()
    h.settle()
    [made] = publish(h, PublishRequest(topic="clicks2", producer="nsq:p", bodies=[b"first"], create_fast=True))
    assert isinstance(made, Published)
    answers: list[tuple[int, list]] = []
    run = PublishRequest(topic="clicks2", producer="nsq:p", bodies=[b"second", b"third"])
    h.broker.publish_each(run, lambda start, outcomes: answers.append((start, outcomes)))
    [(start, [one, other])] = answers
    assert start == 0 and one is other and one.count == 2 and one.message_id > made.message_id
    topic = h.fast.topics["clicks2"]
    assert [m.body for m in topic.memory] == [b"first", b"second", b"third"]

    def each(name: str) -> dict[int, Any]:
        got: dict[int, Any] = {}
        h.broker.publish_each(PublishRequest(topic=name, producer="p", bodies=[b"x", b"y"]),
                              lambda start, outcomes: got.update(enumerate(outcomes, start)))
        h.settle()
        return got

    metered = each("metered")
    assert isinstance(metered[0], Published) and isinstance(metered[1], RateLimited)
    orders = each("orders")
    assert all(isinstance(orders[i], Published) for i in (0, 1)) and orders[0].message_id != orders[1].message_id
    assert sorted(m.body for m in h.db.messages.values()) == [b"x", b"y"]
    unknown = each("unknown")
    assert all(isinstance(unknown[i], NoTopic) for i in (0, 1)) and "unknown" not in h.fast.topics


def test_one_scanner_times_out_copies_of_both_stores():
    """The broker's scan timer is the only scanner: with it stopped, neither a reliable
    copy nor a fast message comes back after its timeout; with it running, both do."""
    h = Harness()
    reliable = Consumer(credit=1)
    h.subscribe("orders", "billing", reliable)
    fast_channel = h.fast.get_topic("clicks").get_channel("c")
    fast_client = FakeClient(ready=1)
    fast_channel.add_client(fast_client)
    h.send("orders", "p", 1)
    publish(h, PublishRequest(topic="clicks", producer="p", bodies=[b"hit"]))
    h.settle()
    assert len(reliable.pushed) == 1 and len(fast_client.received) == 1
    h.broker.timers.getServiceNamed("scan").stopService()
    h.clock.advance(120)  # past both timeouts (60 s)
    h.settle()
    assert len(reliable.pushed) == 1 and len(fast_client.received) == 1
    h.broker.timers.getServiceNamed("scan").startService()
    h.settle()
    assert len(reliable.pushed) == 2 and len(fast_client.received) == 2
    assert reliable.pushed[0] == reliable.pushed[1]  # the same copy again
    assert fast_client.received[0].id == fast_client.received[1].id


def test_after_a_crash_the_next_incarnation_delivers_exactly_what_was_not_acknowledged():
    """The cursors, counted: two channels acknowledge copies out of order (a random half
    of one, a third of the other, consumers holding many in flight), some acks are
    made durable and a last few are not when the server dies (no drain). A new server
    on the same database (a new incarnation, the old one retired) must deliver every
    copy that was not acknowledged durably (none lost) and none that was (nothing
    delivered again after its ack was confirmed)."""
    import random

    rng = random.Random(15)
    h = Harness()
    first = {"billing": Consumer(credit=80), "audit": Consumer(credit=80)}
    for name, consumer in first.items():
        h.subscribe("orders", name, consumer)
    for i in range(400):
        h.send("orders", "p", i, b"m%d" % i)
    h.settle()
    stored = set(h.acknowledged.values())
    assert len(stored) == 400
    acked: dict[str, set[int]] = {"billing": set(), "audit": set()}
    for rounds in range(4):
        for name, share in (("billing", 0.5), ("audit", 0.33)):
            consumer = first[name]
            held = [mid for ch, mid in consumer.pushed if ch == name and mid not in acked[name]]
            for mid in rng.sample(held, int(len(held) * share)):
                assert h.broker.ack("orders", name, mid, consumer) is None
                acked[name].add(mid)
        h.settle(0.05)
    durable = {name: {row["message_id"] for row in h.db.delivery_log if row["channel"] == name} for name in acked}
    late = set()
    for name, consumer in first.items():  # acks the acker has not made durable when the server dies
        held = [mid for ch, mid in consumer.pushed if ch == name and mid not in acked[name]]
        for mid in held[:5]:
            assert h.broker.ack("orders", name, mid, consumer) is None
            late.add((name, mid))
    assert all(durable[name] for name in durable) and late
    h.broker.timers.stopService()  # kill -9: nothing drains, nothing more is written
    h.broker.reliable.acker.stop()

    roles = {"writer0": h.db, "acker": h.db, "loader": h.db, "admin": h.db}
    again = Broker(Options(), h.clock, roles, NODE, fast=h.fast)
    started = again.start()
    h.settle()
    assert started.called and again.reliable.writes.owner == 2 and h.db.owners[1]["retired"]
    again.timers.startService()
    second = {"billing": Consumer(credit=1000), "audit": Consumer(credit=1000)}
    for name, consumer in second.items():
        again.subscribe("orders", name, consumer)
    h.settle()
    for name, consumer in second.items():
        redelivered = [mid for ch, mid in consumer.pushed if ch == name]
        assert len(redelivered) == len(set(redelivered)), f"{name}: a copy pushed twice"
        lost = stored - durable[name] - {mid for n, mid in late if n == name} - set(redelivered)
        assert not lost, f"{name}: never acknowledged durably and not delivered again: {sorted(lost)}"
        again_after_ack = set(redelivered) & durable[name]
        assert not again_after_ack, f"{name}: delivered again after a durable ack: {sorted(again_after_ack)}"
        assert set(redelivered) == stored - durable[name]  # the late acks were not durable: again
        assert len(stored - acked[name]) > 100  # most were never acknowledged: a real backlog


class SlowAnswers:
    """A database role whose answers arrive ``delay`` seconds late (its statements run at
    once): a group commit that committed but whose answer is still on its way."""

    def __init__(self, db: MemoryDb, clock: Clock, delay: float):
        self.db, self.clock, self.delay = db, clock, delay

    def run_steps(self, steps_fn: Any, *args: Any) -> Any:
        from twisted.internet.defer import Deferred

        late: Deferred = Deferred()
        self.db.run_steps(steps_fn, *args).addBoth(lambda r: self.clock.callLater(self.delay, late.callback, r))
        return late


def test_an_ack_never_lets_the_cursor_pass_a_commit_whose_answer_is_still_coming():
    """Two writers commit out of order: the first batch (lower id) is stored but its
    answer is slow; the second is answered, delivered and acknowledged at once. The
    ack's cursor must stop below the first batch's id (the horizon), or that message
    would count as done and never be delivered."""
    clock = Clock()
    clock.advance(1_700_000_000)
    db = MemoryDb(clock)
    db.create_topic("orders", ["billing"])
    slow = SlowAnswers(db, clock, 5.0)
    roles = {"writer0": db, "writer1": slow, "acker": db, "loader": db, "admin": db}
    broker = Broker(Options(), clock, roles, NODE)
    broker.start()
    consumer = Consumer()
    broker.subscribe("orders", "billing", consumer)
    answers: list[Any] = []
    broker.publish(one_send("orders", "p", b"first", 1), answers.append)  # to writer1 (slow)
    # enough sends at once for a second transaction while the first is in flight
    broker.publish(PublishRequest(topic="orders", producer="q", bodies=[b"second"] * PARALLEL_MIN), answers.append)  # to writer0
    [second] = answers
    first_id = min(db.messages)
    later = [message_id for _, message_id in consumer.pushed]
    assert len(later) == PARALLEL_MIN and min(later) == second.message_id > first_id
    for message_id in later:
        assert broker.ack("orders", "billing", message_id, consumer) is None
    clock.advance(0.05)  # the ack batch is made durable
    cursor = db.cursors[("orders", "billing", broker.reliable.writes.owner)]
    assert not cursor.covers(first_id), "the cursor covered a message whose commit answer had not arrived"
    assert all(cursor.covers(message_id) for message_id in later)
    clock.advance(5)
    assert len(answers) == 2 and consumer.pushed[-1] == ("billing", first_id)  # delivered, not lost
    assert broker.ack("orders", "billing", first_id, consumer) is None
    clock.advance(0.05)
    assert cursor.floor >= max(later)  # all done: the floor passes them



def test_the_stored_depths_reach_the_channels_from_the_depth_count(h):
    """The broker's timers run each store's depth count; a complete pass sets every
    channel's stored count, which /stats' depth starts from."""
    for session in range(3):
        h.send("orders", "p", session)
    h.settle(6.0)  # a period: the next pass has run since the sends
    channels = h.broker.reliable.channels
    assert channels[("orders", "billing")].stored_count == 3 and channels[("orders", "audit")].stored_count == 3
    assert h.broker.reliable.depths.passes >= 2
    assert "depth-count" in {t.name for t in h.broker.timers.getServiceNamed("store-main")}


def test_the_retention_sweep_goes_on_while_its_batches_come_back_full_pausing_after_each(monkeypatch):
    """A backlog of old, fully acknowledged messages goes in one pass of batches: the next
    batch starts three times the last batch's duration after it ended (SWEEP_DUTY), the
    pass stops at a batch that is not full, a timer firing meanwhile starts no second pass,
    and the store's stop cancels a batch that is waiting."""
    monkeypatch.setattr(reliable_store, "SWEEP_BATCH", 10)
    h = Harness(db_delay=0.01, message_retention=60.0, sweep_interval=3600.0)
    store = h.broker.reliable
    billing, audit = Consumer(), Consumer()
    h.subscribe("orders", "billing", billing)
    h.subscribe("orders", "audit", audit)
    for n in range(25):
        h.send("orders", "p", n)
    h.settle()
    h.ack_all("orders", billing)
    h.ack_all("orders", audit)
    h.settle(61)  # past the retention, the acks durable
    assert len(h.db.messages) == 25

    started = h.clock.seconds()
    store.sweep()
    done: list[tuple[float, int]] = []  # (when, swept so far), at each change
    for _ in range(2000):
        h.clock.advance(0.001)
        if store.swept_count != (done[-1][1] if done else 0):
            done.append((h.clock.seconds(), store.swept_count))
            if len(done) == 1:  # the timer fires during the pause: no second pass
                waiting = store._sweep.call
                assert waiting is not None and store.sweep().called and store._sweep.call is waiting
    assert [count for _, count in done] == [10, 20, 25] and not h.db.messages
    first = (done[0][0] - started) / 2  # the pass's plan, then its first batch: a round each
    assert first > 0
    for (before, _), (after, _) in zip(done, done[1:]):  # a pause of 3x the batch, then a batch
        assert 4 * first - 0.003 <= after - before <= 4 * first + 0.003
    assert store._sweep.call is None  # the pass ended at the batch of 5

    # a pass cut short by the store's stop
    billing.pushed.clear()
    audit.pushed.clear()
    for n in range(25, 45):
        h.send("orders", "p", n)
    h.settle()
    h.ack_all("orders", billing)
    h.ack_all("orders", audit)
    h.settle(61)
    store.sweep()
    h.settle(2 * first + 0.002)
    assert store.swept_count == 35 and store._sweep.call is not None
    store.stop()
    h.settle(1)
    assert store.swept_count == 35 and store._sweep.call is None


def _hide_channel(h: Harness, monkeypatch: Any, name: str) -> Any:
    """The database's next answers as from a snapshot taken before ``name``'s registration
    committed (its start_id is already taken); returns the real answer to put back."""
    real = h.db._topic_rows

    def unseen(topics: list[str]) -> list[tuple]:
        return [r for r in real(topics) if r[5] != name]

    monkeypatch.setattr(h.db, "_topic_rows", unseen)
    return real


def _send_and_ack(h: Harness, sessions: range, consumers: list[Consumer], acked: set) -> None:
    """Sends, each committed alone, and every copy pushed acknowledged as it comes: the
    channels' cursors move."""
    for i in sessions:
        h.send("orders", "p", i)
        h.settle()
        for consumer in consumers:
            for channel, message_id in consumer.pushed:
                if (channel, message_id) not in acked:
                    acked.add((channel, message_id))
                    assert h.broker.ack("orders", channel, message_id, consumer) is None
        h.settle()


@pytest.mark.parametrize("opened", ["before", "after"])
def test_a_channel_registered_during_a_commit_reads_the_copies_its_answer_missed(monkeypatch, opened):
    """A channel's registration commits while a batch is being stored: its start_id is
    below the batch's ids, so the copies are its own, but the statement's snapshot did
    not see it and the answer names only the other channels. The channel has loaded
    (nothing to find; opened before that answer, or after it but before its registration
    was visible), so no load would see them, and acks of later copies would move its
    cursor past them (lost). The next answer that names it makes it read the store."""
    h = Harness()
    billing, late = Consumer(), Consumer()
    h.subscribe("orders", "billing", billing)
    h.db.add_channel("orders", "late")
    real = _hide_channel(h, monkeypatch, "late")
    if opened == "before":
        h.subscribe("orders", "late", late)  # its first load: nothing stored yet
    h.send("orders", "p", 1)
    h.settle()
    first = h.acknowledged[("p", 1)]
    assert first > h.db.start_ids[("orders", "late")]  # the copy is the late channel's
    if opened == "after":
        h.db.channels["orders"].discard("late")  # its load too sees no registration yet
        h.subscribe("orders", "late", late)
        h.db.channels["orders"].add("late")
    assert ("late", first) not in late.pushed  # nothing handed it over
    monkeypatch.setattr(h.db, "_topic_rows", real)
    acked: set[tuple[str, int]] = set()
    _send_and_ack(h, range(2, 6), [billing, late], acked)
    h.settle(2.0)
    h.assert_none_lost("orders", {"billing": billing, "late": late})
    assert Counter(late.pushed)[("late", first)] == 1
    assert not [k for k in h.db.deliveries if k[1] == "late"], "every copy of the late channel acked"


def test_a_channel_registered_during_a_delay_move_reads_the_copy_its_answer_missed():
    """As a group commit, a delayed send's move names the channels registered in its
    snapshot: one whose registration commits during the move owns the moved message
    (its start_id is lower) without being named. The move's answer makes it
    unconfirmed, and the next answer that names it has it read the store; with the move
    not counted, the channel stays confirmed, never sees the copy, and acks of later
    copies move its cursor past it."""
    from dmq_server.db.delays import MovedMessage

    h = Harness()
    billing, late = Consumer(), Consumer()
    h.subscribe("orders", "billing", billing)
    h.db.add_channel("orders", "late")
    h.subscribe("orders", "late", late)
    acked: set[tuple[str, int]] = set()
    _send_and_ack(h, range(1, 3), [billing, late], acked)  # answers name both: both confirmed
    # the move stores a message (as move_due does) in a snapshot without late's registration
    owner = h.broker.reliable.writes.owner
    moved_id = h.db.store_moved("orders", "delayer", 1, b"d", owner)
    assert moved_id > h.db.start_ids[("orders", "late")]
    h.broker.reliable.deliver_moved([MovedMessage(moved_id, "orders", "delayer", 1, 0, ("billing",), 0, b"d", owner)])
    h.settle()
    assert ("late", moved_id) not in late.pushed  # the answer did not hand it over
    _send_and_ack(h, range(3, 7), [billing, late], acked)
    h.settle(2.0)
    h.assert_none_lost("orders", {"billing": billing, "late": late})
    assert Counter(late.pushed)[("late", moved_id)] == 1
    assert not [k for k in h.db.deliveries if k[1] == "late"], "every copy of the late channel acked"


def test_channels_named_by_every_answer_are_not_read_again(monkeypatch):
    """Nothing is read again while the group commit's answers name every channel in
    memory (a load without ZooKeeper reads every owner's copies: nodes sharing a database
    would deliver each other's twice), also after a replayed dead letter was moved to
    one channel only (a delay move names only that one)."""
    from dmq_server.db.delays import MovedMessage

    h = Harness()
    billing, audit = Consumer(), Consumer()
    h.subscribe("orders", "billing", billing)
    h.subscribe("orders", "audit", audit)
    loads: list[str] = []
    for channel in h.broker.reliable.channels.values():
        real_load = channel._load
        monkeypatch.setattr(channel, "_load", lambda ch, after, limit, real_load=real_load: (
            loads.append(ch.name), real_load(ch, after, limit)))
    acked: set[tuple[str, int]] = set()
    _send_and_ack(h, range(1, 4), [billing, audit], acked)
    h.broker.reliable.deliver_moved([MovedMessage(10_000, "orders", "replayer", 1, 0, ("audit",), 0, b"r", 0, "audit")])
    assert ("audit", 10_000) in audit.pushed
    acked.add(("audit", 10_000))  # not stored: never acked
    _send_and_ack(h, range(4, 7), [billing, audit], acked)
    assert loads == []
    h.assert_none_lost("orders", {"billing": billing, "audit": audit})
