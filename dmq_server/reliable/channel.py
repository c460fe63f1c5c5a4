"""A channel (consumer group) of a reliable topic: memory window, in flight, redelivery.

PostgreSQL holds every unacknowledged copy; the channel holds only a window of
them (``mem_queue_size`` copies, and in bytes what the server's ``--max-client-memory``
grants a channel window: ``core.memory.ClientMemory.window_room``) plus what is in
flight, so a backlog of millions, or of megabyte bodies, costs the server little
memory. When the window runs low and the database may hold more (``backlog``), the
channel asks its loader for rows after ``cursor``: as many as the window's free bytes
hold at the bodies' size seen so far (``LOAD_PROBE`` before any was seen).

Protocol-agnostic: a consumer is anything with ``credit``, ``in_flight`` and
``push(delivery)``. Time comes from an injected clock (``seconds()``), and
deadlines sit in one ``core.deadlines.Deadlines`` (the tracker the fast store uses
too) scanned by the broker, never one timer per message.

Why one long module: one channel's invariants (the memory window, the cursor, the known
ids, loads racing arrivals, redelivery) must be read together; the comments are most of
its length.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Protocol, Sequence

from dmq_server.core.deadlines import Deadlines
from dmq_server.core.memory import RELIABLE_WINDOW

__all__ = ["ReliableMessage", "Delivery", "Receiver", "ReliableChannel", "TIMEOUT", "CONSUMER_GONE", "REQUEUED", "RETURN_REASONS"]

# why a delivered copy came back unacknowledged (the message trace's reasons)
TIMEOUT = "timeout"  # not acknowledged within the message timeout
CONSUMER_GONE = "consumer_gone"  # its consumer disconnected or unsubscribed
REQUEUED = "requeued"  # the consumer gave it back (NSQ's REQ), at once or after a delay
RETURN_REASONS = (TIMEOUT, CONSUMER_GONE, REQUEUED)

#: rows a load asks for while the channel has seen no body to size them by
LOAD_PROBE = 16


@dataclass(slots=True)
class ReliableMessage:
    """A stored message as the broker holds it (not frozen: built once per send)."""

    message_id: int
    topic: str
    producer: str
    session_id: int
    published_ms: int
    body: bytes = field(repr=False)
    owner: int = 0  # the incarnation that stored it: its cursor is (topic, channel, owner)


@dataclass(slots=True, eq=False)
class Delivery:
    """One channel's copy of a message, while the server holds it in memory."""

    message: ReliableMessage
    attempts: int = 0
    first_delivered_ms: int = 0
    consumer: Any = None
    deadline: float = 0.0
    delivered_at: float = 0.0  # when the current (or last) attempt was pushed, clock seconds


class Receiver(Protocol):
    credit: int
    in_flight: int

    def push_many(self, channel: "ReliableChannel", deliveries: Sequence[Delivery]) -> None:
        """Send these copies (counted in ``in_flight`` already), in order."""


class ReliableChannel:
    def __init__(
        self,
        topic: str,
        name: str,
        *,
        clock: Any,
        msg_timeout: float,
        mem_queue_size: int,
        load: Callable[["ReliableChannel", int, int], None],
        on_acks: Callable[["ReliableChannel", list[Delivery], int, Any], None],
        max_attempts: int | None = None,
        on_attempt: Callable[["ReliableChannel", Delivery], None] | None = None,
        on_exhausted: Callable[["ReliableChannel", Delivery], None] | None = None,
        on_return: Callable[["ReliableChannel", Delivery, str], None] | None = None,
        deliver_latency: Any = None,
        memory: Any = None,
    ):
        self.topic = topic
        self.name = name
        self.clock = clock
        self.msg_timeout = msg_timeout
        self.mem_queue_size = mem_queue_size
        self._load = load
        # ``on_acks(channel, deliveries, acked_ms, consumer)``: the copies one ``ack_held``
        # call acknowledged, once per call (the store makes their durable-ack rows)
        self._on_acks = on_acks
        # the topic's max delivery attempts (None = unlimited): a copy that comes back
        # after that many goes to ``on_exhausted`` (a dead letter) instead of a consumer;
        # ``on_attempt`` records redeliveries so the count survives a restart
        self.max_attempts = max_attempts
        self._on_attempt = on_attempt
        self._on_exhausted = on_exhausted
        self.exhausted_count = 0
        # a copy coming back before its ack, with why (RETURN_REASONS), while its
        # consumer is still set: the message trace records it (reliable.trace); and
        # each first delivery's publish -> deliver time (a core.buckets.Buckets)
        self._on_return = on_return
        self.deliver_latency = deliver_latency
        self.ready: deque[Delivery] = deque()
        # the bodies in ``ready``, counted in the server's ClientMemory (None: no byte bound),
        # and the size a body had on average lately (what a load's row count is sized by)
        self.ready_bytes = 0
        self._memory = memory
        self._body_size = 0
        self.in_flight: dict[int, Delivery] = {}
        self.known: set[int] = set()  # ids in ready, in flight or awaiting a durable ack
        # for the cursor (``progress``): ready ids and each owner's lowest one (heaps with
        # lazy deletion), and the ids awaiting a durable ack or dead letter, by owner
        self._ready_ids: set[int] = set()
        self._ready_heaps: dict[int, list[int]] = {}
        self.finishing: dict[int, int] = {}
        self.consumers: deque[Receiver] = deque()
        self._deadlines = Deadlines()  # in flight and deferred copies, by message id
        # Start assuming the database holds copies we have not seen (restart, takeover).
        self.backlog = True
        self.cursor = 0
        self.loading = False
        self._arrived_while_loading: list[Delivery] = []
        self._dropped_while_loading: set[int] = set()  # expired during a load: keep them out
        self.closed = False
        # cluster (dmq_server.cluster.node): no pushes or loads while paused; a load that
        # was out during forget() is stale, one out during rescan() is followed by a
        # scan from the start
        self.paused = False
        # an operator's pause (nsqd's channel pause; HTTP /channel/pause, the CLI): copies
        # still arrive and wait in PostgreSQL, none is pushed until unpaused
        self.held = False
        # cluster: asked before each push round; False holds pushes (a node that stood
        # still must learn whether its copies were taken over before it pushes any)
        self.gate: Callable[[], bool] | None = None
        self._load_stale = False
        self._rescan_pending = False
        # False: an answer of its topic did not name it, and none has since
        # (ReliableStore._confirm_channels)
        self.confirmed = True
        # counters for /stats
        self.message_count = 0
        self.requeue_count = 0
        self.timeout_count = 0
        self.ack_count = 0
        self.delivery_count = 0  # pushes to consumers, redeliveries included
        self.redelivery_count = 0  # pushes of a copy delivered before
        # copies a consumer gave back with a delay (REQ with a timeout): in ``in_flight``
        # with no consumer until due, reported as deferred, as nsqd does
        self.deferred: set[int] = set()
        # stored, unacknowledged copies at the last count (Broker refreshes it on a
        # timer; None until then): what nsqd calls depth is mostly in PostgreSQL here
        self.stored_count: int | None = None
        # the lowest id among the stored copies, as of the last pass of the depth count
        # (reliable.depths): /metrics' oldest unacknowledged message
        self.oldest_stored_id: int | None = None

    # -- arrivals ---------------------------------------------------------
    def add(self, message: ReliableMessage) -> None:
        """A freshly committed copy for this channel.

        Kept in memory if there is room and nothing older waits in PostgreSQL;
        otherwise left to the next load. A copy whose id is at or below the load
        cursor is always kept: its commit overtook no scan (concurrent writers
        can commit ids out of order), so no later load would find it.
        """
        mid = message.message_id
        if self.closed or mid in self.known:
            return
        self.message_count += 1
        delivery = Delivery(message)
        if self.loading:
            self._arrived_while_loading.append(delivery)
            return
        if mid <= self.cursor or (
            not self.backlog and len(self.ready) < self.mem_queue_size and self._room(len(message.body))
        ):
            if not self.backlog and mid > self.cursor:
                # Nothing older waits in PostgreSQL, so the cursor may move past this
                # copy: a later load must not find it again after its ack is durable.
                self.cursor = mid
            if not self.ready and self._push_at_once(delivery):
                return
            self._enqueue(delivery)
            self.pump()
            return
        # leave it in PostgreSQL; the next load picks it up in id order
        self.backlog = True
        self._maybe_load()

    def add_many(self, messages: Iterable[ReliableMessage]) -> None:
        """``add`` of each, in order: a group commit's copies for this channel.

        While nothing waits (not in ``ready``, not in PostgreSQL) and pushes may go, the
        copies are handed to the consumers with credit without passing through ``ready``,
        the checks ``add`` and ``_push_at_once`` make per copy made once: a lone consumer
        gets as many as its credit takes in one ``_start_flights``; several take turns
        copy by copy. The first copy no consumer has room for, and everything after it,
        goes through ``add``. This runs once per copy of every message fanned out
        (bench/channel_cost.py)."""
        rest = iter(messages)
        if not (
            self.closed or self.loading or self.backlog or self.ready or self.paused or self.held
            or self.max_attempts is not None or (self.gate is not None and not self.gate())
        ):
            if len(self.consumers) == 1:
                self._add_to_one(rest, self.consumers[0])
            else:
                self._add_in_turns(rest)
        for message in rest:
            self.add(message)

    def _add_to_one(self, messages: Iterator[ReliableMessage], consumer: Receiver) -> None:
        """``add_many``'s copies for a lone consumer, as many as its credit takes (the
        rest stay in ``messages``)."""
        room = consumer.credit - consumer.in_flight
        if room <= 0:
            return
        known = self.known
        cursor = self.cursor
        run: list[Delivery] = []
        for message in messages:
            mid = message.message_id
            if mid in known:
                continue
            known.add(mid)
            if mid > cursor:  # nothing older waits in PostgreSQL (see add)
                cursor = mid
            run.append(Delivery(message))
            room -= 1
            if not room:
                break
        self.cursor = cursor
        if run:
            self.message_count += len(run)
            self._start_flights(run, consumer)

    def _add_in_turns(self, rest: Iterator[ReliableMessage]) -> None:
        """``add_many``'s copies for several consumers, each to the next one with credit
        in the rotation, until none has room (that copy is ``add``ed, the rest stay in
        ``rest``)."""
        # every copy here is a first attempt pushed in this reactor turn: what
        # _start_flights computes from the clock is computed once, and the delivery
        # latency is counted once per run of copies published by one commit
        now = self.clock.seconds()
        now_ms, deadline = int(now * 1000), now + self.msg_timeout
        known, consumers, in_flight = self.known, self.consumers, self.in_flight
        timed: list[int] = []  # the copies pushed, whose deadline is set together after
        latency = self.deliver_latency
        published, same = 0, 0  # the current run of one published_ms, and its length
        pushed = 0
        try:
            for message in rest:
                mid = message.message_id
                if mid in known:
                    continue
                for _ in range(len(consumers)):
                    consumer = consumers[0]
                    consumers.rotate(-1)
                    if consumer.in_flight < consumer.credit:
                        break
                else:  # nobody has credit: this one, and the rest, wait in ready
                    self.add(message)
                    break
                if mid > self.cursor:  # nothing older waits in PostgreSQL (see add)
                    self.cursor = mid
                known.add(mid)
                delivery = Delivery(message, 1, now_ms, consumer, deadline, now)
                in_flight[mid] = delivery
                timed.append(mid)
                consumer.in_flight += 1
                pushed += 1
                if latency is not None and message.published_ms != published:
                    if same:
                        latency.observe_many(now - published / 1000.0, same)
                    published, same = message.published_ms, 0
                same += 1
                # a push only queues bytes for the connection: nothing checked above changes
                consumer.push_many(self, (delivery,))
        finally:  # as _start_flights counts: before a push that may raise
            self._deadlines.set_many(timed, deadline)
            self.message_count += pushed
            self.delivery_count += pushed
            if latency is not None and same:
                latency.observe_many(now - published / 1000.0, same)

    def _push_at_once(self, delivery: Delivery) -> bool:
        """With nothing ready, what ``pump`` would do with this one copy: to the next
        consumer with credit in the rotation, without passing through ``ready`` (its
        deque, id set and per-owner heap cost about as much as the push itself, once per
        channel of each message: fan-out's cost, bench/reliable.py e2e4). False, with
        nothing done, where ``pump`` would not push it now."""
        if self.paused or self.held or (self.gate is not None and not self.gate()):
            return False
        if self.max_attempts is not None and delivery.attempts >= self.max_attempts:
            return False
        consumers = self.consumers
        for _ in range(len(consumers)):
            consumer = consumers[0]
            consumers.rotate(-1)
            if consumer.in_flight < consumer.credit:
                self.known.add(delivery.message.message_id)
                self._start_flights([delivery], consumer)
                if self.backlog:
                    self._maybe_load()
                return True
        return False

    def _enqueue(self, delivery: Delivery) -> None:
        self.known.add(delivery.message.message_id)
        self.ready.append(delivery)
        self._now_ready(delivery.message)
        self._ready_changed(len(delivery.message.body))

    # -- the window in bytes ------------------------------------------------------------
    def _room(self, size: int) -> bool:
        """Whether the window may keep a copy of ``size`` bytes more (the count is the
        caller's); a body's size also updates the running average loads are sized by."""
        self._body_size = (self._body_size * 7 + size) // 8 if self._body_size else size
        memory = self._memory
        return memory is None or memory.window_room(self.ready_bytes, size)

    def _ready_changed(self, delta: int) -> None:
        """``delta`` bytes more (or fewer) of bodies in ``ready``."""
        if delta:
            self.ready_bytes += delta
            if self._memory is not None:
                self._memory.add(RELIABLE_WINDOW, delta)

    def _load_size(self) -> int:
        """Rows the next load asks for: the window's free places, no more than its free
        bytes hold at the average body size (``LOAD_PROBE`` while none is known); at least
        one when nothing is ready, so a consumer always gets something."""
        count = self.mem_queue_size - len(self.ready)
        memory = self._memory
        if memory is None:
            return count
        if self._body_size:
            free = min(memory.channel_limit - self.ready_bytes, memory.window_limit - memory.windows)
            count = min(count, free // self._body_size)
        else:
            count = min(count, LOAD_PROBE)
        return max(count, 0 if self.ready else 1)

    def _now_ready(self, message: ReliableMessage) -> None:
        mid = message.message_id
        self._ready_ids.add(mid)
        heap = self._ready_heaps.get(message.owner)
        if heap is None:
            self._ready_heaps[message.owner] = [mid]
        else:
            heapq.heappush(heap, mid)

    def _ready_min(self, owner: int) -> int | None:
        """The lowest id of ``owner`` waiting in ``ready``."""
        heap = self._ready_heaps.get(owner)
        if not heap:
            return None
        ready = self._ready_ids
        while heap and heap[0] not in ready:
            heapq.heappop(heap)
        return heap[0] if heap else None

    # -- loading the backlog ---------------------------------------------
    def _maybe_load(self) -> None:
        if (
            self.backlog
            and not self.loading
            and not self.closed
            and not self.paused
            and self.consumers
            and len(self.ready) < self.mem_queue_size // 2 + 1
            and (self._memory is None or self.ready_bytes <= self._memory.channel_limit // 2)
        ):
            limit = self._load_size()
            if limit <= 0:
                return
            self.loading = True
            self._load(self, self.cursor, limit)

    def loaded(self, rows: Iterable[Any], limit: int) -> None:
        """Loader callback: rows are BacklogRow-like, in id order."""
        self.loading = False
        dropped, self._dropped_while_loading = self._dropped_while_loading, set()
        if self._load_stale:
            self._load_stale = False
            self._restart_from_database()
            self.pump()
            return
        count = 0
        for row in rows:
            count += 1
            self.cursor = max(self.cursor, row.message_id)
            if self._memory is not None:
                self._body_size = (self._body_size * 7 + len(row.body)) // 8 if self._body_size else len(row.body)
            if row.message_id in self.known or row.message_id in dropped:
                continue
            message = ReliableMessage(
                row.message_id, self.topic, row.producer, row.session_id, row.published_ms, row.body,
                getattr(row, "owner", 0),
            )
            self._enqueue(Delivery(message, attempts=row.attempts))
        if count < limit:
            # the table had nothing more when we looked; later arrivals were kept aside
            self.backlog = False
        arrived, self._arrived_while_loading = self._arrived_while_loading, []
        for delivery in arrived:
            mid = delivery.message.message_id
            if mid in self.known:
                continue
            if mid <= self.cursor or (
                not self.backlog and len(self.ready) < self.mem_queue_size
                and self._room(len(delivery.message.body))
            ):
                self._enqueue(delivery)
            else:
                self.backlog = True
        if self._rescan_pending:
            self._rescan_pending = False
            self.cursor = 0
            self.backlog = True
        self.pump()

    def load_failed(self) -> None:
        """Loader callback on a storage error: keep the backlog flag, retry later.

        Copies that arrived during the failed load and sit at or below the cursor
        are kept: a later load starts after the cursor and would never see them.
        """
        self.loading = False
        self.backlog = True
        self._dropped_while_loading = set()
        if self._load_stale:
            self._load_stale = False
            self._restart_from_database()
            return
        arrived, self._arrived_while_loading = self._arrived_while_loading, []
        for delivery in arrived:
            if delivery.message.message_id <= self.cursor and delivery.message.message_id not in self.known:
                self._enqueue(delivery)
        if self._rescan_pending:
            self._rescan_pending = False
            self.cursor = 0

    # -- cluster: ownership changes (dmq_server.cluster.node, dmq_server.cluster.takeover) ----------
    def rescan(self) -> None:
        """Copies this channel has not seen may now sit below the cursor (a takeover
        gave this node another node's copies): the next load starts from the first id.
        Copies already held are skipped by ``known``."""
        if self.loading:
            self._rescan_pending = True
            return
        self.cursor = 0
        self.backlog = True
        self._maybe_load()

    def forget(self) -> None:
        """Drop every copy held in memory and start again from PostgreSQL.

        For a node that may no longer own what it holds (its registry session was
        lost, so a takeover may have moved its copies to another node): nothing held
        is pushed again; the next loads bring back what this node still owns.
        Consumers' credit is freed; an ack for a dropped copy is refused, and the
        copy is delivered again by whoever owns it (at least once).
        """
        for delivery in self.in_flight.values():
            if delivery.consumer is not None:
                delivery.consumer.in_flight -= 1
                delivery.consumer = None
        held = {d.message.message_id for d in self.ready}
        held.update(self.in_flight)
        self.known -= held  # what stays: acks and dead letters still being made durable
        self.ready.clear()
        self._ready_changed(-self.ready_bytes)
        self._ready_ids.clear()
        self._ready_heaps.clear()
        self.in_flight.clear()
        self.deferred.clear()
        self._deadlines.clear()
        if self.loading:
            self._load_stale = True
        self._restart_from_database()

    def _restart_from_database(self) -> None:
        self._rescan_pending = False
        self._arrived_while_loading = []  # stored and owned here: the next load finds them
        self.cursor = 0
        self.backlog = True

    # -- consumers --------------------------------------------------------
    def subscribe(self, consumer: Receiver) -> None:
        if consumer not in self.consumers:
            self.consumers.append(consumer)
        self._maybe_load()
        self.pump()

    def unsubscribe(self, consumer: Receiver) -> None:
        """Take a consumer away; its unacknowledged copies go back to the front."""
        try:
            self.consumers.remove(consumer)
        except ValueError:
            pass
        mine = [d for d in self.in_flight.values() if d.consumer is consumer]
        mine.sort(key=lambda d: d.message.message_id, reverse=True)
        for delivery in mine:
            self._returned(delivery, CONSUMER_GONE)
            self._requeue(delivery)
        self.pump()

    def pump(self) -> None:
        """Push ready copies to consumers with free credit, round robin."""
        if self.paused or self.held:
            return
        if self.gate is not None and self.ready and not self.gate():
            return
        consumers = self.consumers
        if len(consumers) == 1:
            consumer = consumers[0]
            room = consumer.credit - consumer.in_flight
            if room > 0 and self.ready:
                run = self._take_ready(room)
                if run:
                    self._start_flights(run, consumer)
            self._maybe_load()
            return
        while self.ready and consumers:
            for _ in range(len(consumers)):
                consumer = consumers[0]
                consumers.rotate(-1)
                if consumer.in_flight < consumer.credit:
                    break
            else:
                break  # nobody has credit
            delivery = self.ready.popleft()
            self._ready_ids.discard(delivery.message.message_id)
            self._ready_changed(-len(delivery.message.body))
            if self._exhausted(delivery):
                continue
            self._start_flights([delivery], consumer)
        self._maybe_load()

    def _take_ready(self, room: int) -> list[Delivery]:
        """Up to ``room`` copies from the front of ``ready`` for one consumer (a lone
        consumer's free credit, filled in one ``_start_flights``: the copies an ack batch
        made room for go out in one push call, not one call chain each)."""
        ready, ready_ids = self.ready, self._ready_ids
        run: list[Delivery] = []
        if self.max_attempts is None or self._on_exhausted is None:
            if room >= len(ready):
                run = list(ready)
                ready.clear()
            else:
                popleft = ready.popleft
                run = [popleft() for _ in range(room)]
            ready_ids.difference_update([d.message.message_id for d in run])
            self._ready_changed(-self.ready_bytes if not ready else -sum([len(d.message.body) for d in run]))
            return run
        while ready and len(run) < room:
            delivery = ready.popleft()
            ready_ids.discard(delivery.message.message_id)
            self._ready_changed(-len(delivery.message.body))
            if not self._exhausted(delivery):
                run.append(delivery)
        return run

    def _exhausted(self, delivery: Delivery) -> bool:
        """Whether ``delivery`` (out of ``ready``) has had its attempts: then it goes to
        its dead letter instead of a consumer."""
        if self.max_attempts is None or delivery.attempts < self.max_attempts or self._on_exhausted is None:
            return False
        # stays in `known` until its dead letter commits (see ack_durable)
        self.exhausted_count += 1
        self.finishing[delivery.message.message_id] = delivery.message.owner
        self._on_exhausted(self, delivery)
        return True

    def _start_flights(self, run: list[Delivery], consumer: Receiver) -> None:
        """Push each copy of ``run`` (out of ``ready``, or new) to ``consumer``, which has
        credit for them all: one clock read, one ``Deadlines.set_many`` and one
        ``push_many`` for the lot. Counted before the push, which may raise."""
        now = self.clock.seconds()
        now_ms = int(now * 1000)
        deadline = now + self.msg_timeout
        latency = self.deliver_latency
        on_attempt = self._on_attempt
        in_flight = self.in_flight
        ids: list[int] = []
        redelivered = 0
        published, same = 0, 0  # the current run of first attempts of one published_ms
        for delivery in run:
            message = delivery.message
            attempts = delivery.attempts = delivery.attempts + 1
            if not delivery.first_delivered_ms:  # attempts loaded with a copy may predate this node
                delivery.first_delivered_ms = now_ms
            if attempts > 1:
                redelivered += 1
            elif latency is not None:
                if message.published_ms != published:
                    if same:
                        latency.observe_many(now - published / 1000.0, same)
                    published, same = message.published_ms, 0
                same += 1
            delivery.delivered_at = now
            delivery.consumer = consumer
            delivery.deadline = deadline
            if on_attempt is not None and (attempts > 1 or self.max_attempts is not None):
                on_attempt(self, delivery)
            mid = message.message_id
            in_flight[mid] = delivery
            ids.append(mid)
        if same:
            latency.observe_many(now - published / 1000.0, same)
        self.delivery_count += len(run)
        self.redelivery_count += redelivered
        self._deadlines.set_many(ids, deadline)
        consumer.in_flight += len(run)
        consumer.push_many(self, run)

    def _requeue(self, delivery: Delivery, *, counted: bool = True) -> None:
        """Back to the front of the queue; ``counted`` as a requeue (a consumer gave it
        back or went away), not for a timeout or a deferral ending (nsqd's counters)."""
        mid = delivery.message.message_id
        if self.in_flight.pop(mid, None) is None:
            return
        self._deadlines.discard(mid)
        if delivery.consumer is not None:
            delivery.consumer.in_flight -= 1
        delivery.consumer = None
        if counted:
            self.requeue_count += 1
        self.ready.appendleft(delivery)
        self._now_ready(delivery.message)
        self._ready_changed(len(delivery.message.body))

    def _returned(self, delivery: Delivery, reason: str) -> None:
        if self._on_return is not None:
            self._on_return(self, delivery, reason)

    # -- acks and timeouts -----------------------------------------------
    def ack(self, message_id: int) -> bool:
        delivery = self.in_flight.get(message_id)
        if delivery is None:
            return False
        self.ack_held((message_id,), delivery.consumer)
        return True

    def ack_held(self, message_ids: Iterable[int], consumer: Receiver | None) -> int:
        """Acknowledge each copy ``consumer`` holds among ``message_ids`` (a consumer's
        batch of acks, ``UP_CONSUMER_ACKS``; None holds the deferred copies), then fill
        the credit they freed in one pump; returns how many were refused
        (``owner_error``'s cases).

        Each copy leaves flight counted, its deadline dropped, its consumer's credit
        freed; the copies go to the store in one ``on_acks`` call, which makes their
        durable-ack rows (the consumer that held them is named in each). A copy stays in
        ``known`` until the durable ack commits, so a load cannot resurrect it. One loop
        with its lookups hoisted: it runs once per acknowledged copy
        (bench/channel_cost.py)."""
        in_flight, deferred, finishing = self.in_flight, self.deferred, self.finishing
        now_ms = int(self.clock.seconds() * 1000)
        refused = 0
        acked: list[Delivery] = []
        acked_ids: list[int] = []
        for message_id in message_ids:
            delivery = in_flight.get(message_id)
            if delivery is None or delivery.consumer is not consumer:
                refused += 1
                continue
            del in_flight[message_id]
            acked.append(delivery)
            acked_ids.append(message_id)
            if deferred:
                deferred.discard(message_id)
            finishing[message_id] = delivery.message.owner
        if acked:
            self._deadlines.discard_many(acked_ids)
            self.ack_count += len(acked)
            if consumer is not None:
                consumer.in_flight -= len(acked)
            self._on_acks(self, acked, now_ms, consumer)
            if consumer is not None:
                for delivery in acked:
                    delivery.consumer = None
        self.pump()
        return refused

    def ack_durable(self, message_ids: Iterable[int]) -> None:
        for mid in message_ids:
            if mid not in self.in_flight:
                self.known.discard(mid)
                self.finishing.pop(mid, None)
                if self.loading:
                    # its row is deleted now, but the load under way may have read it
                    # first (a rescan reads ids it delivered before): keep it out
                    self._dropped_while_loading.add(mid)

    def drop(self, message_ids: Iterable[int]) -> int:
        """Forget copies whose delivery rows are gone (expired into dead letters):
        out of ready and in flight, their consumers' credit freed. Returns how many
        were held."""
        gone = set(message_ids)
        if self.loading:  # the load's snapshot may predate the delete: keep them out
            self._dropped_while_loading |= gone
            self._arrived_while_loading = [
                d for d in self._arrived_while_loading if d.message.message_id not in gone
            ]
        ids = {mid for mid in gone if mid in self.known}
        if not ids:
            return 0
        for mid in ids:
            self.deferred.discard(mid)
            delivery = self.in_flight.pop(mid, None)
            self._deadlines.discard(mid)
            if delivery is not None and delivery.consumer is not None:
                delivery.consumer.in_flight -= 1
                delivery.consumer = None
            self.known.discard(mid)
            self.finishing.pop(mid, None)
            self._ready_ids.discard(mid)
        self.ready = deque(d for d in self.ready if d.message.message_id not in ids)
        self._ready_changed(sum([len(d.message.body) for d in self.ready]) - self.ready_bytes)
        self.pump()
        return len(ids)

    def ack_not_durable(self, message_ids: Iterable[int]) -> None:
        """The durable ack failed for good: forget them so they may be loaded again."""
        for mid in message_ids:
            if mid not in self.in_flight:
                self.known.discard(mid)
                self.finishing.pop(mid, None)

    def scan(self, now: float) -> int:
        """Requeue copies whose deadline passed; returns how many."""
        due = (self.in_flight.get(mid) for mid in self._deadlines.pop_due(now))
        expired = [delivery for delivery in due if delivery is not None]
        # back to the front, earliest deadline first
        for delivery in reversed(expired):
            mid = delivery.message.message_id
            if mid in self.deferred:
                self.deferred.discard(mid)  # a deferral that ended, not a timeout
            else:
                self.timeout_count += 1
                self._returned(delivery, TIMEOUT)
            self._requeue(delivery, counted=False)
        if expired:
            self.pump()
        return len(expired)

    # -- per-copy controls for NSQ clients (FIN ownership, REQ, TOUCH) -----
    def owner_error(self, message_id: int, consumer: Receiver) -> str | None:
        """None if ``consumer`` holds ``message_id`` in flight, else nsqd's reason."""
        delivery = self.in_flight.get(message_id)
        if delivery is None:
            return "ID not in flight"
        if delivery.consumer is not consumer:
            return "client does not own message"
        return None

    def requeue(self, message_id: int, consumer: Receiver, delay: float = 0.0) -> str | None:
        """Give a copy back: ready again at once, or after ``delay`` seconds. A delayed
        copy stays in ``in_flight`` with no consumer until the scan requeues it."""
        error = self.owner_error(message_id, consumer)
        if error is not None:
            return error
        delivery = self.in_flight[message_id]
        self._returned(delivery, REQUEUED)
        if delay <= 0:
            self._requeue(delivery)
        else:
            consumer.in_flight -= 1
            delivery.consumer = None
            self.requeue_count += 1
            self.deferred.add(message_id)
            self._reset_deadline(delivery, self.clock.seconds() + delay)
        self.pump()
        return None

    def touch(self, message_id: int, consumer: Receiver) -> str | None:
        """Restart the copy's message timeout."""
        error = self.owner_error(message_id, consumer)
        if error is not None:
            return error
        self._reset_deadline(self.in_flight[message_id], self.clock.seconds() + self.msg_timeout)
        return None

    def _reset_deadline(self, delivery: Delivery, deadline: float) -> None:
        delivery.deadline = deadline
        self._deadlines.set(delivery.message.message_id, deadline)

    def close(self) -> list[Receiver]:
        """The channel was unregistered: drop memory, return its consumers."""
        self.closed = True
        consumers = list(self.consumers)
        for delivery in self.in_flight.values():
            if delivery.consumer is not None:
                delivery.consumer.in_flight -= 1
        self.consumers.clear()
        self.ready.clear()
        self._ready_changed(-self.ready_bytes)
        self._ready_ids.clear()
        self._ready_heaps.clear()
        self.finishing.clear()
        self.in_flight.clear()
        self.deferred.clear()
        self.known.clear()
        self._deadlines.clear()
        return consumers

    @property
    def depth(self) -> int:
        """Copies waiting to be pushed, wherever they wait (nsqd's depth): the stored
        count, less what is in flight or deferred or awaiting its durable ack; at least
        what waits in memory. As fresh as the last stored count."""
        if self.stored_count is None:
            return len(self.ready)
        return max(len(self.ready), self.stored_count - (len(self.known) - len(self.ready)))

    # -- the cursor ---------------------------------------------------------------------
    def progress(self, owner: int, acked: Iterable[int], limit: float | None) -> tuple[int, list[tuple[int, int]]]:
        """What this channel knows to be done of ``owner``'s copies, for its cursor: a
        floor (every id up to it) and inclusive spans above it covering ``acked`` (the
        acks being made durable now). ``limit``: how far ``owner``'s ids are settled
        (``reliable.horizon``); None: nothing is, so only the acks themselves.

        Every copy with an id up to ``bound`` (the least of ``limit``, the load cursor,
        and one below the owner's lowest ready copy) is in memory or done: loads go in
        id order, a late commit at or below the cursor is kept, and the horizon holds
        back ids of writes not yet handed over. So the holes are the copies in flight,
        awaiting a durable ack or dead letter (other than ``acked``), or set aside by a
        load; everything else up to the bound is done, whatever ids of other topics or
        owners lie between."""
        points = sorted(set(acked))
        if limit is None:
            return 0, [(x, x) for x in points]
        cursor = 0 if (self._rescan_pending or self._load_stale) else self.cursor
        bound = min(limit, cursor)
        lowest_ready = self._ready_min(owner)
        if lowest_ready is not None:
            bound = min(bound, lowest_ready - 1)
        bound = int(bound)
        done = set(points)
        holes = [mid for mid, d in self.in_flight.items() if mid <= bound and d.message.owner == owner]
        holes += [mid for mid, o in self.finishing.items() if o == owner and mid <= bound and mid not in done]
        holes += [
            d.message.message_id for d in self._arrived_while_loading
            if d.message.owner == owner and d.message.message_id <= bound
        ]
        holes.sort()
        floor = holes[0] - 1 if holes else bound
        spans: list[tuple[int, int]] = []
        for x in points:
            if x <= floor:
                continue
            if x <= bound:
                i = bisect_left(holes, x)
                span = (holes[i - 1] + 1 if i else floor + 1, holes[i] - 1 if i < len(holes) else bound)
            else:
                span = (x, x)
            if not spans or spans[-1] != span:
                spans.append(span)
        return floor, spans

    # -- for operators (the admin API's trace, peek and channel page) ---------------
    def locate(self, message_id: int) -> dict[str, Any] | None:
        """Where this node holds the copy now, or None: in flight (to whom, since when,
        until when), deferred (until when), or ready in memory. A walk of the memory
        window for a ready copy: for an operator's request, never the message path."""
        delivery = self.in_flight.get(message_id)
        if delivery is not None:
            state = "deferred" if message_id in self.deferred else "in_flight"
            return {
                "state": state,
                "attempts": delivery.attempts,
                "consumer": getattr(delivery.consumer, "name", None),
                "delivered_at": delivery.delivered_at,
                "deadline": delivery.deadline,
            }
        for delivery in self.ready:
            if delivery.message.message_id == message_id:
                return {"state": "ready", "attempts": delivery.attempts}
        return None

    def consumer_stats(self) -> list[dict[str, Any]]:
        """Each consumer's name, credit and copies in flight."""
        return [
            {"name": getattr(c, "name", repr(c)), "credit": c.credit, "in_flight": c.in_flight}
            for c in self.consumers
        ]

    def stats(self) -> dict[str, Any]:
        return {
            "channel_name": self.name,
            "depth": self.depth,
            "in_flight_count": len(self.in_flight) - len(self.deferred),
            "deferred_count": len(self.deferred),
            "paused": self.held,
            "backlog_pending": self.backlog,
            "message_count": self.message_count,
            "requeue_count": self.requeue_count,
            "timeout_count": self.timeout_count,
            "ack_count": self.ack_count,
            "delivery_count": self.delivery_count,
            "redelivery_count": self.redelivery_count,
            "exhausted_count": self.exhausted_count,
            "clients": len(self.consumers),
        }
