"""The send queue: accepted messages waiting for the send runner.

``SendQueue`` is the contract, small on purpose so a producer journal can sit
behind it (DMQ's weak spot: a producer crash loses what its memory queue
held). ``MemorySendQueue`` is the default. ``dmq_client.journal.JournalSendQueue``
(``MqConfig.journal_path``) writes an item in ``put`` before answering
ACCEPTED and forgets it in ``task_done``, which the client calls only once the
item's result has been delivered, so an item stays journaled across the whole
send, resend and notify path, not just while queued.
"""

from __future__ import annotations

import enum
import threading
from collections import deque
from typing import Protocol, runtime_checkable

from .pending import PendingSend

__all__ = ["Put", "SendQueue", "RetryingSendQueue", "MemorySendQueue"]


class Put(enum.Enum):
    ACCEPTED = "accepted"
    FULL = "full"
    CLOSED = "closed"
    FAILED = "failed"  # could not be stored (a journal's write failed); ``last_error`` says why


class SendQueue(Protocol):
    """What the client needs from a send queue. Every method is thread-safe."""

    def put(self, item: PendingSend) -> Put:
        """Accept the item, or say at once why not: never blocks for room."""

    def get_batch(self, max_items: int, timeout: float | None) -> list[PendingSend]:
        """Up to ``max_items`` items in FIFO order; waits up to ``timeout`` for
        the first. Returns ``[]`` at once when the queue is closed and empty."""

    def task_done(self, item: PendingSend) -> None:
        """The item's result has been delivered; a journal forgets it if that result is
        final (``message.FINAL``) or the producer gave it up, and keeps it otherwise.
        Called for every result, also of items ``put`` refused: ignore those."""

    def close(self) -> None:
        """Refuse further puts (CLOSED); items already in stay available."""

    def drain(self) -> list[PendingSend]:
        """Remove and return every item still queued (used when closing)."""

    def __len__(self) -> int: ...


@runtime_checkable
class RetryingSendQueue(SendQueue, Protocol):
    """A send queue that retries its transient failures (the producer journal, which
    says so with ``retries_unfinished``): the producer holds such sends aside in its
    retry pen and hands them back when their backoff is over."""

    def hold(self, item: PendingSend) -> bool:
        """Keep ``item`` counted while the producer holds it; False: it was never stored
        here (it gets its failure instead)."""

    def requeue(self, items: list[PendingSend]) -> None:
        """Held items whose retry is due: back to the queue, ahead of new sends."""

    def unhold(self, n: int) -> None:
        """``n`` held items were given their result instead (the client closed)."""


class MemorySendQueue:
    """A bounded FIFO in memory: a deque under one condition variable."""

    def __init__(self, capacity: int):
        if capacity < 1:
            raise ValueError("capacity must be at least 1")
        self.capacity = capacity
        self._items: deque[PendingSend] = deque()
        self._cond = threading.Condition(threading.Lock())
        self._closed = False

    @property
    def closed(self) -> bool:
        return self._closed

    def put(self, item: PendingSend) -> Put:
        with self._cond:
            if self._closed:
                return Put.CLOSED
            if len(self._items) >= self.capacity:
                return Put.FULL
            self._items.append(item)
            if len(self._items) == 1:
                self._cond.notify()
            return Put.ACCEPTED

    def get_batch(self, max_items: int, timeout: float | None) -> list[PendingSend]:
        with self._cond:
            if not self._items and not self._closed:
                self._cond.wait(timeout)
            items = self._items
            n = min(max_items, len(items))
            return [items.popleft() for _ in range(n)]

    def task_done(self, item: PendingSend) -> None:
        pass  # nothing kept outside the deque

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def drain(self) -> list[PendingSend]:
        with self._cond:
            items = list(self._items)
            self._items.clear()
            return items

    def __len__(self) -> int:
        return len(self._items)
