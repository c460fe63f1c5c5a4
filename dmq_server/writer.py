"""Batchers between the reactor and PostgreSQL: group commit and durable acks.

``GroupCommitWriter``: sends queue up while one transaction is in progress and
go together in the next, so the commit rate (bounded by fsync) does not bound
the message rate. Each send's Deferred fires only after *its* transaction
committed, which is when the producer may be told SEND_SUCCESS_ACK.

``AckBatcher``: acknowledgements are applied in batches too; a failed batch is
retried (with a growing pause) until PostgreSQL answers again, because the
consumer has already been told nothing, and losing the ack would only cause a
redelivery after a restart.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger

from .store import AckRow, DbWorker, NewMessage, StorageError, ack_deliveries, insert_messages

__all__ = ["GroupCommitWriter", "AckBatcher", "ShuttingDown"]

log = Logger()


class ShuttingDown(Exception):
    """The server is stopping and takes no new sends."""


class GroupCommitWriter:
    def __init__(
        self,
        worker: DbWorker,
        node_id: str,
        max_batch: int,
        on_health: Callable[[bool, str], None] = lambda ok, why: None,
    ):
        self._worker = worker
        self._node_id = node_id
        self._max_batch = max_batch
        self._on_health = on_health
        self._queue: list[tuple[NewMessage, Deferred]] = []
        self._busy = False
        self._closing = False
        self._idle_waiters: list[Deferred] = []
        self.batches = 0
        self.messages = 0

    @property
    def pending(self) -> int:
        return len(self._queue)

    def submit(self, message: NewMessage) -> Deferred:
        """Deferred firing with a StoredMessage once committed, or a StorageError."""
        if self._closing:
            from twisted.internet.defer import fail

            return fail(ShuttingDown("server is shutting down"))
        d: Deferred = Deferred()
        self._queue.append((message, d))
        self._kick()
        return d

    def _kick(self) -> None:
        if self._busy or not self._queue:
            if not self._busy and not self._queue:
                waiters, self._idle_waiters = self._idle_waiters, []
                for w in waiters:
                    w.callback(None)
            return
        batch = self._queue[: self._max_batch]
        del self._queue[: self._max_batch]
        self._busy = True
        d = self._worker.run(insert_messages, [m for m, _ in batch], self._node_id)
        d.addCallbacks(self._committed, self._failed, callbackArgs=(batch,), errbackArgs=(batch,))

    def _committed(self, results: list, batch: list) -> None:
        self._busy = False
        self.batches += 1
        self.messages += len(batch)
        self._on_health(True, "")
        for (_, d), stored in zip(batch, results):
            d.callback(stored)
        self._kick()

    def _failed(self, failure: Any, batch: list) -> None:
        self._busy = False
        error = failure.value
        if not isinstance(error, StorageError):
            log.failure("unexpected error in group commit", failure)
            error = StorageError(f"internal error: {error!r}")
        self._on_health(False, str(error))
        for _, d in batch:
            d.errback(StorageError(str(error)))
        self._kick()

    def close(self) -> Deferred:
        """Refuse new sends; fires when everything queued has been answered."""
        self._closing = True
        if not self._busy and not self._queue:
            return succeed(None)
        d: Deferred = Deferred()
        self._idle_waiters.append(d)
        return d


class AckBatcher:
    def __init__(
        self,
        worker: DbWorker,
        clock: Any,
        max_batch: int,
        flush_interval: float,
        on_done: Callable[[list[AckRow], bool], None],
    ):
        self._worker = worker
        self._clock = clock
        self._max_batch = max_batch
        self._flush_interval = flush_interval
        self._on_done = on_done
        self._queue: list[AckRow] = []
        self._busy = False
        self._timer: Any = None
        self._retry_delay = 0.0
        self._idle_waiters: list[Deferred] = []
        self.acked = 0

    @property
    def pending(self) -> int:
        return len(self._queue)

    def add(self, row: AckRow) -> None:
        self._queue.append(row)
        if len(self._queue) >= self._max_batch:
            self._flush()
        elif self._timer is None and not self._busy:
            self._timer = self._clock.callLater(self._flush_interval, self._flush)

    def _flush(self) -> None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        if self._busy:
            return
        if not self._queue:
            waiters, self._idle_waiters = self._idle_waiters, []
            for w in waiters:
                w.callback(None)
            return
        batch = self._queue[: self._max_batch]
        del self._queue[: self._max_batch]
        self._busy = True
        d = self._worker.run(ack_deliveries, batch)
        d.addCallbacks(self._flushed, self._failed, callbackArgs=(batch,), errbackArgs=(batch,))

    def _flushed(self, _: Any, batch: list[AckRow]) -> None:
        self._busy = False
        self._retry_delay = 0.0
        self.acked += len(batch)
        self._on_done(batch, True)
        if self._queue:
            self._flush()
        else:
            self._flush()  # fires idle waiters

    def _failed(self, failure: Any, batch: list[AckRow]) -> None:
        self._busy = False
        log.warn("durable ack of {n} failed, will retry: {why}", n=len(batch), why=failure.value)
        self._queue[:0] = batch
        self._retry_delay = min(max(self._retry_delay * 2, 0.1), 5.0)
        if self._timer is None:
            self._timer = self._clock.callLater(self._retry_delay, self._flush)

    def drain(self) -> Deferred:
        """Fires once every queued ack is durable (or the caller gives up waiting)."""
        if not self._queue and not self._busy:
            return succeed(None)
        d: Deferred = Deferred()
        self._idle_waiters.append(d)
        if not self._busy:
            self._flush()
        return d
