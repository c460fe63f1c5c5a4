"""The message trace's writer: deliveries that came back unacknowledged, in batches.

A channel reports each copy that returns before its ack (``reliable.channel``: the
message timeout passed, the consumer went away, the consumer gave it back with REQ)
together with the consumer that held it. That is the exceptional path: a message
delivered once and acknowledged writes nothing here (its durable ack names the consumer,
``db.messages.AckRun``), so the reliable path's cost per message does not change.

Returns are diagnostic facts, not the promise: while PostgreSQL is down they wait in a
queue of at most ``max_pending`` rows and later ones are counted and dropped, so a long
outage with a consumer timing out in a loop cannot grow the server's memory.
"""

from __future__ import annotations

from functools import partial
from typing import TypedDict

from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_server.core.clock import Clock
from dmq_server.db.runner import StepRunner
from dmq_server.db.storage_errors import StorageError
from dmq_server.db.trace_steps import ReturnRow, record_returns_steps, sweep_trace_steps
from dmq_server.reliable.channel import Delivery, ReliableChannel
from dmq_server.reliable.writer import RetryingBatcher

__all__ = ["TraceSink"]

log = Logger()


class TraceStats(TypedDict):
    """``TraceSink.stats``: returns counted by reason, rows waiting, written and dropped."""

    returned: dict[str, int]
    pending: int
    written: int
    dropped: int


class TraceSink:
    """Collects returned deliveries (``returned`` is a channel's ``on_return``) and writes
    them on ``db`` in batches; ``sweep`` drops rows past the retention."""

    def __init__(
        self,
        db: StepRunner,
        clock: Clock,
        node_id: str,
        *,
        max_pending: int = 10000,
        batch_size: int = 2000,
        flush_interval: float = 0.1,
    ):
        self.db = db
        self.clock = clock
        self.max_pending = max_pending
        # the rows written, per batch
        self.batcher: RetryingBatcher[ReturnRow, int] = RetryingBatcher(
            db, clock, partial(record_returns_steps, node_id=node_id), interval=flush_interval,
            max_batch=batch_size, name="message trace",
        )
        self.dropped = 0
        self.counts: dict[str, int] = {}
        self._sweeping = False

    def returned(self, channel: ReliableChannel, delivery: Delivery, reason: str) -> None:
        self.counts[reason] = self.counts.get(reason, 0) + 1
        if self.batcher.pending >= self.max_pending:
            self.dropped += 1
            return
        self.batcher.add(
            ReturnRow(
                delivery.message.message_id,
                channel.topic,
                channel.name,
                delivery.attempts,
                reason,
                getattr(delivery.consumer, "name", ""),
                int(delivery.delivered_at * 1000),
                int(self.clock.seconds() * 1000),
            )
        )

    def sweep(self, retention_s: float, limit: int = 10000) -> Deferred[int]:
        """Drop one batch of returns older than ``retention_s``; fires with how many."""
        d = self.db.run_steps(sweep_trace_steps, retention_s, limit)

        def quiet(failure: Failure) -> int:
            failure.trap(StorageError)  # the next sweep tries again; outages are logged elsewhere
            return 0

        return d.addErrback(quiet)

    def close(self) -> Deferred[None]:
        return self.batcher.drain()

    def stats(self) -> TraceStats:
        return {
            "returned": dict(sorted(self.counts.items())),
            "pending": self.batcher.pending,
            "written": self.batcher.done,
            "dropped": self.dropped,
        }
