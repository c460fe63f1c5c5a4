"""A channel (consumer group) of a reliable topic: memory window, in flight, redelivery.

PostgreSQL holds every unacknowledged copy; the channel holds only a window of
them (``mem_queue_size`` copies, and in bytes what the server's ``--max-client-memory``
grants a channel window: ``core.client_memory.ClientMemory.window_room``) plus what is in
flight, so a backlog of millions, or of megabyte bodies, costs the server little
memory. When the window runs low and the database may hold more (``backlog``), the
channel asks its loader for rows after its read position: as many as the window's free
bytes hold at the bodies' size seen so far (``LOAD_PROBE`` before any was seen). What is
read, held and done (the delivery cursor: loads racing arrivals and acks, takeovers,
the proposal a durable-ack batch makes) is ``reliable.cursor.ChannelCursor``'s; the
channel is the window and the flights over it.

Protocol-agnostic: a consumer is anything with ``credit``, ``in_flight`` and
``push(delivery)``. Time comes from an injected clock (``seconds()``), and
deadlines sit in one ``core.deadlines.Deadlines`` (the tracker the fast store uses
too) scanned by the broker, never one timer per message.

Why one long module: one channel's invariants (the memory window, in flight, redelivery,
the push paths tuned per copy) must be read together; the comments are most of its
length.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, Iterator, Protocol, Sequence

from dmq_server.core.buckets import Buckets
from dmq_server.core.clock import Clock
from dmq_server.core.deadlines import Deadlines
from dmq_server.core.client_memory import RELIABLE_WINDOW, ClientMemory
from dmq_server.db.messages import BacklogRow
from dmq_server.reliable.cursor import ChannelCursor
from dmq_server.reliable.horizon import OwnWrites
from dmq_server.reliable.key_order import KeyGate

__all__ = [
    "ReliableMessage", "Delivery", "Receiver", "ReliableChannel", "TIMEOUT", "CONSUMER_GONE", "REQUEUED",
    "RETURN_REASONS", "NO_ORDERER",
]

# why a delivered copy came back unacknowledged (the message trace's reasons)
TIMEOUT = "timeout"  # not acknowledged within the message timeout
CONSUMER_GONE = "consumer_gone"  # its consumer disconnected or unsubscribed
REQUEUED = "requeued"  # the consumer gave it back (NSQ's REQ), at once or after a delay
RETURN_REASONS = (TIMEOUT, CONSUMER_GONE, REQUEUED)

#: rows a load asks for while the channel has seen no body to size them by
LOAD_PROBE = 16

#: ``ReliableChannel.delivered_by`` of an ordered topic's channel in a cluster while no
#: node is known to deliver it (its copies wait in PostgreSQL)
NO_ORDERER = "(no orderer yet)"


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
    # its properties as its pushes carry them (``Send.status``; "" for none), read from the
    # store as ``BacklogRow.status``
    status: str = ""
    key: str | None = None  # its key: an ordered topic's channels push one copy of a key at a time
    priority: int = 0  # 0 to 9: a channel pushes the waiting copies of the highest first


@dataclass(slots=True, eq=False)
class Delivery:
    """One channel's copy of a message, while the server holds it in memory."""

    message: ReliableMessage
    attempts: int = 0
    first_delivered_ms: int = 0
    consumer: Receiver | None = None
    deadline: float = 0.0
    delivered_at: float = 0.0  # when the current (or last) attempt was pushed, clock seconds


class Receiver(Protocol):
    """A consumer of a channel: how many more copies it takes now (read here, set by
    its connection), how many it holds (the channel counts them)."""

    @property
    def credit(self) -> int: ...

    in_flight: int

    def push_many(self, channel: "ReliableChannel", deliveries: Sequence[Delivery]) -> None:
        """Send these copies (counted in ``in_flight`` already), in order."""


def _held_for_move() -> bool:
    """The gate of a channel held for a move (``ReliableChannel.hold_for_move``)."""
    return False


class ReliableChannel:
    def __init__(
        self,
        topic: str,
        name: str,
        *,
        clock: Clock,
        msg_timeout: float,
        mem_queue_size: int,
        load: Callable[["ReliableChannel", int, int], None],
        on_acks: Callable[["ReliableChannel", list[Delivery], int, "Receiver | None"], None],
        max_attempts: int | None = None,
        on_attempt: Callable[["ReliableChannel", Delivery], None] | None = None,
        on_exhausted: Callable[["ReliableChannel", Delivery], None] | None = None,
        on_return: Callable[["ReliableChannel", Delivery, str], None] | None = None,
        deliver_latency: Buckets | None = None,
        memory: ClientMemory | None = None,
        ordered: bool = False,
        load_ahead: Callable[["ReliableChannel", list[int], int], None] | None = None,
        load_key: Callable[["ReliableChannel", str, int, int], None] | None = None,
        writes: OwnWrites | None = None,
        gate: Callable[[], bool] | None = None,
        paused: bool = False,
        held: bool = False,
        confirmed: bool = True,
        epoch: int = 0,
    ):
        self.topic = topic
        self.name = name
        self.clock = clock
        self.msg_timeout = msg_timeout
        self.mem_queue_size = mem_queue_size
        self._load = load
        # ``load_ahead(channel, afters, limit)``: the copies of priority 1 to 9 above those
        # ids (``ChannelCursor.lookahead_from``), highest first; None: loads only, in id order
        self._load_ahead = load_ahead
        # ``load_key(channel, key, after, limit)``: an ordered topic's copies of one key
        # after that id, oldest first (a key read apart: ``ChannelCursor.skipped``)
        self._load_key = load_key
        # the store's own writes: a load's copy above their horizon is noted ``early``
        self._writes = writes
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
        # the delivery state (reliable.cursor): read position, backlog, load races, the
        # ids held or awaiting a durable ack (``known``, the same set, read on every copy)
        # and those awaiting a durable ack or dead letter; what a durable-ack batch proposes
        self.cursor: ChannelCursor[Delivery] = ChannelCursor()
        self.known = self.cursor.known
        # an ordered topic's channel: one copy of a key out at a time (reliable.key_order).
        # A copy parked behind its key stays counted as waiting in the window (``parked``
        # copies, their bytes in ``ready_bytes``, their ids in ``_ready_ids``): it leaves
        # the ``ready`` deque only, so memory and the cursor's proposals see it as ready
        self.keys: KeyGate[Delivery] | None = KeyGate() if ordered else None
        self.parked = 0
        # a key with this many copies parked is read apart: its first half of them stay,
        # the rest wait in PostgreSQL (``_set_key_aside``)
        self.key_share = max(mem_queue_size // 16, 2)
        # the waiting copies of priority 1 to 9, a queue per priority (``ready`` holds those
        # of priority 0, every message without one): pushed highest first, each queue in
        # id order with a redelivery at its front. Counted in the window as ``ready`` is
        # (ids in ``_ready_ids``, bodies in ``ready_bytes``). An ordered topic's channel
        # keeps every copy in ``ready``: a key's order wins over priority
        self.prioritised: list[deque[Delivery]] = [deque() for _ in range(10)]
        self.prioritised_count = 0
        # for the proposal: ready ids and each owner's lowest one (heaps with lazy deletion)
        self._ready_ids: set[int] = set()
        self._ready_heaps: dict[int, list[int]] = {}
        self.consumers: deque[Receiver] = deque()
        self._deadlines: Deadlines[int] = Deadlines()  # in flight and deferred copies, by message id
        self.closed = False
        # cluster (dmq_server.cluster.node): no pushes or loads while paused; a load that
        # was out during forget() is stale, one out during rescan() is followed by a
        # scan from the start
        self.paused = paused
        # an operator's pause (nsqd's channel pause; HTTP /channel/pause, the CLI): copies
        # still arrive and wait in PostgreSQL, none is pushed until unpaused
        self.held = held
        # cluster: asked before each push round; False holds pushes (a node that stood
        # still must learn whether its copies were taken over before it pushes any).
        # ``hold_for_move`` puts a gate that holds everything in its place, and back
        self.gate = gate
        self._fence_gate = gate
        # an ordered topic's channel in a cluster is delivered by one node, the topic's
        # orderer (cluster.orderers): None here means this node delivers it (as every
        # unordered channel), else the node that does (or NO_ORDERER). While another does,
        # nothing is kept, loaded or pushed here: every node stores the topic, and its
        # copies wait in PostgreSQL for the orderer's loads (``order_here``, ``poll``).
        # Consumers may subscribe and receive nothing
        self.delivered_by: str | None = None
        # False: an answer of its topic did not name it, and none has since
        # (ReliableStore._confirm_channels)
        self.confirmed = confirmed
        # the channel's epoch as this node last learned it (a seek raises it: ``reseek``);
        # every copy pushed carries it to its ack, which moves only cursors of that epoch
        self.epoch = epoch
        self.seek_count = 0  # seeks this node applied (``reseek``)
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
        cursor = self.cursor
        if cursor.early and mid in cursor.early:
            cursor.early.discard(mid)  # a load read it before this answer came
            return
        if self.closed or mid in self.known:
            return
        self.message_count += 1
        delivery = Delivery(message)
        if cursor.loading:
            if message.priority and self._room_for(message, set_aside=False):
                # it waits in memory now, not behind the load's answer: the consumers
                # take the lower copies in memory while the load is out (a copy set
                # aside now would move the position under the load's rows: that waits
                # for the answer, ``ChannelCursor.loaded``)
                cursor.kept_ahead(mid, message.priority)
                self._enqueue(delivery)
                self.pump()
                return
            cursor.arrived.append(delivery)
            return
        if cursor.skipped and message.key in cursor.skipped:
            cursor.skip(message.key, mid)  # its key is read apart: it waits for that read
            return
        if mid <= cursor.position or (
            not cursor.backlog and len(self.ready) + self.parked + self.prioritised_count < self.mem_queue_size
            and self._room(len(message.body))
        ):
            if cursor.loads_only:
                # the orderer's own arrival (``ChannelCursor.loads_only``): another node's
                # lower copy may be visible and unread, so the loads read it, not this
                if mid > cursor.position:
                    cursor.left_stored(mid, message.priority)
                    self._maybe_load()
                return
            if not cursor.backlog and mid > cursor.position:
                # Nothing older waits in PostgreSQL, so the position may move past this
                # copy: a later load must not find it again after its ack is durable.
                cursor.position = mid
            if not self.ready and not self.prioritised_count and self._push_at_once(delivery):
                return
            self._enqueue(delivery)
            self.pump()
            return
        if message.priority and self._room_for(message):
            # nothing of its priority waits in PostgreSQL: it waits in memory, above the
            # position (the loads skip it: it is known)
            cursor.kept_ahead(mid, message.priority)
            self._enqueue(delivery)
            self.pump()
            return
        # leave it in PostgreSQL; the next load (or read-ahead) picks it up in id order
        cursor.left_stored(mid, message.priority)
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
        cursor = self.cursor
        if not (
            self.closed or cursor.loading or cursor.backlog or cursor.early or self.ready or self.prioritised_count
            or self.paused or self.held
            or self.max_attempts is not None or self.keys is not None or (self.gate is not None and not self.gate())
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
        position = self.cursor.position
        run: list[Delivery] = []
        for message in messages:
            mid = message.message_id
            if mid in known:
                continue
            known.add(mid)
            if mid > position:  # nothing older waits in PostgreSQL (see add)
                position = mid
            run.append(Delivery(message))
            room -= 1
            if not room:
                break
        self.cursor.position = position
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
        known, consumers, in_flight, cursor = self.known, self.consumers, self.in_flight, self.cursor
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
                if mid > cursor.position:  # nothing older waits in PostgreSQL (see add)
                    cursor.position = mid
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
        if self.paused or self.held or self.keys is not None or (self.gate is not None and not self.gate()):
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
                if self.cursor.backlog:
                    self._maybe_load()
                return True
        return False

    def _enqueue(self, delivery: Delivery) -> None:
        message = delivery.message
        self.known.add(message.message_id)
        self._to_queue(delivery)
        self._now_ready(message)
        self._ready_changed(len(message.body))

    def _to_queue(self, delivery: Delivery, front: bool = False) -> None:
        """To the back (or the ``front``) of the queue it waits in: ``ready``, or that of
        its priority."""
        priority = delivery.message.priority
        queue = self.ready
        if priority and self.keys is None:
            queue = self.prioritised[priority]
            self.prioritised_count += 1
        if front:
            queue.appendleft(delivery)
        else:
            queue.append(delivery)

    # -- priority ----------------------------------------------------------------------
    def _room_for(self, message: ReliableMessage, set_aside: bool = True) -> bool:
        """Whether a copy of priority above 0 committed while copies wait in PostgreSQL
        may wait in memory: none of its priority waits there (else it would pass them),
        and the window has room, made if need be (and ``set_aside``) by setting aside
        waiting copies of lower priorities, the newest first
        (``ChannelCursor.left_stored``: the reads come back to them)."""
        priority = message.priority
        if self.keys is not None or priority in self.cursor.urgent:
            return False
        size = len(message.body)
        if self._room(size) and len(self.ready) + self.parked + self.prioritised_count < self.mem_queue_size:
            return True
        if not set_aside:
            return False
        memory = self._memory
        while True:
            victim = self._newest_below(priority)
            if victim is None:
                return False
            self._set_aside(victim)
            if len(self.ready) + self.parked + self.prioritised_count < self.mem_queue_size and (
                memory is None or memory.window_room(self.ready_bytes, size)
            ):
                return True

    def _room_ahead(self, delivery: Delivery) -> bool:
        """``_room_for`` a copy committed while a load was out (``ChannelCursor.loaded``)."""
        return self._room_for(delivery.message)

    def _newest_below(self, priority: int) -> Delivery | None:
        """The newest waiting copy of the lowest priority below ``priority``, out of its queue."""
        if self.ready:
            return self.ready.pop()
        for level in range(1, priority):
            queue = self.prioritised[level]
            if queue:
                self.prioritised_count -= 1
                return queue.pop()
        return None

    def _set_aside(self, delivery: Delivery, key: str | None = None) -> None:
        """A waiting copy (out of its queue) leaves memory; it stays stored, read again by
        a load (or with its ``key``, read apart)."""
        message = delivery.message
        self.known.discard(message.message_id)
        self._ready_ids.discard(message.message_id)
        self._ready_changed(-len(message.body))
        if key is not None:
            self.cursor.skip(key, message.message_id)
        else:
            self.cursor.left_stored(message.message_id, message.priority)

    def _take_prioritised(self, room: int) -> list[Delivery]:
        """Up to ``room`` waiting copies of priority 1 to 9, highest first, out of their
        queues (a copy that had its attempts goes to its dead letter on the way)."""
        run: list[Delivery] = []
        ready_ids = self._ready_ids
        for level in range(9, 0, -1):
            queue = self.prioritised[level]
            while queue and len(run) < room:
                delivery = queue.popleft()
                self.prioritised_count -= 1
                ready_ids.discard(delivery.message.message_id)
                self._ready_changed(-len(delivery.message.body))
                if not self._exhausted(delivery):
                    run.append(delivery)
            if len(run) >= room:
                break
        return run

    def _clear_prioritised(self) -> None:
        for queue in self.prioritised:
            queue.clear()
        self.prioritised_count = 0

    def _waiting_copies(self) -> Iterator[Delivery]:
        """Every copy waiting in memory: priority 1 to 9 highest first, then ``ready``."""
        for level in range(9, 0, -1):
            yield from self.prioritised[level]
        yield from self.ready

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
        count = self.mem_queue_size - len(self.ready) - self.parked - self.prioritised_count
        memory = self._memory
        if memory is None:
            return count
        if self._body_size:
            free = min(memory.channel_limit - self.ready_bytes, memory.window_limit - memory.windows)
            count = min(count, free // self._body_size)
        else:
            count = min(count, LOAD_PROBE)
        # (copies parked behind their keys wait in memory too: no row more for them)
        return max(count, 0 if self.ready or self.parked or self.prioritised_count else 1)

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
        cursor = self.cursor
        if cursor.skipped and self._read_a_key():
            return
        if (
            cursor.backlog
            and not cursor.loading
            and not self.closed
            and not self.paused
            and self.delivered_by is None
            and self.consumers
            and len(self.ready) + self.parked + self.prioritised_count < self.mem_queue_size // 2 + 1
            and (self._memory is None or self.ready_bytes <= self._memory.channel_limit // 2)
        ):
            limit = self._load_size()
            if limit <= 0:
                return
            if cursor.urgent and self._load_ahead is not None and self.keys is None:
                self._load_ahead(self, cursor.lookahead_from(), limit)
            else:
                self._load(self, cursor.load_from(), limit)

    def loaded(self, rows: Iterable[BacklogRow], limit: int) -> None:
        """Loader callback: rows are BacklogRow-like, in id order (``ChannelCursor.loaded``
        decides which are new and where the copies committed meanwhile go)."""
        self.cursor.loaded(self._sized(rows), limit, self._enqueue_row, self._enqueue, self._window_room,
                           room_ahead=self._room_ahead)
        self.pump()

    def _sized(self, rows: Iterable[BacklogRow]) -> Iterable[BacklogRow]:
        """``rows`` of a load, read ahead or read with their key, after every one of them
        sized the next read (new or not: else reads stay at ``LOAD_PROBE`` rows), and this
        node's own copies whose commit is not answered yet noted ``early``."""
        writes = self._writes
        horizon = writes.horizon() if writes is not None else math.inf
        if (self._memory is None and horizon == math.inf) or self.cursor.load_stale:
            return rows
        rows = list(rows)
        if self._memory is not None:
            for row in rows:
                self._body_size = (self._body_size * 7 + len(row.body)) // 8 if self._body_size else len(row.body)
        if writes is not None and horizon != math.inf:
            owner, early = writes.owner, self.cursor.early
            early.update(row.message_id for row in rows if row.message_id > horizon and row.owner == owner)
        return rows

    def _read_a_key(self) -> bool:
        """Read the next copies of a key read apart whose copies in memory have all gone
        out (its next copy is wanted when the one out is done); True if a read went out."""
        keys, cursor = self.keys, self.cursor
        if (
            keys is None or self._load_key is None or cursor.loading or self.closed or self.paused
            or self.delivered_by is not None or not self.consumers
            or len(self.ready) + self.parked >= self.mem_queue_size
        ):
            return False
        for key in cursor.skipped:
            if key not in keys.parked:
                self._load_key(self, key, cursor.key_load_from(key), max(self.key_share // 2, 1))
                return True
        return False

    def loaded_key(self, rows: Iterable[BacklogRow], limit: int, key: str) -> None:
        """Callback of a key's read: its next copies, oldest first (``ChannelCursor.loaded``)."""
        keys = self.keys
        if keys is None:  # no longer ordered: the copies wait as any other
            self.cursor.loaded(self._sized(rows), limit, self._enqueue_row, self._enqueue, self._window_room, key=key)
            self.pump()
            return

        def park(row: BacklogRow) -> None:
            # behind the copies of the key in memory (a read goes out only when none is
            # parked), so a later read waits until these have gone out
            delivery = self._delivery_of(row)
            self.known.add(row.message_id)
            keys.park(key, delivery)
            self._now_ready(delivery.message)
            self._ready_changed(len(row.body))

        self.cursor.loaded(self._sized(rows), limit, park, self._enqueue, self._window_room, key=key)
        head = keys.hand_on(key)  # no copy of the key out: the first read goes next
        if head is not None:
            self.ready.appendleft(head)
        self.parked = keys.parked_count
        self.pump()

    def loaded_ahead(self, rows: Iterable[BacklogRow], limit: int) -> None:
        """Read-ahead callback: rows of priority 1 to 9, highest first
        (``ChannelCursor.loaded``)."""
        self.cursor.loaded(self._sized(rows), limit, self._enqueue_row, self._enqueue, self._window_room,
                           ahead=True, room_ahead=self._room_ahead)
        self.pump()

    def _enqueue_row(self, row: BacklogRow) -> None:
        self._enqueue(self._delivery_of(row))

    def _delivery_of(self, row: BacklogRow) -> Delivery:
        message = ReliableMessage(
            row.message_id, self.topic, row.producer, row.session_id, row.published_ms, row.body,
            getattr(row, "owner", 0), getattr(row, "status", ""), getattr(row, "key", None),
            min(max(getattr(row, "priority", 0), 0), 9),  # a row written by hand may hold any smallint
        )
        return Delivery(message, attempts=row.attempts)

    def _window_room(self, delivery: Delivery) -> bool:
        """Whether the memory window keeps a copy committed during a load."""
        return (len(self.ready) + self.parked + self.prioritised_count < self.mem_queue_size
                and self._room(len(delivery.message.body)))

    def load_failed(self) -> None:
        """Loader callback on a storage error: keep the backlog flag, retry later
        (``ChannelCursor.load_failed``: copies committed meanwhile at or below the
        position are kept)."""
        self.cursor.load_failed(self._enqueue)

    # -- cluster: ownership changes (dmq_server.cluster.node, dmq_server.cluster.takeover) ----------
    def rescan(self) -> None:
        """Copies this channel has not seen may now sit below the read position (a
        takeover gave this node another node's copies): the next load starts from the
        first id. Copies already held are skipped by ``known``."""
        if self.cursor.rescan():
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
        held = {d.message.message_id for d in self._waiting_copies()}
        held.update(self.in_flight)
        self._clear_prioritised()
        if self.keys is not None:
            held.update(d.message.message_id for d in self.keys.clear())
            self.parked = 0
        self.ready.clear()
        self._ready_changed(-self.ready_bytes)
        self._ready_ids.clear()
        self._ready_heaps.clear()
        self.in_flight.clear()
        self.deferred.clear()
        self._deadlines.clear()
        self.cursor.forget(held)  # what stays known: acks and dead letters still being made durable

    def reseek(self, epoch: int) -> bool:
        """A seek (``dmq channel seek``) rewrote the channel's cursors in PostgreSQL with
        ``epoch``: what this node holds, has read or is finishing describes the cursors as
        they were, so it drops it all (``forget``, and ``ChannelCursor.reseek`` for what
        ``forget`` keeps) and reads the channel again from the first id. Acks of the
        copies it pushed before are refused (their epoch is older), and the copies the
        seek made the channel's again are pushed again: at least once. False, with
        nothing changed, when ``epoch`` is not newer than the one it knows."""
        if epoch <= self.epoch:
            return False
        self.epoch = epoch
        self.seek_count += 1
        self.forget()
        self.cursor.reseek()
        self.stored_count = self.oldest_stored_id = None
        self._maybe_load()
        self.pump()
        return True

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
        if self.keys is not None:
            self._pump_ordered(self.keys)
            return
        consumers = self.consumers
        if len(consumers) == 1:
            consumer = consumers[0]
            room = consumer.credit - consumer.in_flight
            if room > 0 and (self.ready or self.prioritised_count):
                run = self._take_ready(room)
                if run:
                    self._start_flights(run, consumer)
            self._maybe_load()
            return
        while (self.ready or self.prioritised_count) and consumers:
            for _ in range(len(consumers)):
                consumer = consumers[0]
                consumers.rotate(-1)
                if consumer.in_flight < consumer.credit:
                    break
            else:
                break  # nobody has credit
            if self.prioritised_count:
                run = self._take_prioritised(1)
                if run:
                    self._start_flights(run, consumer)
                continue
            delivery = self.ready.popleft()
            self._ready_ids.discard(delivery.message.message_id)
            self._ready_changed(-len(delivery.message.body))
            if self._exhausted(delivery):
                continue
            self._start_flights([delivery], consumer)
        self._maybe_load()

    def _pump_ordered(self, keys: KeyGate[Delivery]) -> None:
        """``pump`` on an ordered topic's channel: each copy from the front of ``ready``
        goes out only if its key is free (or held by the copy itself, coming back);
        otherwise it is parked behind the copy holding the key (``KeyGate.admit``). A lone
        consumer's run is pushed in one call, as ``pump`` does. (While another node delivers
        the channel, ``delivered_by``, nothing is ready: nothing is pushed.)"""
        consumers = self.consumers
        while self.ready and consumers:
            for _ in range(len(consumers)):
                consumer = consumers[0]
                consumers.rotate(-1)
                room = consumer.credit - consumer.in_flight
                if room > 0:
                    break
            else:
                break  # nobody has credit
            if len(consumers) > 1:
                room = 1  # in turns, a copy each
            run: list[Delivery] = []
            while len(run) < room:
                delivery = self._next_admitted(keys)
                if delivery is None:
                    break
                run.append(delivery)
            if not run:
                break
            self._start_flights(run, consumer)
        self._maybe_load()

    def _next_admitted(self, keys: KeyGate[Delivery]) -> Delivery | None:
        """The first copy of ``ready`` whose key lets it go, out of ``ready``; the copies
        before it whose keys are held are parked on the way. None: nothing may go now."""
        ready = self.ready
        while ready:
            delivery = ready.popleft()
            if not keys.admit(delivery):
                self.parked += 1  # still waiting in the window: its id and bytes stay counted
                key = delivery.message.key
                if key is not None and len(keys.parked[key]) >= self.key_share and self._load_key is not None:
                    self._set_key_aside(keys, key)
                continue
            self._ready_ids.discard(delivery.message.message_id)
            self._ready_changed(-len(delivery.message.body))
            if self._exhausted(delivery):  # dead-lettered: its key is free again
                continue
            return delivery
        return None

    def _set_key_aside(self, keys: KeyGate[Delivery], key: str) -> None:
        """``key`` has ``key_share`` copies parked: the first half of its waiting copies stay,
        the others (parked, or in ``ready`` not met yet) leave memory and wait in
        PostgreSQL, read with their key as those go out (``ChannelCursor.skip``). So a hot
        key never fills the window the other keys flow through."""
        ready = self.ready
        holder = keys.holders.get(key)
        later = [d for d in ready if d.message.key == key and d.message.message_id != holder]
        if later:
            others = [d for d in ready if d.message.key != key or d.message.message_id == holder]
            ready.clear()
            ready.extend(others)
        gone = keys.set_aside(key, later, self.key_share // 2)
        self.parked = keys.parked_count
        for delivery in gone:
            self._set_aside(delivery, key)

    def _release_keys(self, copies: Iterable[Delivery]) -> None:
        """These copies are done (acknowledged, dead-lettered): each key one of them held
        is free, and the copy parked first behind it is next to go (the front of
        ``ready``)."""
        keys = self.keys
        if keys is None:
            return
        for delivery in copies:
            following = keys.release(delivery)
            if following is not None:
                self.parked -= 1
                self.ready.appendleft(following)

    def hold_for_move(self, held: bool) -> None:
        """An ordered topic's move holds this channel's pushes while an older cluster
        drains (``broker.placement.move_held``): its gate holds every push round, and when
        let go it is the cluster node's gate again and pushes what waits, a key's next copy
        first. The gate is swapped, not asked once more per round: pushes cost nothing
        extra while no move holds them."""
        self.gate = _held_for_move if held else self._fence_gate
        if not held:
            self.pump()

    def set_ordered(self, ordered: bool) -> None:
        """The topic's ``ordered`` setting changed (``dmq topic update``): from now on one
        copy of a key at a time (the keys of copies in flight now are held by them), or
        no longer (the parked copies are ready again, in their order)."""
        if ordered and self.keys is None:
            if self.prioritised_count:  # every copy in ``ready`` now, in id order (a key's order wins)
                self.ready = deque(sorted(self._waiting_copies(), key=lambda d: d.message.message_id))
                self._clear_prioritised()
            keys: KeyGate[Delivery] = KeyGate()
            for mid, delivery in sorted(self.in_flight.items()):
                key = delivery.message.key
                if key is not None:
                    keys.holders.setdefault(key, mid)
            self.keys = keys
        elif not ordered and self.keys is not None:
            self.cursor.unskip()  # the keys read apart are read with the others again
            if self.delivered_by is not None or self.cursor.loads_only:
                # delivered here again, and only this node's own copies (and those of the
                # cursors it holds) are its to read: from the first id, as a takeover does
                self.delivered_by = None
                self.cursor.loads_only = False
                self.cursor.rescan()
            waiting = sorted(self.keys.clear(), key=lambda d: d.message.message_id, reverse=True)
            self.keys = None
            self.parked = 0
            self.ready.extendleft(waiting)
            if any(d.message.priority for d in self.ready):  # each copy of a priority to its queue
                copies, self.ready = list(self.ready), deque()
                for delivery in copies:
                    self._to_queue(delivery)
            self.pump()

    # -- an ordered topic across a cluster's nodes (cluster.orderers) -------------------
    def order_elsewhere(self, orderer: str) -> None:
        """Another node delivers this ordered topic's channel (``orderer``, or
        ``NO_ORDERER``): what this node holds is dropped (``forget``: a later ack of it is
        refused, and the orderer delivers the copy), and nothing more is kept, loaded or
        pushed here. The copies of every node wait in PostgreSQL."""
        if self.delivered_by is None:
            self.forget()
        self.delivered_by = orderer
        self.cursor.loads_only = False

    def order_here(self) -> None:
        """This node is the ordered topic's orderer: it delivers the channel for the whole
        cluster, reading every node's copies from the first id (``ChannelCursor.loads_only``;
        the store's loads read every owner). Nothing if it is already."""
        cursor = self.cursor
        if self.delivered_by is None and cursor.loads_only:
            return
        self.forget()  # nothing held is pushed on stale knowledge (a gated channel holds nothing)
        self.delivered_by = None
        cursor.loads_only = True
        cursor.from_start()
        self.pump()

    def poll(self) -> None:
        """The orderer's poll (``--ordered-poll``): the other nodes' commits of the topic are
        not handed to this node, so a channel with consumers and no load out reads whatever
        was stored since its last load. Nothing on any other channel."""
        cursor = self.cursor
        if cursor.loads_only and self.consumers and not cursor.loading and self.delivered_by is None:
            cursor.backlog = True
            self._maybe_load()

    def _take_ready(self, room: int) -> list[Delivery]:
        """Up to ``room`` copies from the front of ``ready`` for one consumer (a lone
        consumer's free credit, filled in one ``_start_flights``: the copies an ack batch
        made room for go out in one push call, not one call chain each)."""
        ready, ready_ids = self.ready, self._ready_ids
        run: list[Delivery] = []
        if self.prioritised_count:  # the copies of a priority first
            run = self._take_prioritised(room)
            if len(run) >= room or not ready:
                return run
        if self.max_attempts is None or self._on_exhausted is None:
            room -= len(run)
            if room >= len(ready):
                taken = list(ready)
                ready.clear()
            else:
                popleft = ready.popleft
                taken = [popleft() for _ in range(room)]
            ready_ids.difference_update([d.message.message_id for d in taken])
            self._ready_changed(
                -self.ready_bytes if not ready and not self.prioritised_count else -sum([len(d.message.body) for d in taken])
            )
            if run:
                run += taken
                return run
            return taken
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
        self.cursor.exhausted(delivery.message.message_id, delivery.message.owner)
        self._on_exhausted(self, delivery)
        if self.keys is not None:
            self._release_keys((delivery,))
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
        if same and latency is not None:  # ``same`` counts only with a latency to observe
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
        self._to_queue(delivery, front=True)
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
        in_flight, deferred = self.in_flight, self.deferred
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
        if acked:
            self.cursor.acknowledged(acked)
            self._deadlines.discard_many(acked_ids)
            self.ack_count += len(acked)
            if consumer is not None:
                consumer.in_flight -= len(acked)
            self._on_acks(self, acked, now_ms, consumer)
            if consumer is not None:
                for delivery in acked:
                    delivery.consumer = None
            if self.keys is not None:
                self._release_keys(acked)
        self.pump()
        return refused

    def ack_durable(self, message_ids: Iterable[int]) -> None:
        """Their durable ack (or dead letter) committed (``ChannelCursor.durable``)."""
        self.cursor.durable(message_ids, self.in_flight)

    def drop(self, message_ids: Iterable[int]) -> int:
        """Forget copies whose delivery rows are gone (expired into dead letters):
        out of ready and in flight, their consumers' credit freed. Returns how many
        were held."""
        ids = self.cursor.drop(set(message_ids))
        if not ids:
            return 0
        for mid in ids:
            self.deferred.discard(mid)
            delivery = self.in_flight.pop(mid, None)
            self._deadlines.discard(mid)
            if delivery is not None and delivery.consumer is not None:
                delivery.consumer.in_flight -= 1
                delivery.consumer = None
            self._ready_ids.discard(mid)
        self.ready = deque(d for d in self.ready if d.message.message_id not in ids)
        if self.prioritised_count:
            self.prioritised = [deque(d for d in queue if d.message.message_id not in ids) for queue in self.prioritised]
            self.prioritised_count = sum(len(queue) for queue in self.prioritised)
        waiting = sum([len(d.message.body) for queue in self.prioritised for d in queue])
        if self.keys is not None:  # parked ones go too; a key a dropped copy held is free
            self.ready.extendleft(reversed(self.keys.discard(ids)))
            self.parked = self.keys.parked_count
            waiting += sum([len(d.message.body) for d in self.keys.waiting()])
        self._ready_changed(sum([len(d.message.body) for d in self.ready]) + waiting - self.ready_bytes)
        self.pump()
        return len(ids)

    def ack_not_durable(self, message_ids: Iterable[int]) -> None:
        """The fence refused their durable ack: forget them (``ChannelCursor.refused``)."""
        self.cursor.refused(message_ids, self.in_flight)

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
        """Restart the copy's message timeout; refused while delivery is paused (this
        node's ZooKeeper session is in doubt): another node may take the copy over once
        its timeout has passed (an ordered topic's next orderer waits exactly that), so
        its consumer must not keep it longer."""
        error = self.owner_error(message_id, consumer)
        if error is not None:
            return error
        if self.paused:
            return "delivery paused (this node's cluster session is in doubt)"
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
        self._clear_prioritised()
        if self.keys is not None:
            self.keys.clear()
            self.parked = 0
        self._ready_changed(-self.ready_bytes)
        self._ready_ids.clear()
        self._ready_heaps.clear()
        self.cursor.close()
        self.in_flight.clear()
        self.deferred.clear()
        self._deadlines.clear()
        return consumers

    @property
    def waiting(self) -> int:
        """Copies waiting in memory: ready, of a priority, parked behind their keys."""
        return len(self.ready) + self.prioritised_count + self.parked

    @property
    def depth(self) -> int:
        """Copies waiting to be pushed, wherever they wait (nsqd's depth): the stored
        count, less what is in flight or deferred or awaiting its durable ack; at least
        what waits in memory. As fresh as the last stored count."""
        waiting = self.waiting
        if self.stored_count is None:
            return waiting
        return max(waiting, self.stored_count - (len(self.known) - waiting))

    # -- the cursor ---------------------------------------------------------------------
    def progress(self, owner: int, acked: Iterable[int], limit: float | None) -> tuple[int, list[tuple[int, int]]]:
        """What this channel knows to be done of ``owner``'s copies, for its cursor row
        (``ChannelCursor.progress``, with the copies this channel holds in flight and the
        owner's lowest one in ``ready``)."""
        return self.cursor.progress(owner, acked, limit, self.in_flight, self._ready_min(owner))

    @property
    def backlog(self) -> bool:
        """PostgreSQL may hold copies after the read position that memory does not."""
        return self.cursor.backlog

    @backlog.setter
    def backlog(self, value: bool) -> None:
        self.cursor.backlog = value

    @property
    def loading(self) -> bool:
        return self.cursor.loading

    @loading.setter
    def loading(self, value: bool) -> None:
        self.cursor.loading = value

    @property
    def finishing(self) -> dict[int, int]:
        """The ids awaiting a durable ack or dead letter, with their owner."""
        return self.cursor.finishing

    # -- for operators (the admin API's trace, peek and channel page) ---------------
    def locate(self, message_id: int) -> dict[str, object] | None:
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
        for delivery in self._waiting_copies():
            if delivery.message.message_id == message_id:
                return {"state": "ready", "attempts": delivery.attempts}
        keys = self.keys
        if keys is not None:
            key = keys.held_by(message_id)
            if key is not None:  # parked behind the copy of its key that is out
                return {"state": "waiting_for_key", "key": key, "holder": keys.holders.get(key)}
        return None

    def consumer_stats(self) -> list[dict[str, object]]:
        """Each consumer's name, credit and copies in flight."""
        return [
            {"name": getattr(c, "name", repr(c)), "credit": c.credit, "in_flight": c.in_flight}
            for c in self.consumers
        ]

    def stats(self) -> dict[str, object]:
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
            # an ordered topic's channel: copies waiting behind a copy of their key that is out
            "ordered": self.keys is not None,
            "parked_count": self.parked,
            # keys with more copies waiting than a share of the window, read apart
            "keys_read_apart": len(self.cursor.skipped),
            # in a cluster, an ordered topic's channel is delivered by one node: None, this
            # one; else that node's id (or NO_ORDERER), and nothing is pushed here
            "delivered_by": self.delivered_by,
        }
