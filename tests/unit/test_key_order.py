"""The ordering rule of an ordered topic's channel (``reliable.key_order``), on the channel
itself: no IO, a test clock, consumers that record what they were pushed.

What must hold, per channel: at most one copy of a key out at a time (pushed and not yet
acknowledged or dead-lettered; a copy that came back keeps the key until it goes out
again), a key's first deliveries in id order, other keys flowing while one waits, and
nothing lost. The property test at the end drives random interleavings of arrivals,
acks, timeouts, requeues and consumers leaving, and checks all of it after each step.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock

from dmq_server.db.messages import BacklogRow
from dmq_server.reliable.channel import Delivery, ReliableChannel, ReliableMessage
from dmq_server.reliable.key_order import KeyGate

pytestmark = pytest.mark.unit

TIMEOUT = 10.0


class Consumer:
    def __init__(self, credit: int = 100):
        self.credit = credit
        self.in_flight = 0
        self.pushed: list[tuple[int, int]] = []  # (message id, attempts)

    def push_many(self, channel: ReliableChannel, deliveries: list[Delivery]) -> None:
        self.pushed += [(d.message.message_id, d.attempts) for d in deliveries]

    @property
    def ids(self) -> list[int]:
        return [mid for mid, _ in self.pushed]


@dataclass
class Ordered:
    """An ordered topic's channel with a test clock; messages by id, with their keys."""

    mem_queue_size: int = 100
    max_attempts: int | None = None
    clock: Clock = field(default_factory=Clock)
    keys: dict[int, str | None] = field(default_factory=dict)
    dead: list[int] = field(default_factory=list)
    channel: ReliableChannel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = ReliableChannel(
            "orders", "billing", clock=self.clock, msg_timeout=TIMEOUT, mem_queue_size=self.mem_queue_size,
            load=lambda channel, after, limit: None, on_acks=lambda *a: None, max_attempts=self.max_attempts,
            on_exhausted=lambda channel, delivery: self.dead.append(delivery.message.message_id), ordered=True,
        )
        self.channel.backlog = False  # nothing stored before: copies stay in memory

    def add(self, mid: int, key: str | None) -> None:
        self.keys[mid] = key
        self.channel.add(ReliableMessage(mid, "orders", "p", mid, 0, b"x", key=key))

    def ack(self, consumer: Consumer, *ids: int) -> None:
        assert self.channel.ack_held(ids, consumer) == 0


def subscribed(**settings: int) -> tuple[Ordered, Consumer]:
    """An ordered channel with one consumer of ample credit."""
    h = Ordered(**settings)
    c = Consumer()
    h.channel.subscribe(c)
    return h, c


def test_one_copy_of_a_key_at_a_time_and_the_next_after_the_ack():
    h, c = subscribed()
    for mid, key in [(1, "a"), (2, "a"), (3, "b"), (4, "a"), (5, "b")]:
        h.add(mid, key)
    assert c.ids == [1, 3]  # 2, 4, 5 wait behind their keys; other keys flow
    assert h.channel.parked == 3 and h.channel.stats()["parked_count"] == 3
    assert h.channel.locate(2) == {"state": "waiting_for_key", "key": "a", "holder": 1}
    h.ack(c, 3)
    assert c.ids == [1, 3, 5]
    h.ack(c, 1)
    assert c.ids == [1, 3, 5, 2]
    h.ack(c, 2)
    assert c.ids == [1, 3, 5, 2, 4] and h.channel.parked == 0


def test_a_message_without_a_key_is_its_own_key():
    h, c = subscribed()
    for mid in (1, 2, 3):
        h.add(mid, None)
    assert c.ids == [1, 2, 3]  # nothing held, nothing waits


def test_a_redelivery_keeps_its_place_at_the_head_of_its_key():
    """A copy that times out goes out again before the next of its key, which waits
    through the redelivery; the next goes only after the redelivered copy's ack."""
    h, c = subscribed()
    h.add(1, "a")
    h.add(2, "a")
    h.clock.advance(TIMEOUT + 1)
    assert h.channel.scan(h.clock.seconds()) == 1
    assert c.pushed == [(1, 1), (1, 2)]  # 2 never went out while 1 came back
    h.ack(c, 1)
    assert c.pushed[-1] == (2, 1)


def test_a_requeue_with_a_delay_holds_the_key_until_it_is_due_and_acked():
    h, c = subscribed()
    h.add(1, "a")
    h.add(2, "a")
    h.add(3, "b")
    assert h.channel.requeue(1, c, delay=5.0) is None
    assert c.ids == [1, 3]  # 2 waits: 1 is deferred, still holding "a"
    h.clock.advance(6)
    h.channel.scan(h.clock.seconds())
    assert c.ids == [1, 3, 1]
    h.ack(c, 1)
    assert c.ids == [1, 3, 1, 2]


def test_a_consumer_that_leaves_gives_its_copies_back_in_key_order():
    h = Ordered()
    first, second = Consumer(credit=1), Consumer(credit=5)
    h.channel.subscribe(first)
    h.add(1, "a")
    h.add(2, "a")
    assert first.ids == [1]
    h.channel.subscribe(second)
    assert second.ids == []  # "a" is out with the first consumer
    h.channel.unsubscribe(first)
    assert second.ids == [1]  # the head of "a" again, then nothing of "a" until its ack
    h.ack(second, 1)
    assert second.ids == [1, 2]


def test_a_dead_letter_frees_the_key():
    h, c = subscribed(max_attempts=1)
    h.add(1, "a")
    h.add(2, "a")
    h.clock.advance(TIMEOUT + 1)
    h.channel.scan(h.clock.seconds())  # back after its one attempt: a dead letter now
    assert h.dead == [1]
    assert c.ids == [1, 2]


def test_a_dropped_copy_frees_its_key_and_a_dropped_waiting_one_goes():
    h, c = subscribed()
    for mid in (1, 2, 3):
        h.add(mid, "a")
    assert h.channel.drop({1, 2}) == 2  # expired into dead letters: 1 was out, 2 waited
    assert c.ids == [1, 3] and h.channel.parked == 0
    assert h.channel.ready_bytes == 0  # 3 went out: nothing counted as waiting


def test_parked_copies_count_in_the_window():
    """Copies parked behind a key are held in memory: the window counts them, so a load
    is not asked for rows that would not fit."""
    h, c = subscribed(mem_queue_size=4)
    for mid in range(1, 6):
        h.add(mid, "a")
    assert c.ids == [1] and h.channel.parked == 4 and not h.channel.backlog
    h.add(6, "a")  # a fifth waiting copy would pass the window of 4: left to a later load
    assert h.channel.parked == 4 and h.channel.backlog
    assert h.channel.ready_bytes == 4  # the parked bodies stay counted


def test_turning_the_setting_off_lets_the_parked_copies_go_and_on_holds_the_keys_out():
    h, c = subscribed()
    for mid in (1, 2, 3):
        h.add(mid, "a")
    h.channel.set_ordered(False)
    assert c.ids == [1, 2, 3] and h.channel.parked == 0
    h.channel.set_ordered(True)  # 1, 2, 3 are out: "a" is held by the first of them
    h.add(4, "a")
    assert c.ids == [1, 2, 3]
    h.ack(c, 2, 3)
    assert c.ids == [1, 2, 3]
    h.ack(c, 1)
    assert c.ids == [1, 2, 3, 4]


def test_forget_drops_the_parked_copies_with_the_rest():
    h, c = subscribed()
    h.add(1, "a")
    h.add(2, "a")
    h.channel.forget()
    assert h.channel.parked == 0 and not h.channel.ready and h.channel.ready_bytes == 0
    assert h.channel.keys is not None and not h.channel.keys.holders


# -- a hot key: read apart -----------------------------------------------------------------


@dataclass
class Stored:
    """An ordered channel over a model of PostgreSQL: its loads and key reads answered from
    ``rows`` (id -> key), skipping what was acknowledged."""

    mem_queue_size: int = 32  # a key with 2 copies parked is read apart (32 // 16)
    clock: Clock = field(default_factory=Clock)
    rows: dict[int, str | None] = field(default_factory=dict)
    acked: set[int] = field(default_factory=set)
    requests: list[tuple] = field(default_factory=list)
    channel: ReliableChannel = field(init=False)

    def __post_init__(self) -> None:
        self.channel = ReliableChannel(
            "orders", "billing", clock=self.clock, msg_timeout=TIMEOUT, mem_queue_size=self.mem_queue_size,
            load=lambda channel, after, limit: self.requests.append(("load", after, limit, set(channel.cursor.skipped))),
            load_key=lambda channel, key, after, limit: self.requests.append(("key", after, limit, key)),
            on_acks=lambda channel, deliveries, *a: self.acked.update(d.message.message_id for d in deliveries),
            ordered=True,
        )

    def row(self, mid: int) -> BacklogRow:
        return BacklogRow(mid, "p", mid, 0, b"x", 0, 0, "", self.rows[mid])

    def answer(self) -> str:
        kind, after, limit, arg = self.requests.pop(0)
        waiting = sorted(m for m in self.rows if m > after and m not in self.acked)
        if kind == "load":
            rows = [m for m in waiting if self.rows[m] is None or self.rows[m] not in arg][:limit]
            self.channel.loaded([self.row(m) for m in rows], limit)
        else:
            rows = [m for m in waiting if self.rows[m] == arg][:limit]
            self.channel.loaded_key([self.row(m) for m in rows], limit, arg)
        return kind


def test_a_hot_key_is_read_apart_and_the_other_keys_flow():
    """40 copies of "hot" stored before 8 of other keys, a window of 32: the hot key keeps
    one out and one parked, the rest of it waits in PostgreSQL, and the other keys' copies
    come in and go out past it; the hot key's copies then go out one at a time, in order."""
    h = Stored()
    h.rows = {mid: "hot" for mid in range(1, 41)} | {mid: f"k{mid}" for mid in range(41, 49)}
    c = Consumer(credit=100)
    h.channel.subscribe(c)
    assert h.answer() == "load"  # 1..32: the window's worth
    assert c.ids == [1]  # the hot key's first; the others of it were set aside but one
    assert h.channel.cursor.skipped == {"hot": 3} and h.channel.parked == 1
    assert h.channel.stats()["keys_read_apart"] == 1
    assert h.requests[0][0] == "load" and h.requests[0][3] == {"hot"}
    assert h.answer() == "load"  # past the hot key: the other keys' copies
    assert c.ids == [1] + list(range(41, 49))
    assert h.channel.ack_held(list(range(41, 49)), c) == 0
    for expected in range(2, 41):
        assert h.channel.ack_held([expected - 1], c) == 0  # the hot key's copy out
        while h.requests:
            h.answer()
        assert c.ids[-1] == expected, f"the hot key's {expected} next, got {c.ids[-9:]}"
        assert h.channel.parked <= 1 and len(h.channel.known - h.acked) <= 2  # never more of it in memory
    assert h.channel.cursor.skipped == {}
    hot = [mid for mid in c.ids if h.rows[mid] == "hot"]
    assert hot == list(range(1, 41))


def test_a_copy_of_a_key_read_apart_waits_for_its_read():
    """A copy committed while its key is read apart is not held in memory (it would pass
    the older ones in PostgreSQL): the key's read brings it, after them."""
    h = Stored()
    h.rows = {mid: "hot" for mid in range(1, 6)}
    c = Consumer(credit=100)
    h.channel.subscribe(c)
    h.answer()
    assert h.channel.cursor.skipped == {"hot": 3}
    h.rows[6] = "hot"
    h.channel.add(ReliableMessage(6, "orders", "p", 6, 0, b"x", key="hot"))
    assert 6 not in h.channel.known
    for _ in range(5):
        assert h.channel.ack_held([c.ids[-1]], c) == 0
        while h.requests:
            h.answer()
    assert c.ids == [1, 2, 3, 4, 5, 6]


def test_the_proposal_stays_below_a_key_read_apart():
    h = Stored()
    h.rows = {1: "hot", 2: "hot", 3: "hot", 4: "hot", 5: "other"}
    c = Consumer(credit=100)
    h.channel.subscribe(c)
    h.answer()  # 1 out, 2 parked, 3 and 4 stored: read apart from 3
    assert c.ids == [1, 5]
    assert h.channel.ack_held([5, 1], c) == 0 and c.ids == [1, 5, 2]
    assert h.channel.ack_held([2], c) == 0  # 3 and 4 are all the hot key has left, stored
    assert h.channel.cursor.position == 5
    floor, spans = h.channel.progress(0, [5, 1, 2], 10**9)
    assert floor == 2 and spans == [(5, 5)]  # not past 3: it waits for its key's read


def test_turning_the_setting_off_reads_a_key_read_apart_with_the_rest():
    h = Stored()
    h.rows = {mid: "hot" for mid in range(1, 6)}
    c = Consumer(credit=100)
    h.channel.subscribe(c)
    h.answer()
    h.channel.set_ordered(False)
    assert h.channel.cursor.skipped == {} and h.channel.cursor.position == 2
    while h.requests:
        h.answer()
    assert sorted(c.ids) == [1, 2, 3, 4, 5]


def test_the_gate_alone():
    gate: KeyGate = KeyGate()

    @dataclass
    class M:
        message_id: int
        key: str | None

    @dataclass
    class C:
        message: M

    one, two, three = C(M(1, "k")), C(M(2, "k")), C(M(3, "k"))
    assert gate.admit(one) and not gate.admit(two) and not gate.admit(three)
    assert gate.admit(one)  # its own key: a redelivery
    assert gate.release(two) is None  # not the holder: nothing changes
    assert gate.release(one) is two and gate.parked_count == 1
    assert gate.admit(two)
    assert gate.discard({2}) == [three] and gate.parked_count == 0 and not gate.holders


# -- the property -------------------------------------------------------------------------

KEYS = ["a", "b", "c", None]

step = st.one_of(
    st.tuples(st.just("add"), st.sampled_from(KEYS)),
    st.tuples(st.just("ack"), st.integers(0, 1), st.integers(0, 10)),
    st.tuples(st.just("timeout"), st.just(0), st.just(0)),
    st.tuples(st.just("requeue"), st.integers(0, 1), st.integers(0, 10)),
    st.tuples(st.just("leave"), st.integers(0, 1)),
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(step, max_size=60))
def test_any_interleaving_keeps_one_copy_of_a_key_out_in_id_order_and_loses_nothing(steps):
    h = Ordered(mem_queue_size=1000)
    consumers = [Consumer(credit=3), Consumer(credit=2)]
    for c in consumers:
        h.channel.subscribe(c)
    acked: set[int] = set()
    first: dict[str, list[int]] = {}  # per key, first deliveries in order
    next_id = 1

    def out() -> dict[int, Delivery]:
        return h.channel.in_flight

    def check() -> None:
        holders: dict[str, int] = {}
        for mid, delivery in out().items():
            key = h.keys[mid]
            if key is not None:
                assert key not in holders, f"two copies of {key!r} out: {holders[key]} and {mid}"
                holders[key] = mid
        for c in consumers:
            for mid, attempts in c.pushed:
                key = h.keys[mid]
                if key is not None and attempts == 1 and mid not in first.setdefault(key, []):
                    first[key].append(mid)
        for key, ids in first.items():
            assert ids == sorted(ids), f"key {key!r} first delivered out of id order: {ids}"

    for op in steps:
        if op[0] == "add":
            h.add(next_id, op[1])
            next_id += 1
        elif op[0] == "ack":
            c = consumers[op[1]]
            mine = sorted(mid for mid, d in out().items() if d.consumer is c)
            if mine:
                mid = mine[op[2] % len(mine)]
                h.ack(c, mid)
                acked.add(mid)
        elif op[0] == "timeout":
            h.clock.advance(TIMEOUT + 1)
            h.channel.scan(h.clock.seconds())
        elif op[0] == "requeue":
            c = consumers[op[1]]
            mine = sorted(mid for mid, d in out().items() if d.consumer is c)
            if mine:
                h.channel.requeue(mine[op[2] % len(mine)], c)
        elif op[0] == "leave":
            c = consumers[op[1]]
            h.channel.unsubscribe(c)
            h.channel.subscribe(c)
        check()
    # drain: ack whatever goes out until nothing is left
    for _ in range(10 * next_id + 10):
        pending = [(mid, d.consumer) for mid, d in out().items() if d.consumer is not None]
        if not pending:
            break
        for mid, consumer in pending:
            h.ack(consumer, mid)
            acked.add(mid)
            check()
    assert acked == set(range(1, next_id)), "a message was never delivered"
    assert h.channel.parked == 0 and not h.channel.ready
