"""The cursor a channel proposes (``ReliableChannel.progress``) and the horizon that bounds
it (``reliable.horizon.OwnWrites``): unit tests, and a property test that counts.

The property test plays the server's threads against each other: a message id sequence
shared with other topics (gaps), group commits that draw ids when they run and commit
out of order, a channel with a small memory window that loads its backlog from the
"database" in id order, consumers that acknowledge in random order, and durable ack
batches whose proposals are merged into a model cursor as the SQL does (a floor only
rises, spans only add). After every step it checks the two promises the cursor keeps:
no stored copy that was not acknowledged is ever covered (it would never be delivered:
lost), and every acknowledgement made durable is covered (after a crash it is not
delivered again); and at the end, that every acknowledgement was logged exactly once
(an ack whose copy a batch covered before its own batch ran would never be logged).
Played again with priorities (issue 45 §3): copies of random priority, a read-ahead of
the priorities beside the loads, higher priorities setting lower copies aside from the
full window; the same promises, and no push passing a copy of a higher priority that
waits in memory. And on an ordered topic's channel (issue 45 §2), with keys, commits in
order, and a window small enough that a key with many copies waiting is read apart
(``ChannelCursor.skipped``): the same promises, one copy of a key out at a time, and each
key's first deliveries in id order. And on that channel as its topic's orderer in a cluster
(45-nodes-design §4b): a second node stores copies of the topic too (another owner, its
commits serialised with this node's, never handed to this channel: read by loads and the
poll), so its copies are committed below ids this node's arrivals bring; the same
promises, for both owners' cursors.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from twisted.internet.task import Clock

from dmq_server.db.messages import BacklogRow
from dmq_server.reliable.channel import Delivery, ReliableChannel, ReliableMessage
from dmq_server.reliable.horizon import OwnWrites

OWNER = 7
OTHER = 8  # another node's incarnation (the cluster mode of the property test)


class Consumer:
    def __init__(self, credit: int = 1000):
        self.credit = credit
        self.in_flight = 0
        self.held: list[int] = []

    def push_many(self, channel: ReliableChannel, deliveries: list[Delivery]) -> None:
        self.held += [d.message.message_id for d in deliveries]


def message(mid: int, owner: int = OWNER, priority: int = 0, key: str | None = None) -> ReliableMessage:
    return ReliableMessage(mid, "orders", "p", mid, 0, b"x", owner, priority=priority, key=key)


class PriorityConsumer(Consumer):
    """A consumer that checks each push against what waits in memory: no copy pushed while
    one of a higher priority waits."""

    def __init__(self, credit: int, violations: list[str], firsts: dict[str, list[int]], durable: set[int]):
        super().__init__(credit)
        self.violations = violations
        self.firsts = firsts  # per key, first deliveries in order (every consumer's)
        self.durable = durable  # copies whose ack is durable: never pushed again

    def push_many(self, channel: ReliableChannel, deliveries: list[Delivery]) -> None:
        super().push_many(channel, deliveries)
        again = [d.message.message_id for d in deliveries if d.message.message_id in self.durable]
        if again:
            self.violations.append(f"pushed again after their durable ack: {again}")
        if channel.keys is not None:  # an ordered topic: a key's order, not priority
            self.check_keys(channel, deliveries)
            return
        lowest = min(d.message.priority for d in deliveries)
        waiting = max((d.message.priority for d in channel._waiting_copies()), default=0)
        if waiting > lowest:
            self.violations.append(f"pushed priority {lowest} while {waiting} waited")

    def check_keys(self, channel: ReliableChannel, deliveries: list[Delivery]) -> None:
        """One copy of a key out at a time; a key's first deliveries in id order."""
        out: dict[str, int] = {}
        for mid, delivery in channel.in_flight.items():
            key = delivery.message.key
            if key is not None and delivery.consumer is not None or mid in channel.deferred:
                if key in out:
                    self.violations.append(f"two copies of {key!r} out: {out[key]} and {mid}")
                if key is not None:
                    out[key] = mid
        for delivery in deliveries:
            key, mid = delivery.message.key, delivery.message.message_id
            firsts = self.firsts.setdefault(key or "", [])
            if key is not None and mid not in firsts:
                if firsts and firsts[-1] > mid:
                    self.violations.append(f"key {key!r}: {mid} first delivered after {firsts[-1]}")
                firsts.append(mid)


def channel_with(*ids: int, credit: int = 1000, mem: int = 100) -> tuple[ReliableChannel, Consumer, list]:
    acks: list[int] = []
    ch = ReliableChannel(
        "orders", "billing", clock=Clock(), msg_timeout=30.0, mem_queue_size=mem,
        load=lambda c, after, limit: None,
        on_acks=lambda c, ds, ms, who: acks.extend(d.message.message_id for d in ds),
    )
    consumer = Consumer(credit)
    ch.subscribe(consumer)
    ch.loaded([], 100)  # nothing stored yet
    for mid in ids:
        ch.add(message(mid))
    return ch, consumer, acks


# -- OwnWrites -----------------------------------------------------------------------


def test_the_horizon_is_the_lowest_bound_of_the_writes_in_progress():
    writes = OwnWrites(OWNER)
    assert writes.horizon() == math.inf and writes.limit(OWNER) == math.inf
    first = writes.begin()  # nothing seen yet: its ids are above 0
    writes.seen(10)
    second = writes.begin()  # its ids are above 10
    assert writes.horizon() == 0
    writes.end(first)
    assert writes.horizon() == 10
    writes.end(second)
    assert writes.horizon() == math.inf


def test_a_write_whose_answer_was_lost_is_open_until_its_backend_is_gone():
    writes = OwnWrites(OWNER)
    writes.seen(5)
    token = writes.begin()
    writes.hold(token, 4242)
    assert writes.horizon() == 5 and writes.held_pids() == {4242}
    assert not writes.release({17})  # another backend ended
    assert writes.horizon() == 5
    assert writes.release({4242})
    assert writes.horizon() == math.inf and not writes.held_pids()
    # no backend: the statement never reached PostgreSQL, settled at once
    writes.hold(writes.begin(), None)
    assert writes.horizon() == math.inf


def test_other_owners_are_settled_only_once_retired():
    writes = OwnWrites(OWNER)
    assert writes.limit(3) is None
    writes.retired.add(3)
    assert writes.limit(3) == math.inf


# -- progress ------------------------------------------------------------------------


def test_in_order_acks_move_the_floor_and_need_no_spans():
    ch, consumer, acks = channel_with(10, 11, 12, 13)
    for mid in (10, 11):
        assert ch.ack(mid)
    assert ch.progress(OWNER, [10, 11], math.inf) == (11, [])  # 12 and 13 are in flight


def test_ids_of_other_topics_between_the_copies_are_covered():
    ch, consumer, acks = channel_with(10, 20, 30, 40)  # 11..19 and so on: other topics
    assert ch.ack(10) and ch.ack(30)
    # 20 is in flight: the floor stops below it; 30's span reaches from 21 to 39 (40 is in flight)
    assert ch.progress(OWNER, [10, 30], math.inf) == (19, [(21, 39)])


def test_an_ack_already_durable_or_pending_elsewhere_is_a_hole_until_then():
    ch, consumer, acks = channel_with(10, 11, 12)
    assert ch.ack(10) and ch.ack(11)
    # 10's durable ack is in another batch under way: it is not done yet for this one
    assert ch.progress(OWNER, [11], math.inf) == (9, [(11, 11)])
    ch.ack_durable([10])
    assert ch.progress(OWNER, [11], math.inf) == (11, [])


def test_the_horizon_holds_back_what_a_write_in_progress_may_still_commit():
    ch, consumer, acks = channel_with(10, 11, 12)
    assert ch.ack(10) and ch.ack(12)
    # a write sent when 9 was the last id seen may still commit 11.5-like ids above 9
    floor, spans = ch.progress(OWNER, [10, 12], 9)
    assert floor == 9 and spans == [(10, 10), (12, 12)]


def test_nothing_beyond_the_load_cursor_or_the_lowest_ready_copy():
    ch, consumer, acks = channel_with(10, 11, credit=1)
    assert consumer.held == [10]
    assert ch.ack(10)  # 11 is pushed now
    ch.add(message(20))  # waits in ready behind the credit
    assert ch.ack(11)
    floor, spans = ch.progress(OWNER, [10, 11], math.inf)
    assert floor == 19 and spans == []  # 20 is still ready: nothing at or above it is done
    ch.rescan()  # a takeover: copies below the cursor may exist unseen
    assert ch.progress(OWNER, [10, 11], math.inf) == (0, [(10, 10), (11, 11)])


def test_an_owner_whose_writes_this_node_cannot_see_gets_the_acks_alone():
    ch, consumer, acks = channel_with()
    ch.add(message(10, owner=3))
    ch.add(message(11, owner=3))
    assert ch.ack(11)
    assert ch.progress(3, [11], None) == (0, [(11, 11)])
    # the channel's own owner is unaffected by another owner's copy in flight
    assert ch.progress(OWNER, [], math.inf)[0] == ch.cursor.position


# -- the property test -----------------------------------------------------------------


@dataclass
class World:
    """The database, the writers, the acker and the cursor model around one channel."""

    seed: int
    priorities: bool = False  # copies of random priority, and the read-ahead
    lone: bool = False  # one consumer (the channel pushes it runs of copies), else two
    ordered: bool = False  # an ordered topic: keys, commits in order, keys read apart
    cluster: bool = False  # its orderer in a cluster: another owner commits too, never handed here
    rng: random.Random = field(init=False)
    writes: OwnWrites = field(init=False)
    channel: ReliableChannel = field(init=False)
    consumers: list[Consumer] = field(init=False)
    next_id: int = 0
    stored: set[int] = field(default_factory=set)  # committed copies of the channel
    pending_batches: list[tuple[int, list[int]]] = field(default_factory=list)  # (token, ids) not committed
    committed_unanswered: list[tuple[int, list[int]]] = field(default_factory=list)
    acked: set[int] = field(default_factory=set)  # acknowledged by a consumer (in memory)
    durable: set[int] = field(default_factory=set)
    ack_queue: list[int] = field(default_factory=list)
    logged: list[int] = field(default_factory=list)  # the delivery log
    floors: dict[int, int] = field(default_factory=lambda: {OWNER: 0, OTHER: 0})  # the cursor rows, by owner
    done: dict[int, set[int]] = field(default_factory=lambda: {OWNER: set(), OTHER: set()})  # spans, as ids
    owners: dict[int, int] = field(default_factory=dict)  # id -> owner, where not OWNER
    load_request: tuple[int, int] | None = None
    ahead_request: tuple[list[int], int] | None = None
    key_request: tuple[str, int, int] | None = None
    priority: dict[int, int] = field(default_factory=dict)
    keys: dict[int, str | None] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)
    firsts: dict[str, list[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.writes = OwnWrites(OWNER)
        self.channel = ReliableChannel(
            "orders", "billing", clock=Clock(), msg_timeout=30.0, mem_queue_size=4,
            load=self._load, on_acks=lambda c, ds, ms, who: self.ack_queue.extend(d.message.message_id for d in ds),
            load_ahead=self._load_ahead if self.priorities else None,
            ordered=self.ordered, load_key=self._load_key, writes=self.writes,
        )
        self.consumers = [PriorityConsumer(3, self.violations, self.firsts, self.durable)]
        if not self.lone:
            self.consumers.insert(0, PriorityConsumer(2, self.violations, self.firsts, self.durable))
        if self.cluster:
            self.channel.order_here()
        for consumer in self.consumers:
            self.channel.subscribe(consumer)

    # the database ---------------------------------------------------------------
    def covered(self, mid: int) -> bool:
        owner = self.owners.get(mid, OWNER)
        return mid <= self.floors[owner] or mid in self.done[owner]

    @property
    def floor(self) -> int:
        return self.floors[OWNER]

    def _load(self, channel: ReliableChannel, after: int, limit: int) -> None:
        self.load_request = (after, limit, set(channel.cursor.skipped))  # as the store passes them

    def _load_key(self, channel: ReliableChannel, key: str, after: int, limit: int) -> None:
        self.key_request = (key, after, limit)

    def _load_ahead(self, channel: ReliableChannel, afters: list[int], limit: int) -> None:
        self.ahead_request = (afters, limit)

    def row(self, mid: int) -> BacklogRow:
        return BacklogRow(mid, "p", mid, 0, b"x", 0, self.owners.get(mid, OWNER), "", self.keys.get(mid),
                          self.priority.get(mid, 0))

    def answer_load(self) -> None:
        after, limit, skip = self.load_request
        self.load_request = None
        rows = sorted(m for m in self.stored if m > after and not self.covered(m)
                      and (self.keys.get(m) is None or self.keys[m] not in skip))[:limit]
        self.channel.loaded([self.row(m) for m in rows], limit)

    def answer_key(self) -> None:
        key, after, limit = self.key_request
        self.key_request = None
        rows = sorted(m for m in self.stored if m > after and not self.covered(m) and self.keys.get(m) == key)
        self.channel.loaded_key([self.row(m) for m in rows[:limit]], limit, key)

    def answer_ahead(self) -> None:
        """The read-ahead as load_priority_backlog_steps answers it: per level above its bound,
        highest level first, then by id."""
        afters, limit = self.ahead_request
        self.ahead_request = None
        rows = sorted(
            (m for m in self.stored if self.priority.get(m, 0) > 0 and not self.covered(m)
             and m > afters[self.priority[m] - 1]),
            key=lambda m: (-self.priority[m], m),
        )[:limit]
        self.channel.loaded_ahead([self.row(m) for m in rows], limit)

    # the writers ----------------------------------------------------------------
    def send_batch(self) -> None:
        # in a cluster, another node's batch: committed in turn with this node's (the
        # topic's commits are serialised across nodes), its answer not handed here
        other = self.cluster and self.rng.random() < 0.5
        token = -1 if other else self.writes.begin()
        ids = []
        for _ in range(self.rng.randint(1, 3)):
            self.next_id += self.rng.randint(1, 3)  # other topics' ids in between
            ids.append(self.next_id)
            if self.priorities:
                self.priority[self.next_id] = self.rng.choice((0, 0, 1, 5, 9))
            if self.ordered:
                self.keys[self.next_id] = self.rng.choice(("a", "a", "a", "b", "c", None))
            if other:
                self.owners[self.next_id] = OTHER
        self.pending_batches.append((token, ids))

    def commit_one(self) -> None:
        # an ordered topic's batches commit one at a time, in order (reliable.writer)
        token, ids = self.pending_batches.pop(0 if self.ordered else self.rng.randrange(len(self.pending_batches)))
        self.stored.update(ids)
        if token != -1:
            self.committed_unanswered.append((token, ids))

    def answer_one(self) -> None:
        which = 0 if self.ordered else self.rng.randrange(len(self.committed_unanswered))
        token, ids = self.committed_unanswered.pop(which)
        for mid in ids:
            self.channel.add(message(mid, priority=self.priority.get(mid, 0), key=self.keys.get(mid)))
        for mid in ids:
            self.writes.seen(mid)
        self.writes.end(token)

    # the consumers and the acker --------------------------------------------------
    def consumer_acks(self) -> None:
        consumer = self.rng.choice(self.consumers)
        if consumer.held:
            mid = consumer.held.pop(self.rng.randrange(len(consumer.held)))
            if self.channel.ack(mid):
                self.acked.add(mid)

    def flush_acks(self, everything: bool = False) -> None:
        """One durable ack batch: a prefix of the queue (the rest waits for the next, as
        the acker sends one batch at a time); each ack not covered before is logged."""
        cut = len(self.ack_queue) if everything else self.rng.randint(1, len(self.ack_queue))
        batch, self.ack_queue = self.ack_queue[:cut], self.ack_queue[cut:]
        for mid in batch:
            if not self.covered(mid):
                self.logged.append(mid)
        for owner in (OWNER, OTHER):
            acked = [mid for mid in batch if self.owners.get(mid, OWNER) == owner]
            if owner == OTHER and not acked:
                continue
            floor, spans = self.channel.progress(owner, acked, self.writes.limit(owner, orderer=self.cluster))
            self.floors[owner] = max(self.floors[owner], floor)
            for lo, hi in spans:
                self.done[owner].update(range(lo, hi + 1))
        self.durable.update(batch)
        self.channel.ack_durable(batch)

    def step(self) -> None:
        choices = [self.send_batch, self.consumer_acks, self.consumer_acks]
        if self.pending_batches:
            choices.append(self.commit_one)
        if self.committed_unanswered:
            choices.append(self.answer_one)
        if self.ack_queue:
            choices.append(self.flush_acks)
        if self.load_request is not None:
            choices.append(self.answer_load)
        if self.ahead_request is not None:
            choices.append(self.answer_ahead)
        if self.key_request is not None:
            choices.append(self.answer_key)
        if self.cluster:
            choices.append(self.channel.poll)  # the store's --ordered-poll
        self.rng.choice(choices)()

    def check(self) -> None:
        lost = {m for m in self.stored if self.covered(m) and m not in self.acked}
        assert not lost, f"covered but never acknowledged (lost): {sorted(lost)}"
        again = {m for m in self.durable if not self.covered(m)}
        assert not again, f"acknowledged durably but not covered (delivered again after a crash): {sorted(again)}"
        assert not self.violations, self.violations


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(min_value=0, max_value=2**32), st.integers(min_value=20, max_value=300),
       st.sampled_from(("plain", "priorities", "ordered", "cluster")), st.booleans())
def test_the_cursor_covers_exactly_what_was_acknowledged(seed, steps, mode, lone):
    # ordered: priorities too (key order wins); cluster: an ordered topic's orderer
    world = World(seed, mode != "plain", lone, mode in ("ordered", "cluster"), mode == "cluster")
    for _ in range(steps):
        world.step()
        world.check()
    # drain: everything commits, is answered, delivered and acknowledged
    while world.pending_batches:
        world.commit_one()
    for _ in range(10_000):
        if world.committed_unanswered:
            world.answer_one()
        elif world.load_request is not None:
            world.answer_load()
        elif world.ahead_request is not None:
            world.answer_ahead()
        elif world.key_request is not None:
            world.answer_key()
        elif any(c.held for c in world.consumers):
            world.consumer_acks()
        elif world.ack_queue:
            world.flush_acks()
        elif world.cluster and world.stored - world.acked:
            world.channel.poll()  # what the other node stored is read at the next poll
            if world.load_request is None:
                break
        else:
            break
        world.check()
    assert world.acked == world.stored, "every stored copy was delivered and acknowledged"
    if world.ack_queue:
        world.flush_acks(everything=True)
    assert sorted(world.logged) == sorted(world.acked), "every acknowledgement logged exactly once"
    assert all(world.covered(m) for m in world.stored)
    for owner in (OWNER, OTHER):
        # the next ack batch proposes again (acks made durable while writes were open
        # left the floor below them, their ids in done ranges)
        floor, _ = world.channel.progress(owner, [], world.writes.limit(owner, orderer=world.cluster))
        world.floors[owner] = max(world.floors[owner], floor)
        mine = [m for m in world.stored if world.owners.get(m, OWNER) == owner]
        if owner == OWNER or world.cluster and mine:
            assert world.floors[owner] >= max(mine, default=0), "with nothing in flight the floor passes everything"
