"""Batchers between the reactor and PostgreSQL: group commit and durable acks.

``GroupCommitWriter``: sends queue up while one transaction is in progress and
go together in the next, so the commit rate (bounded by fsync) does not bound
the message rate. Each send's Deferred fires only after *its* transaction
committed, which is when the producer may be told SEND_SUCCESS_ACK.

A failed batch is one of two kinds. PostgreSQL refused its input
(``store.RefusedError``: nothing was committed, and the same rows fail again):
the batch is split in halves, each run alone, until the rows at fault are found
and only their sends fail, so one bad message never fails another. Anything else
(a connection lost mid-statement) leaves the outcome *unknown*: the batch may have
committed with its answer lost. Its sends are answered with the error (a resend
finds the stored row and is answered as a duplicate) and ``on_unknown`` is told,
so the broker re-reads the affected channels from the store instead of trusting
that nothing arrived.

``AckBatcher``: acknowledgements are applied in batches too; a failed batch is
retried (with a growing pause) until PostgreSQL answers again, because the
consumer has already been told nothing, and losing the ack would only cause a
redelivery after a restart.

Why one long module: both batchers decide what a failed transaction means for the
items in it (refused input halved, an unknown outcome re-read, a durable ack retried
with backoff), and those rules must be read side by side to see that every item is
either answered or tried again, never dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Generic, Sequence, TypeVar, Union

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_server.core.buckets import BATCH_SIZES, LATENCY_SECONDS, Buckets
from dmq_server.core.clock import Clock, Timer
from dmq_server.core.errors import ShuttingDown
from dmq_server.db.outage import Outage
from dmq_server.db.runner import StepRunner
from dmq_server.db.steps import Steps
from dmq_server.db.storage_errors import Fenced, RefusedError, StorageError
from dmq_server.db.messages import AckRun, StoredMessage, ack_deliveries_steps, insert_messages_steps
from dmq_server.reliable.horizon import OwnWrites

__all__ = ["GroupCommitWriter", "AckBatcher", "RetryingBatcher"]

log = Logger()


# A second transaction starts while another is in flight only once this many sends wait.
# Below it the sends wait for the running commit and go together in the next one: every
# transaction has a fixed cost in PostgreSQL (statement, commit, WAL flush), and at a
# moderate rate a free writer took each send that arrived during a commit as a batch of
# one or two. bench/reliable.py's steady load (5,000 msgs/s) with one writer against two:
# PostgreSQL CPU per message 90-98 us against 126 us, publish->ack p99 7.7-41 ms against
# 11-120 ms. Under full load the queue passes it at once and the writers run side by side.
PARALLEL_MIN = 64

# what a group commit stores (a send, a NewDelayed, a NewDeadLetter) and what
# storing one gives (a StoredMessage, a StoredDelay, a dead letter's id)
ItemT = TypeVar("ItemT")
ResultT = TypeVar("ResultT")

# each item's outcome: its result, or the error that answers it (Misplaced, Fenced,
# RefusedError, a StorageError of unknown outcome, ShuttingDown)
Outcome = Union[ResultT, Exception]
# ``answer(start, outcomes)``: the outcomes of a run's messages from position ``start`` on
Answer = Callable[[int, Sequence[Outcome[ResultT]]], None]
# a queued item, the answer of its run, its position in the run
_Item = tuple[ItemT, Answer[ResultT], int]


def _answer(batch: list[_Item[ItemT, ResultT]], outcomes: Sequence[Outcome[ResultT]]) -> None:
    """Each run's part of ``batch`` (consecutive items of one answer, positions in order)
    answered in one call with its outcomes; one answer failing fails no other."""
    i, n = 0, len(batch)
    while i < n:
        _, answer, start = batch[i]
        j = i + 1
        while j < n and batch[j][1] is answer and batch[j][2] == start + (j - i):
            j += 1
        try:
            answer(start, outcomes[i:j])
        except Exception:
            log.failure("send completion failed")
        i = j


class GroupCommitWriter(Generic[ItemT, ResultT]):
    """Group commit over one or more writer connections: ``insert`` stores the
    ``ItemT``s of a batch, each answered with its ``ResultT`` (or an error).

    With several workers, batches commit concurrently (PostgreSQL merges their
    WAL flushes), so message ids may commit slightly out of order; the channel
    copes with that (see ``ReliableChannel.add``). A further transaction starts
    while one is in flight only for at least ``parallel_min`` waiting sends.

    A run (``submit_run``'s messages) is one transaction's: a batch ends before a run
    it would cut, so the run's messages get ids in the run's order (the insert sorts
    a batch by (producer, session id): a run of one producer with rising session ids,
    as the outbox relay's, keeps its order), and no concurrent transaction can take
    a later part of it. What does not hold: a run longer than ``max_batch`` is cut
    (its parts may commit side by side, out of order); a refused batch is split in
    halves that run on their own, side by side with several workers, so a run in
    it may be cut and its parts stored out of order; and runs of one producer
    submitted one after another, or messages submitted one by one, may go into
    concurrent transactions (a caller that needs them in order waits for each
    run's answer before submitting the next, as the outbox relay does).

    Runs submitted ``serial`` (an ordered topic's sends) are committed one transaction at
    a time: a batch of them starts only when no other batch of them is under way, and
    holds no other sends. Their ids then rise in the order their commits made them
    visible, which is the order an ordered topic's channels deliver a key's messages in
    (``reliable.key_order``); the other sends keep committing side by side. A refused
    serial batch's halves stay serial.

    ``interval`` (seconds, with a clock): when a transaction commits with fewer than
    ``parallel_min`` sends waiting and none other in flight, the next one starts no sooner
    than ``interval`` after the start of the one that committed (at once when that many
    have come). Every transaction has a fixed cost (PostgreSQL's ~150 µs for the send
    statement and its commit, bench/commit_cost.py; the server's statement, answers and
    reactor passes), and at a moderate rate on a quiet host a commit took a few sends
    each: 4.6 at 5,000 msgs/s, 1,088 commits a second. The wait bounds the commit rate by
    1 / ``interval`` there and adds at most ``interval`` less the commit's round trip to a
    send's latency; a commit slower than ``interval`` waits for nothing, and a send to an
    idle writer (a producer waiting for each answer) starts at once.
    """

    def __init__(
        self,
        workers: StepRunner | list[StepRunner] | tuple[StepRunner, ...],
        node_id: str,
        max_batch: int,
        on_health: Callable[[bool, str], None] = lambda ok, why: None,
        # the default stores sends (db.messages.SendFields: the broker's core.publish.Send),
        # each a StoredMessage or Misplaced; mypy cannot check a default against a
        # parameter typed by the class's type variables
        insert: Callable[..., Steps[Sequence[Outcome[ResultT]]]] = insert_messages_steps,  # type: ignore[assignment]
        on_unknown: Callable[[list[ItemT]], None] = lambda items: None,
        clock: Clock | None = None,
        writes: OwnWrites | None = None,
        parallel_min: int = PARALLEL_MIN,
        on_batch: Callable[[], None] = lambda: None,
        interval: float = 0.0,
    ):
        # ``insert(batch, node_id)``: steps (``db.steps.Statement``) returning one result per
        # item, run by a worker's ``run_steps`` (a DbWorker thread or a ReactorDb):
        # insert_messages_steps for sends; the delay table and dead letters reuse
        # the same group commit.
        self._insert = insert
        # ``reliable.horizon.OwnWrites`` for a writer that stores messages: each batch is
        # an open write of the incarnation ``writes.owner`` (passed to ``insert``) from
        # the moment it is sent until its sends were answered (so its messages are in
        # the channels); None for the delay table and dead letters
        self._writes = writes
        self._free: list[StepRunner] = list(workers) if isinstance(workers, (list, tuple)) else [workers]
        self._worker_count = len(self._free)
        self._node_id = node_id
        self._max_batch = max_batch
        self._parallel_min = max(1, min(parallel_min, max_batch))
        self._on_health = on_health
        self._on_unknown = on_unknown
        # called once a committed batch's items were each answered, before the batch's
        # write is settled (the store hands the batch's copies to its channels then)
        self._on_batch = on_batch
        # each queued message with the answer of its run and its place in the run
        self._queue: list[_Item[ItemT, ResultT]] = []
        # the same for serial runs, and whether a batch of them is under way
        self._serial: list[_Item[ItemT, ResultT]] = []
        self._serial_busy = False
        # parts of a refused batch, each run on its own until the bad rows are found,
        # each with whether it is serial
        self._isolated: list[tuple[list[_Item[ItemT, ResultT]], bool]] = []
        self._closing = False
        self._idle_waiters: list[Deferred[None]] = []
        self.batches = 0
        self.messages = 0
        # for /metrics: messages per committed batch and, with a clock, each batch's
        # round trip (statement sent to commit answered)
        self._clock = clock
        self.batch_sizes = Buckets(BATCH_SIZES)
        self.commit_seconds = Buckets(LATENCY_SECONDS)
        # the commit interval (with a clock; 0: none): the timer while the sends that arrived
        # during the only transaction wait for the next one's start (see the class)
        self._interval = interval if clock is not None else 0.0
        self._gathering: Timer | None = None

    @property
    def pending(self) -> int:
        return len(self._queue) + len(self._serial) + sum(len(part) for part, _ in self._isolated)

    @property
    def _busy(self) -> bool:
        return len(self._free) < self._worker_count

    def submit(self, message: ItemT) -> Deferred[ResultT]:
        """Deferred firing with its result (a StoredMessage) once committed, or a StorageError."""
        d: Deferred[ResultT] = Deferred()

        def done(outcome: Outcome[ResultT]) -> None:
            if isinstance(outcome, BaseException):
                d.errback(outcome)
            else:
                d.callback(outcome)

        self.submit_cb(message, done)
        return d

    def submit_cb(self, message: ItemT, done: Callable[[Outcome[ResultT]], None]) -> None:
        """Like submit, without a Deferred per message: ``done`` gets the StoredMessage,
        or the exception."""
        self.submit_run([message], lambda start, outcomes: done(outcomes[0]))

    def submit_run(self, messages: Sequence[ItemT], answer: Answer[ResultT], serial: bool = False) -> None:
        """Queue ``messages`` together (a batch starts with all of them waiting, not with
        the first alone); ``answer(start, outcomes)`` gets, for the messages from
        position ``start`` on, each one's StoredMessage or exception, in order. Each
        message is answered exactly once; a run is answered in one call, or in several
        when a batch ends inside it or a refused batch is split (the send path: one call
        per run of a read's sends instead of a callback per send). ``serial``: committed
        one transaction at a time with the other serial runs (see the class)."""
        if self._closing:
            answer(0, [ShuttingDown() for _ in messages])
            return
        items = [(message, answer, i) for i, message in enumerate(messages)]
        if serial:
            self._serial += items
        else:
            self._queue += items
        if self._free:
            self._kick()

    def _serial_ready(self) -> bool:
        return bool(self._serial) and not self._serial_busy

    def _next_part(self) -> tuple[list[_Item[ItemT, ResultT]], bool] | None:
        """The refused batch's part to run next: the first one that may run now (a serial
        part only while no serial batch is under way)."""
        for i, (part, serial) in enumerate(self._isolated):
            if not serial or not self._serial_busy:
                del self._isolated[i]
                return part, serial
        return None

    def _kick(self) -> None:
        while self._free and (self._queue or self._isolated or self._serial_ready()):
            isolated = self._next_part() if self._isolated else None
            serial = False
            if isolated is not None:
                batch, serial = isolated
            elif self._serial_ready() and (not self._busy or len(self._serial) >= self._parallel_min):
                # serial sends, alone in their transaction (before the others: fewer wait on them)
                batch, serial = self._take(self._serial), True
            elif self._queue and not (
                (self._busy or self._gathering is not None) and len(self._queue) < self._parallel_min
            ):
                batch = self._take(self._queue)
                if self._gathering is not None:
                    self._gathering.cancel()
                    self._gathering = None
            else:
                break  # too few for a transaction of their own: they go with the next one
            if serial:
                self._serial_busy = True
            worker = self._free.pop()
            started = self._clock.seconds() if self._clock is not None else 0.0
            writes = self._writes
            if writes is None:
                token = 0
                d = worker.run_steps(self._insert, [item[0] for item in batch], self._node_id)
            else:
                token = writes.begin()
                d = worker.run_steps(self._insert, [item[0] for item in batch], self._node_id, writes.owner)
            d.addCallbacks(
                self._committed,
                self._failed,
                callbackArgs=(batch, worker, started, token, serial),
                errbackArgs=(batch, worker, token, serial),
            )
        if not self._busy and not self._queue and not self._isolated and not self._serial:
            waiters, self._idle_waiters = self._idle_waiters, []
            for w in waiters:
                w.callback(None)

    def _take(self, queue: list[_Item[ItemT, ResultT]]) -> list[_Item[ItemT, ResultT]]:
        """The next batch from the front of ``queue``, taken out of it."""
        end = self._max_batch
        if len(queue) > end:
            # a batch ends before a run it would cut (the run's first item is
            # ``position`` places before the cut), unless the run alone is longer
            # than a batch: one comparison a batch, nothing a message
            start = end - queue[end][2]
            if start > 0:
                end = start
        batch = queue[:end]
        del queue[:end]
        return batch

    def _committed(
        self,
        results: Sequence[Outcome[ResultT]],
        batch: list[_Item[ItemT, ResultT]],
        worker: StepRunner,
        started: float,
        token: int,
        serial: bool = False,
    ) -> None:
        self._free.append(worker)
        if serial:
            self._serial_busy = False
        self.batches += 1
        self.messages += len(batch)
        self.batch_sizes.observe(len(batch))
        if self._clock is not None:
            self.commit_seconds.observe(self._clock.seconds() - started)
        self._on_health(True, "")
        if self._interval and 0 < len(self._queue) < self._parallel_min and not self._busy and not self._closing:
            assert self._clock is not None
            wait = started + self._interval - self._clock.seconds()
            if wait > 0:
                self._gathering = self._clock.callLater(wait, self._gathered)
        # Start the next transaction before answering this batch, so PostgreSQL
        # works on it while the reactor writes the acknowledgements.
        if self._queue or self._isolated or self._serial:
            self._kick()
        _answer(batch, results)
        try:
            self._on_batch()
        except Exception:
            log.failure("handing a committed batch on failed")
        writes = self._writes
        if writes is not None:  # the batch's messages are in the channels: settled
            for stored in results:
                if isinstance(stored, StoredMessage):  # a Misplaced send stored nothing
                    writes.seen(stored.message_id)
            writes.end(token)
        self._kick()  # takes sends that arrived meanwhile, or wakes close() waiters

    def _gathered(self) -> None:
        self._gathering = None
        self._kick()

    def _failed(self, failure: Failure, batch: list[_Item[ItemT, ResultT]], worker: StepRunner, token: int,
                serial: bool = False) -> None:
        self._free.append(worker)
        if serial:
            self._serial_busy = False
        error = failure.value
        writes = self._writes
        if isinstance(error, (RefusedError, Fenced)):
            if writes is not None:
                writes.end(token)  # nothing of it was committed
            if isinstance(error, Fenced):
                self._fenced(error, batch)
            else:
                self._refused(error, batch, serial)
            return
        if writes is not None:  # may still commit until the backend that ran it is gone
            writes.hold(token, getattr(error, "backend_pid", None))
        if not isinstance(error, StorageError):
            log.failure("unexpected error in group commit", failure)
            error = StorageError(f"internal error: {error!r}")
        self._on_health(False, str(error))
        _answer(batch, [StorageError(str(error)) for _ in batch])
        try:
            self._on_unknown([item[0] for item in batch])
        except Exception:
            log.failure("handling a batch of unknown outcome failed")
        self._kick()

    def _fenced(self, error: Fenced, batch: list[_Item[ItemT, ResultT]]) -> None:
        """This incarnation was retired: nothing was stored, nothing ever will be."""
        self._on_health(False, str(error))
        _answer(batch, [error] * len(batch))
        self._kick()

    def _refused(self, error: RefusedError, batch: list[_Item[ItemT, ResultT]], serial: bool = False) -> None:
        """PostgreSQL refused the batch's input: nothing committed. Split it until
        the refused rows stand alone; only their sends fail."""
        if len(batch) == 1:
            log.warn("a send was refused by PostgreSQL: {why}", why=error)
            _answer(batch, [RefusedError(f"message refused by PostgreSQL: {error}", error.sqlstate)])
        else:
            half = len(batch) // 2
            self._isolated[:0] = [(batch[:half], serial), (batch[half:], serial)]
        self._kick()

    def close(self) -> Deferred[None]:
        """Refuse new sends; fires when everything queued has been answered."""
        self._closing = True
        if self._gathering is not None:
            self._gathering.cancel()
            self._gathering = None
            self._kick()
        if not self._busy and not self._queue and not self._isolated and not self._serial:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._idle_waiters.append(d)
        return d


@dataclass(frozen=True, slots=True)
class RunOps(Generic[ItemT]):
    """How a batcher's items that are runs (the durable acks' ``AckRun``s) count, split
    and join: each holds ``length(item)`` of what ``max_batch`` counts, is split
    (``split(item, at)``) where a batch ends, and takes in the next one when they share
    what a run shares (``absorb(last, next)``). The item class's own methods, called
    unbound: no more calls than the methods' own."""

    length: Callable[[ItemT], int]
    split: Callable[[ItemT, int], tuple[ItemT, ItemT]]
    absorb: Callable[[ItemT, ItemT], bool]


class RetryingBatcher(Generic[ItemT, ResultT]):
    """Items collected for ``interval`` (or ``max_batch`` of them) go to
    ``db.run_steps(fn, batch, *args(batch))``; a failed batch is retried with a growing
    pause, because what it records (attempts, exhausted copies, acks) must not be lost
    while the server runs. ``on_done(batch, result)`` runs after each commit."""

    def __init__(
        self,
        db: StepRunner,
        clock: Clock,
        fn: Callable[..., Steps[ResultT]],
        *,
        interval: float,
        max_batch: int,
        on_done: Callable[[list[ItemT], ResultT], None] = lambda batch, result: None,
        name: str = "batch",
        args: Callable[[list[ItemT]], tuple[object, ...]] = lambda batch: (),
        runs: RunOps[ItemT] | None = None,
    ):
        self.db = db
        # items that are runs (``RunOps``), or None: each item counts one
        self._runs = runs
        self._args = args  # more arguments for ``fn``, computed when the batch is sent
        self._run = db.run_steps
        self.clock = clock
        self.fn = fn
        self.interval = interval
        self.max_batch = max_batch
        self.on_done = on_done
        self.name = name
        self._queue: list[ItemT] = []
        self._queued = 0  # what max_batch counts: items, or the runs' lengths
        self._timer: Timer | None = None
        self._busy = False
        self._retry = 0.0
        self._idle: list[Deferred[None]] = []
        self._outage = Outage(name, clock, wake=self._wake)
        self.done = 0
        # what max_batch counts, per committed batch (the acker's: /metrics dmq_ack_batch_size)
        self.batch_sizes = Buckets(BATCH_SIZES)

    @property
    def pending(self) -> int:
        return self._queued

    def _size(self, items: list[ItemT]) -> int:
        runs = self._runs
        return sum(map(runs.length, items)) if runs is not None else len(items)

    def add(self, item: ItemT) -> None:
        self.add_many([item])

    def add_many(self, items: list[ItemT]) -> None:
        """``add`` of each, with the flush decided once."""
        queue, runs = self._queue, self._runs
        if runs is not None and len(items) == 1 and queue and runs.absorb(queue[-1], items[0]):
            pass  # one more ack of the run queued last (taken off the queue, a run is not changed)
        else:
            queue += items
        self._queued += self._size(items)
        if self._busy or self._retry or not items:
            return
        if self._queued >= self.max_batch:
            self._flush()
        elif self._timer is None:
            self._timer = self.clock.callLater(self.interval, self._flush)

    def discard(self, unwanted: Callable[[ItemT], bool]) -> int:
        """Take the queued items ``unwanted`` picks off the queue (a batch being sent is
        not queued: its outcome comes as ever); returns what ``max_batch`` counts of them.
        The acker's, for a sought channel's acks (``ReliableStore.reseek``)."""
        kept = [item for item in self._queue if not unwanted(item)]
        gone = self._queued - self._size(kept)
        self._queue, self._queued = kept, self._queued - gone
        return gone

    def _take(self) -> list[ItemT]:
        """The next batch off the queue's front: ``max_batch`` items, or runs holding
        that many, the last one split if it holds more."""
        queue, limit, runs = self._queue, self.max_batch, self._runs
        if runs is None:
            batch, self._queue = queue[:limit], queue[limit:]
        else:
            count = taken = 0
            while taken < len(queue) and count < limit:
                count += runs.length(queue[taken])
                taken += 1
            batch, self._queue = queue[:taken], queue[taken:]
            if count > limit:  # the last run passes the limit: its rest stays first in line
                batch[-1], rest = runs.split(batch[-1], runs.length(batch[-1]) - (count - limit))
                self._queue.insert(0, rest)
        self._queued -= self._size(batch)
        return batch

    def _flush(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self._busy:
            return
        if not self._queue:
            waiters, self._idle = self._idle, []
            for w in waiters:
                w.callback(None)
            return
        batch = self._take()
        self._busy = True
        d = self._run(self.fn, batch, *self._args(batch))
        d.addCallbacks(self._flushed, self._failed, callbackArgs=(batch,), errbackArgs=(batch,))

    def _flushed(self, result: ResultT, batch: list[ItemT]) -> None:
        self._busy = False
        self._retry = 0.0
        self._outage.recovered()
        size = self._size(batch)
        self.done += size
        self.batch_sizes.observe(size)
        try:
            self.on_done(batch, result)
        except Exception:
            log.failure("{name}: completion failed", name=self.name)
        self._flush()

    def _failed(self, failure: Failure, batch: list[ItemT]) -> None:
        self._busy = False
        self._outage.failed(failure.value)
        self._queue[:0] = batch
        self._queued += self._size(batch)
        self._retry = min(max(self._retry * 2, 0.1), 5.0)
        if self._timer is None:
            self._timer = self.clock.callLater(self._retry, self._retry_now)

    def _retry_now(self) -> None:
        self._timer = None
        self._flush()

    def _wake(self) -> None:
        """PostgreSQL works again for another component: a retry waiting on its backoff
        goes now (nothing happens if none waits)."""
        timer = self._timer
        if self._retry and timer is not None and timer.active():
            timer.cancel()
            self._retry_now()

    def drain(self) -> Deferred[None]:
        if not self._queue and not self._busy:
            return succeed(None)
        d: Deferred[None] = Deferred()
        self._idle.append(d)
        if not self._busy and not self._retry:
            self._flush()
        return d

    def stop(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        self._outage.close()


class AckBatcher(RetryingBatcher[AckRun, list[tuple[str, str, int]]]):
    """Durable acknowledgements in batches of ``AckRun``s (``max_batch`` counts acks, and
    a run is split where a batch ends): the channels' cursors move and the acks are
    logged. ``progress(batch)`` gives the ``CursorProgress`` list, the holder and whether
    the cursors are fenced (a cluster), computed when the batch is sent (again if it is
    sent again), from what the channels hold then. ``on_done(batch, taken)`` runs after
    each commit, ``taken`` naming the (topic, channel, owner) cursors another node holds,
    whose acks did not become durable."""

    def __init__(
        self,
        worker: StepRunner,
        clock: Clock,
        max_batch: int,
        flush_interval: float,
        on_done: Callable[[list[AckRun], list[tuple[str, str, int]]], None],
        progress: Callable[[list[AckRun]], tuple[object, ...]] = lambda batch: ((), ""),
    ):
        super().__init__(
            worker,
            clock,
            ack_deliveries_steps,
            interval=flush_interval,
            max_batch=max_batch,
            on_done=on_done,
            name="durable ack",
            args=progress,
            runs=RunOps(AckRun.__len__, AckRun.split, AckRun.absorb),
        )

    @property
    def acked(self) -> int:
        return self.done
