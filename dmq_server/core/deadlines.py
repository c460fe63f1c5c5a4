"""Deadlines by key, earliest first: the in-flight and deferral tracker of both stores.

Every message a consumer holds has a deadline (its message timeout, or the end of a
requeue delay); a scanner asks each channel now and then for the keys whose deadline
passed, so no message ever has a timer of its own (nsqd's design). Both stores keep
their deadlines here: the reliable channel (copies in flight and deferred, keyed by
message id) and the fast channel (nsqd's in-flight and deferred queues).

Nearly every deadline is a push's: now plus the channel's fixed message timeout, so
each is at or after the one set before it. Those are appended to a FIFO, which is in
order by construction; only a deadline earlier than the FIFO's last (a REQ with a
short delay, a TOUCH on another timeout) goes to a binary heap (``heapq``). ``pop_due``
merges the two fronts. Deletion is lazy: ``discard`` forgets the key, and an entry
counts only while it is its key's current one. Acks mostly come in push order, so
``discard`` also drops the stale entries at the FIFO's front, which keeps the FIFO
about as long as what is in flight; a ``set`` that finds more than STALE_RATIO entries
per live key (plus SLACK) compacts both. The FIFO spares the common case the heap's
sift and its tuple comparisons (bench/deadlines.py).
"""

from __future__ import annotations

import heapq
from collections import deque
from typing import Generic, Hashable, Iterable, Iterator, TypeVar

__all__ = ["Deadlines"]

#: after a ``set``, at most this many entries per live key (plus SLACK) are kept
STALE_RATIO = 4
SLACK = 1024

# an entry is (deadline, sequence number, key); the sequence number orders equal
# deadlines by arrival and keeps keys from ever being compared (ints and bytes occur)
K = TypeVar("K", bound=Hashable)  # a message id (int) or a fast message id (bytes)
_Entry = tuple[float, int, K]


class Deadlines(Generic[K]):
    """Keys with one deadline each (seconds, any clock); ``pop_due(now)`` yields the
    keys whose deadline is at or before ``now``, earliest first, and forgets them."""

    __slots__ = ("_fifo", "_heap", "_current", "_seq")

    def __init__(self) -> None:
        self._fifo: deque[_Entry[K]] = deque()  # deadlines in order, appended
        self._heap: list[_Entry[K]] = []  # the deadlines that were earlier than the FIFO's last
        self._current: dict[K, _Entry[K]] = {}  # each live key's entry (by identity)
        self._seq = 0

    def __len__(self) -> int:
        return len(self._current)

    def __bool__(self) -> bool:
        return bool(self._current)

    def __contains__(self, key: K) -> bool:
        return key in self._current

    def deadline(self, key: K) -> float | None:
        entry = self._current.get(key)
        return None if entry is None else entry[0]

    def entries(self) -> int:
        """Entries held, stale ones included (what the bound limits)."""
        return len(self._fifo) + len(self._heap)

    def set(self, key: K, deadline: float) -> None:
        """Give ``key`` this deadline (a new one, or a later or earlier one: TOUCH, REQ)."""
        self._seq = seq = self._seq + 1
        entry = (deadline, seq, key)
        current = self._current
        current[key] = entry
        fifo = self._fifo
        if not fifo or deadline >= fifo[-1][0]:
            fifo.append(entry)
        else:
            heapq.heappush(self._heap, entry)
        if len(fifo) + len(self._heap) > STALE_RATIO * len(current) + SLACK:
            self._compact()

    def set_many(self, keys: Iterable[K], deadline: float) -> None:
        """``set`` of each key, in order, to one deadline (a batch pushed at once): where
        the entries go (the FIFO, or the heap when the deadline is earlier than the
        FIFO's last) is decided once for the lot, and the bound checked once after it."""
        current = self._current
        fifo, heap = self._fifo, self._heap
        seq = self._seq
        if not fifo or deadline >= fifo[-1][0]:
            append = fifo.append
            for key in keys:
                seq += 1
                current[key] = entry = (deadline, seq, key)
                append(entry)
        else:
            for key in keys:
                seq += 1
                current[key] = entry = (deadline, seq, key)
                heapq.heappush(heap, entry)
        self._seq = seq
        if len(fifo) + len(heap) > STALE_RATIO * len(current) + SLACK:
            self._compact()

    def discard(self, key: K) -> None:
        """Forget ``key`` (acked, requeued, dropped); nothing if it has no deadline."""
        self.discard_many((key,))

    def discard_many(self, keys: Iterable[K]) -> None:
        """``discard`` of each key (a read of FINs): the stale entries a discard leaves at
        the FIFO's front are dropped as they come to it."""
        current, fifo = self._current, self._fifo
        for key in keys:
            entry = current.pop(key, None)
            if entry is not None and fifo and fifo[0] is entry:
                fifo.popleft()
                while fifo and current.get(fifo[0][2]) is not fifo[0]:
                    fifo.popleft()

    def pop_due(self, now: float) -> Iterator[K]:
        """The keys due at ``now``, earliest deadline first, each forgotten as it is
        yielded (a consumer of the iterator may set a key again meanwhile)."""
        current = self._current
        while True:
            # read on every turn: a ``set`` between two yields may compact them
            fifo, heap = self._fifo, self._heap
            if fifo and (not heap or fifo[0] < heap[0]):
                if fifo[0][0] > now:
                    return
                entry = fifo.popleft()
            elif heap and heap[0][0] <= now:
                entry = heapq.heappop(heap)
            else:
                return
            key = entry[2]
            if current.get(key) is entry:
                del current[key]
                yield key

    def clear(self) -> list[K]:
        """Forget every key; returns them (in no particular order)."""
        keys = list(self._current)
        self._current.clear()
        self._fifo.clear()
        self._heap.clear()
        return keys

    def _compact(self) -> None:
        current = self._current
        self._fifo = deque(entry for entry in self._fifo if current.get(entry[2]) is entry)
        self._heap = [entry for entry in self._heap if current.get(entry[2]) is entry]
        heapq.heapify(self._heap)
