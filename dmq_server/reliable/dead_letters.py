"""Dead letters: how messages get there, in batches, off the reactor thread.

Reasons (the ``dmq_dead_letter.reason`` check): ``rate_limited`` (a send over its
topic's rate limit, recorded before the producer hears SEND_EXCEED_LIMIT_ACK),
``expired`` (a copy not acknowledged within its topic's time to live; a periodic
sweep moves them, and the in-memory channel drops them), ``max_attempts`` (a copy
delivered the topic's maximum number of times without an acknowledgement),
``client_reported`` (a send the client library could not store, reported once
storage works again), ``storage_failure`` and ``operator`` (a delayed or replayed
message whose channels were all unregistered when it fell due). Each keeps its message's
key, priority and headers (``NewDeadLetter.properties``; the statements copy a stored
message's), so that a replay delivers the message as it was sent.

Reading, replaying and deleting dead letters is ``dmq_server.admin.operations``; the
statements are ``dmq_server.db.dead_letter_steps`` (re-exported here).
"""

from __future__ import annotations

from typing import Callable

from twisted.internet.defer import Deferred, succeed
from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_server.core.clock import Clock
from dmq_server.db.dead_letter_steps import (
    CopyRef,
    NewDeadLetter,
    exhaust_deliveries_steps,
    expire_deliveries_steps,
    insert_dead_letters_steps,
    open_ttl_cursors_steps,
    record_attempts_steps,
)
from dmq_server.db.outage import Outage
from dmq_server.db.runner import StepRunner
from dmq_server.reliable.channel import Delivery, ReliableChannel
from dmq_server.reliable.writer import GroupCommitWriter, Outcome, RetryingBatcher

# the statements and their values live in dmq_server.db.dead_letter_steps
__all__ = ["DeadLetterSink"]

log = Logger()

class DeadLetterSink:
    """The broker's side of dead letters: rate-limited sends, attempts, exhausted and
    expired copies. ``channel(topic, name)`` finds an in-memory channel (or None)."""

    def __init__(
        self,
        db: StepRunner,
        clock: Clock,
        node_id: str,
        channel: Callable[[str, str], ReliableChannel | None],
        *,
        batch_size: int = 2000,
        flush_interval: float = 0.05,
        expiry_batch: int = 5000,
        fenced: Callable[[], bool] = lambda: False,
    ):
        self.db = db
        self.clock = clock
        self._sweep_outage = Outage("expiry sweep", clock)
        self.node_id = node_id
        self._channel = channel
        self.expiry_batch = expiry_batch
        # each dead letter's id
        self.writer: GroupCommitWriter[NewDeadLetter, int] = GroupCommitWriter(
            [db], node_id, batch_size, insert=insert_dead_letters_steps
        )
        # how many of the copies were still stored
        self.attempts: RetryingBatcher[CopyRef, int] = RetryingBatcher(
            db, clock, record_attempts_steps, interval=flush_interval, max_batch=batch_size,
            name="attempts",
        )
        # the (topic, channel, message id) of the copies that were still waiting
        self.exhausted: RetryingBatcher[CopyRef, list[tuple[str, str, int]]] = RetryingBatcher(
            db,
            clock,
            exhaust_deliveries_steps,
            interval=flush_interval,
            max_batch=batch_size,
            on_done=self._exhausted_done,
            name="max-attempts dead letters",
            # the holder named by a cursor this opens; in a cluster, only cursors it holds
            args=lambda batch: (node_id, fenced()),
        )
        self._fenced = fenced
        self._sweeping = False
        self.counts: dict[str, int] = {}

    # -- recording ---------------------------------------------------------------
    def record(self, letter: NewDeadLetter, done: Callable[[Outcome[int]], None]) -> None:
        """Record one dead letter (group commit); ``done`` gets its id or the exception."""

        def committed(outcome: Outcome[int]) -> None:
            if not isinstance(outcome, BaseException):
                self.counts[letter.reason] = self.counts.get(letter.reason, 0) + 1
            done(outcome)

        self.writer.submit_cb(letter, committed)

    def on_attempt(self, channel: ReliableChannel, delivery: Delivery) -> None:
        message = delivery.message
        self.attempts.add(CopyRef(channel.topic, channel.name, message.message_id, delivery.attempts, message.owner))

    def on_exhausted(self, channel: ReliableChannel, delivery: Delivery) -> None:
        message = delivery.message
        self.exhausted.add(CopyRef(channel.topic, channel.name, message.message_id, delivery.attempts, message.owner,
                                   channel.epoch))

    def _exhausted_done(self, batch: list[CopyRef], rows: list[tuple[str, str, int]]) -> None:
        self.counts["max_attempts"] = self.counts.get("max_attempts", 0) + len(rows)
        for ref in batch:
            ch = self._channel(ref.topic, ref.channel)
            if ch is not None and ref.epoch >= ch.epoch:  # (sought since: ``reseek`` forgot it)
                ch.ack_durable([ref.message_id])  # its row is gone: forget it

    # -- expiry ------------------------------------------------------------------
    def sweep_expired(self) -> Deferred[int]:
        """Move one batch of expired copies to dead letters; again at once while full.
        The cursors to lock are opened and committed first, in a transaction of their
        own (``open_ttl_cursors_steps`` says why). In a cluster only the copies of
        cursors this node holds: the node that holds a copy in memory is the one that
        must drop it (``_drop``), or it would go on pushing a dead letter."""
        if self._sweeping:
            return succeed(0)
        self._sweeping = True
        now_ms = int(self.clock.seconds() * 1000)
        d = self.db.run_steps(open_ttl_cursors_steps).addCallback(
            lambda _: self.db.run_steps(expire_deliveries_steps, now_ms, self.expiry_batch, self.node_id,
                                        self._fenced()))

        def swept(rows: list[tuple[str, str, int]]) -> int | Deferred[int]:
            self._sweeping = False
            self._sweep_outage.recovered()
            self._drop(rows)
            if len(rows) >= self.expiry_batch:
                return self.sweep_expired().addCallback(lambda n: n + len(rows))
            return len(rows)

        def failed(failure: Failure) -> int:
            self._sweeping = False
            self._sweep_outage.failed(failure.value)
            return 0

        return d.addCallbacks(swept, failed)

    def _drop(self, rows: list[tuple[str, str, int]]) -> None:
        if not rows:
            return
        self.counts["expired"] = self.counts.get("expired", 0) + len(rows)
        by_channel: dict[tuple[str, str], list[int]] = {}
        for topic, channel, message_id in rows:
            by_channel.setdefault((topic, channel), []).append(message_id)
        for (topic, name), ids in by_channel.items():
            ch = self._channel(topic, name)
            if ch is not None:
                ch.drop(ids)
        log.info("{n} expired copies moved to dead letters", n=len(rows))

    def close(self) -> Deferred[None]:
        d = self.writer.close()
        d.addCallback(lambda _: self.attempts.drain())
        d.addCallback(lambda _: self.exhausted.drain())
        return d

    def stats(self) -> dict[str, object]:
        return {
            "recorded_since_start": dict(sorted(self.counts.items())),
            "pending": self.writer.pending + self.attempts.pending + self.exhausted.pending,
        }
