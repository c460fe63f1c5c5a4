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

from typing import Any, Callable

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_server.core.buckets import BATCH_SIZES, LATENCY_SECONDS, Buckets
from dmq_server.core.clock import Clock
from dmq_server.core.errors import ShuttingDown
from dmq_server.db.outage import Outage
from dmq_server.db.storage_errors import Fenced, RefusedError, StorageError
from dmq_server.db.messages import AckRun, NewMessage, ack_deliveries_steps, insert_messages_steps

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


# ``answer(start, outcomes)``: the outcomes of a run's messages from position ``start`` on
Answer = Callable[[int, list], None]
# a queued message, the answer of its run, its position in the run
_Item = tuple[NewMessage, Answer, int]


def _answer(batch: list[_Item], outcomes: list) -> None:
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


class GroupCommitWriter:
    """Group commit over one or more writer connections.

    With several workers, batches commit concurrently (PostgreSQL merges their
    WAL flushes), so message ids may commit slightly out of order; the channel
    copes with that (see ``ReliableChannel.add``). A further transaction starts
    while one is in flight only for at least ``parallel_min`` waiting sends.
    """

    def __init__(
        self,
        workers: Any,
        node_id: str,
        max_batch: int,
        on_health: Callable[[bool, str], None] = lambda ok, why: None,
        insert: Callable[..., Any] = insert_messages_steps,
        on_unknown: Callable[[list[Any]], None] = lambda items: None,
        clock: Clock | None = None,
        writes: Any = None,
        parallel_min: int = PARALLEL_MIN,
        on_batch: Callable[[], None] = lambda: None,
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
        self._free: list[Any] = list(workers) if isinstance(workers, (list, tuple)) else [workers]
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
        self._queue: list[_Item] = []
        # parts of a refused batch, each run on its own until the bad rows are found
        self._isolated: list[list[_Item]] = []
        self._closing = False
        self._idle_waiters: list[Deferred] = []
        self.batches = 0
        self.messages = 0
        # for /metrics: messages per committed batch and, with a clock, each batch's
        # round trip (statement sent to commit answered)
        self._clock = clock
        self.batch_sizes = Buckets(BATCH_SIZES)
        self.commit_seconds = Buckets(LATENCY_SECONDS)

    @property
    def pending(self) -> int:
        return len(self._queue) + sum(len(part) for part in self._isolated)

    @property
    def _busy(self) -> bool:
        return len(self._free) < self._worker_count

    def submit(self, message: NewMessage) -> Deferred:
        """Deferred firing with a StoredMessage once committed, or a StorageError."""
        d: Deferred = Deferred()

        def done(outcome: Any) -> None:
            if isinstance(outcome, BaseException):
                d.errback(outcome)
            else:
                d.callback(outcome)

        self.submit_cb(message, done)
        return d

    def submit_cb(self, message: NewMessage, done: Callable[[Any], None]) -> None:
        """Like submit, without a Deferred per message: ``done`` gets the StoredMessage,
        or the exception."""
        self.submit_run([message], lambda start, outcomes: done(outcomes[0]))

    def submit_run(self, messages: list[NewMessage], answer: Answer) -> None:
        """Queue ``messages`` together (a batch starts with all of them waiting, not with
        the first alone); ``answer(start, outcomes)`` gets, for the messages from
        position ``start`` on, each one's StoredMessage or exception, in order. Each
        message is answered exactly once; a run is answered in one call, or in several
        when a batch ends inside it or a refused batch is split (the send path: one call
        per run of a read's sends instead of a callback per send)."""
        if self._closing:
            answer(0, [ShuttingDown() for _ in messages])
            return
        self._queue += [(message, answer, i) for i, message in enumerate(messages)]
        if self._free:
            self._kick()

    def _kick(self) -> None:
        while self._free and (self._queue or self._isolated):
            if self._busy and not self._isolated and len(self._queue) < self._parallel_min:
                break  # too few for a transaction of their own: they go with the next one
            worker = self._free.pop()
            if self._isolated:
                batch = self._isolated.pop(0)
            else:
                batch = self._queue[: self._max_batch]
                del self._queue[: self._max_batch]
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
                callbackArgs=(batch, worker, started, token),
                errbackArgs=(batch, worker, token),
            )
        if not self._busy and not self._queue and not self._isolated:
            waiters, self._idle_waiters = self._idle_waiters, []
            for w in waiters:
                w.callback(None)

    def _committed(self, results: list, batch: list, worker: Any, started: float, token: int) -> None:
        self._free.append(worker)
        self.batches += 1
        self.messages += len(batch)
        self.batch_sizes.observe(len(batch))
        if self._clock is not None:
            self.commit_seconds.observe(self._clock.seconds() - started)
        self._on_health(True, "")
        # Start the next transaction before answering this batch, so PostgreSQL
        # works on it while the reactor writes the acknowledgements.
        if self._queue or self._isolated:
            self._kick()
        _answer(batch, results)
        try:
            self._on_batch()
        except Exception:
            log.failure("handing a committed batch on failed")
        writes = self._writes
        if writes is not None:  # the batch's messages are in the channels: settled
            for stored in results:
                if not isinstance(stored, BaseException):  # a Misplaced send stored nothing
                    writes.seen(stored.message_id)
            writes.end(token)
        self._kick()  # takes sends that arrived meanwhile, or wakes close() waiters

    def _failed(self, failure: Failure, batch: list, worker: Any, token: int) -> None:
        self._free.append(worker)
        error = failure.value
        writes = self._writes
        if isinstance(error, (RefusedError, Fenced)):
            if writes is not None:
                writes.end(token)  # nothing of it was committed
            if isinstance(error, Fenced):
                self._fenced(error, batch)
            else:
                self._refused(error, batch)
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

    def _fenced(self, error: Fenced, batch: list) -> None:
        """This incarnation was retired: nothing was stored, nothing ever will be."""
        self._on_health(False, str(error))
        _answer(batch, [error] * len(batch))
        self._kick()

    def _refused(self, error: RefusedError, batch: list) -> None:
        """PostgreSQL refused the batch's input: nothing committed. Split it until
        the refused rows stand alone; only their sends fail."""
        if len(batch) == 1:
            log.warn("a send was refused by PostgreSQL: {why}", why=error)
            _answer(batch, [RefusedError(f"message refused by PostgreSQL: {error}", error.sqlstate)])
        else:
            half = len(batch) // 2
            self._isolated[:0] = [batch[:half], batch[half:]]
        self._kick()

    def close(self) -> Deferred:
        """Refuse new sends; fires when everything queued has been answered."""
        self._closing = True
        if not self._busy and not self._queue and not self._isolated:
            return succeed(None)
        d: Deferred = Deferred()
        self._idle_waiters.append(d)
        return d


class RetryingBatcher:
    """Items collected for ``interval`` (or ``max_batch`` of them) go to
    ``db.run(fn, batch)`` (``db.run_steps`` if ``fn`` is steps, ``steps=True``); a
    failed batch is retried with a growing pause, because what it records
    (attempts, exhausted copies, acks) must not be lost while the server runs.
    ``on_done(batch, result)`` runs after each commit."""

    def __init__(
        self,
        db: Any,
        clock: Clock,
        fn: Callable[[Any, list], Any],
        *,
        interval: float,
        max_batch: int,
        on_done: Callable[[list, Any], None] = lambda batch, result: None,
        name: str = "batch",
        steps: bool = False,
        args: Callable[[list], tuple] = lambda batch: (),
        runs: bool = False,
    ):
        self.db = db
        # ``runs``: each item holds ``len(item)`` of what ``max_batch`` counts, splits
        # (``item.split(at)``) where a batch ends, and takes in the next one when they
        # share what a run shares (``item.absorb(next)``): the durable acks' ``AckRun``s
        self._runs = runs
        self._args = args  # more arguments for ``fn``, computed when the batch is sent
        self._run = db.run_steps if steps else db.run
        self.clock = clock
        self.fn = fn
        self.interval = interval
        self.max_batch = max_batch
        self.on_done = on_done
        self.name = name
        self._queue: list = []
        self._queued = 0  # what max_batch counts: items, or the runs' lengths
        self._timer: Any = None
        self._busy = False
        self._retry = 0.0
        self._idle: list[Deferred] = []
        self._outage = Outage(name, clock)
        self.done = 0
        # what max_batch counts, per committed batch (the acker's: /metrics dmq_ack_batch_size)
        self.batch_sizes = Buckets(BATCH_SIZES)

    @property
    def pending(self) -> int:
        return self._queued

    def _size(self, items: list) -> int:
        return sum(map(len, items)) if self._runs else len(items)

    def add(self, item: Any) -> None:
        self.add_many([item])

    def add_many(self, items: list) -> None:
        """``add`` of each, with the flush decided once."""
        queue = self._queue
        if self._runs and len(items) == 1 and queue and queue[-1].absorb(items[0]):
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

    def _take(self) -> list:
        """The next batch off the queue's front: ``max_batch`` items, or runs holding
        that many, the last one split if it holds more."""
        queue, limit = self._queue, self.max_batch
        if not self._runs:
            batch, self._queue = queue[:limit], queue[limit:]
        else:
            count = taken = 0
            while taken < len(queue) and count < limit:
                count += len(queue[taken])
                taken += 1
            batch, self._queue = queue[:taken], queue[taken:]
            if count > limit:  # the last run passes the limit: its rest stays first in line
                batch[-1], rest = batch[-1].split(len(batch[-1]) - (count - limit))
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

    def _flushed(self, result: Any, batch: list) -> None:
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

    def _failed(self, failure: Failure, batch: list) -> None:
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

    def drain(self) -> Deferred:
        if not self._queue and not self._busy:
            return succeed(None)
        d: Deferred = Deferred()
        self._idle.append(d)
        if not self._busy and not self._retry:
            self._flush()
        return d

    def stop(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None


class AckBatcher(RetryingBatcher):
    """Durable acknowledgements in batches of ``AckRun``s (``max_batch`` counts acks, and
    a run is split where a batch ends): the channels' cursors move and the acks are
    logged. ``progress(batch)`` gives the ``CursorProgress`` list, the holder and whether
    the cursors are fenced (a cluster), computed when the batch is sent (again if it is
    sent again), from what the channels hold then. ``on_done(batch, taken)`` runs after
    each commit, ``taken`` naming the (topic, channel, owner) cursors another node holds,
    whose acks did not become durable."""

    def __init__(
        self,
        worker: Any,
        clock: Clock,
        max_batch: int,
        flush_interval: float,
        on_done: Callable[[list[AckRun], list], None],
        progress: Callable[[list[AckRun]], tuple] = lambda batch: ((), ""),
    ):
        super().__init__(
            worker,
            clock,
            ack_deliveries_steps,
            interval=flush_interval,
            max_batch=max_batch,
            on_done=on_done,
            name="durable ack",
            steps=True,
            args=progress,
            runs=True,
        )

    @property
    def acked(self) -> int:
        return self.done
