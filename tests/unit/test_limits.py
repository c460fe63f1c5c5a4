"""Rate limits (token buckets on an injected clock) and the channel's attempt limit and
expiry drop, without IO."""

from __future__ import annotations

import pytest
from twisted.internet.task import Clock

from dmq_server.reliable.channel import ReliableChannel, Delivery, ReliableMessage
from dmq_server.core.limits import RateLimiter, TokenBucket


def test_bucket_allows_a_burst_of_one_second_then_refills_at_the_rate():
    """Rate 5/s: five at once, the sixth refused, one more after 0.2 s."""
    clock = Clock()
    limiter = RateLimiter(clock)
    assert [limiter.allow("t", 5) for _ in range(6)] == [True] * 5 + [False]
    clock.advance(0.19)
    assert not limiter.allow("t", 5)
    clock.advance(0.01)
    assert limiter.allow("t", 5)
    assert limiter.refused == 2


def test_bucket_never_holds_more_than_its_burst():
    """A long quiet spell refills to the burst, not beyond."""
    clock = Clock()
    limiter = RateLimiter(clock)
    limiter.allow("t", 3)
    clock.advance(3600)
    assert [limiter.allow("t", 3) for _ in range(4)] == [True, True, True, False]


def test_topics_have_separate_buckets_and_no_limit_means_no_bucket():
    """One topic's traffic does not use another's tokens; None or 0 means unlimited."""
    clock = Clock()
    limiter = RateLimiter(clock)
    assert all(limiter.allow("a", 1) for _ in range(1)) and not limiter.allow("a", 1)
    assert limiter.allow("b", 1)
    assert all(limiter.allow("free", None) for _ in range(1000))


def test_a_changed_limit_starts_a_new_bucket_and_forget_drops_old_ones():
    """A registry refresh that changes the limit takes effect at once; buckets of topics no
    longer limited are dropped."""
    clock = Clock()
    limiter = RateLimiter(clock)
    assert limiter.allow("t", 1) and not limiter.allow("t", 1)
    assert limiter.allow("t", 10)  # new limit, new full bucket
    limiter.forget(set())
    assert limiter._buckets == {}


def test_bucket_rejects_a_non_positive_rate():
    """A rate of 0 is a programming error, reported as such."""
    with pytest.raises(ValueError, match="rate must be positive"):
        TokenBucket(0, 1, 0.0)


class Consumer:
    def __init__(self, credit: int = 10):
        self.credit = credit
        self.in_flight = 0
        self.pushed: list[tuple[int, int]] = []

    def push_many(self, channel, deliveries):
        self.pushed += [(d.message.message_id, d.attempts) for d in deliveries]


def make_channel(clock: Clock, **kw) -> tuple[ReliableChannel, list, list, list]:
    attempts: list = []
    exhausted: list = []
    acks: list = []
    channel = ReliableChannel(
        "t",
        "c",
        clock=clock,
        msg_timeout=1.0,
        mem_queue_size=100,
        load=lambda ch, after, limit: ch.loaded([], limit),
        on_acks=lambda ch, ds, ms, who: acks.extend(d.message.message_id for d in ds),
        on_attempt=lambda ch, d: attempts.append((d.message.message_id, d.attempts)),
        on_exhausted=lambda ch, d: exhausted.append((d.message.message_id, d.attempts)),
        **kw,
    )
    return channel, attempts, exhausted, acks


def msg(i: int) -> ReliableMessage:
    return ReliableMessage(i, "t", "p", i, 0, b"x")


def test_copy_is_exhausted_after_max_attempts_instead_of_pushed_again():
    """max_attempts 2: pushed twice; after the second timeout it goes to on_exhausted, is
    not pushed a third time, and is forgotten once its dead letter is durable."""
    clock = Clock()
    channel, attempts, exhausted, _ = make_channel(clock, max_attempts=2)
    consumer = Consumer()
    channel.subscribe(consumer)
    channel.add(msg(1))
    clock.advance(1.0)
    channel.scan(clock.seconds())
    clock.advance(1.0)
    channel.scan(clock.seconds())
    assert consumer.pushed == [(1, 1), (1, 2)]
    assert exhausted == [(1, 2)] and channel.exhausted_count == 1
    assert attempts == [(1, 1), (1, 2)]  # recorded because the topic has a limit
    assert 1 in channel.known  # until the dead letter commits
    channel.ack_durable([1])
    assert 1 not in channel.known and not channel.ready and not channel.in_flight


def test_without_max_attempts_only_redeliveries_are_recorded():
    """Unlimited topics cost no attempt write on a first delivery, only on redeliveries."""
    clock = Clock()
    channel, attempts, exhausted, _ = make_channel(clock)
    consumer = Consumer()
    channel.subscribe(consumer)
    channel.add(msg(1))
    clock.advance(1.0)
    channel.scan(clock.seconds())
    assert attempts == [(1, 2)] and exhausted == []


def test_loaded_copy_with_used_up_attempts_is_exhausted_at_once():
    """A copy loaded with attempts at the limit (counted before a restart) is not pushed."""
    clock = Clock()
    channel, _, exhausted, _ = make_channel(clock, max_attempts=3)
    consumer = Consumer()
    channel.subscribe(consumer)

    class Row:
        message_id, producer, session_id, published_ms, body, attempts = 5, "p", 5, 0, b"x", 3

    channel.loading = True
    channel.loaded([Row()], 10)
    assert consumer.pushed == [] and exhausted == [(5, 3)]


def test_drop_forgets_ready_and_in_flight_copies_and_frees_credit():
    """Expired copies leave memory: out of ready and in flight, credit back to the consumer,
    and the next ready copy is pushed."""
    clock = Clock()
    channel, _, _, acks = make_channel(clock)
    consumer = Consumer(credit=1)
    channel.subscribe(consumer)
    for i in (1, 2, 3):
        channel.add(msg(i))
    assert consumer.pushed == [(1, 1)] and consumer.in_flight == 1
    assert channel.drop([1, 2, 99]) == 2
    assert consumer.pushed == [(1, 1), (3, 1)] and consumer.in_flight == 1
    assert not channel.ack(1)  # gone: an ack of the dropped copy is ignored
    assert acks == []


def test_drop_during_a_load_keeps_the_loaded_copy_out():
    """A load whose snapshot predates the expiry must not bring the expired copy back."""
    clock = Clock()
    loads: list = []
    channel = ReliableChannel(
        "t", "c", clock=clock, msg_timeout=1.0, mem_queue_size=100,
        load=lambda ch, after, limit: loads.append(limit), on_acks=lambda ch, ds, ms, who: None,
    )
    consumer = Consumer()
    channel.subscribe(consumer)  # starts a load
    assert channel.loading and loads

    class Row:
        def __init__(self, i):
            self.message_id, self.producer, self.session_id = i, "p", i
            self.published_ms, self.body, self.attempts = 0, b"x", 0

    channel.drop([7])
    channel.loaded([Row(7), Row(8)], loads[0])
    assert consumer.pushed == [(8, 1)] and 7 not in channel.known
