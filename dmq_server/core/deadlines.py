"""Deadlines by key, earliest first: the in-flight and deferral tracker of both stores.

Every message a consumer holds has a deadline (its message timeout, or the end of a
requeue delay); a scanner asks each channel now and then for the keys whose deadline
passed, so no message ever has a timer of its own (nsqd's design). Both stores keep
their deadlines here: the reliable channel (copies in flight and deferred, keyed by
message id) and the fast channel (nsqd's in-flight and deferred queues).

A binary heap (``heapq``, in C) with lazy deletion: ``set`` pushes a new entry and
remembers which one is current, ``discard`` only forgets the key, and ``pop_due``
skips the entries that are no longer current. Acks and touches, the common case,
cost a dict operation instead of a heap removal. Stale entries are bounded: when they
outnumber the live keys four to one (plus 1024), the heap is rebuilt from the live ones.
"""

from __future__ import annotations

import heapq
from typing import Hashable, Iterator

__all__ = ["Deadlines"]

#: rebuild once the heap holds more than this many entries per live key (plus SLACK)
STALE_RATIO = 4
SLACK = 1024


class Deadlines:
    """Keys with one deadline each (seconds, any clock); ``pop_due(now)`` yields the
    keys whose deadline is at or before ``now``, earliest first, and forgets them."""

    __slots__ = ("_heap", "_current", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Hashable]] = []
        self._current: dict[Hashable, tuple[float, int]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._current)

    def __bool__(self) -> bool:
        return bool(self._current)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._current

    def deadline(self, key: Hashable) -> float | None:
        entry = self._current.get(key)
        return None if entry is None else entry[0]

    def set(self, key: Hashable, deadline: float) -> None:
        """Give ``key`` this deadline (a new one, or a later or earlier one: TOUCH, REQ)."""
        self._seq += 1
        entry = (deadline, self._seq)
        self._current[key] = entry
        # the sequence number orders equal deadlines by arrival and keeps keys from
        # ever being compared (ints and bytes both occur)
        heapq.heappush(self._heap, (deadline, self._seq, key))
        self._bound()

    def discard(self, key: Hashable) -> None:
        """Forget ``key`` (acked, requeued, dropped); nothing if it has no deadline."""
        if self._current.pop(key, None) is not None:
            self._bound()

    def pop_due(self, now: float) -> Iterator[Hashable]:
        """The keys due at ``now``, earliest deadline first, each forgotten as it is
        yielded (a consumer of the iterator may set a key again meanwhile)."""
        current = self._current
        # self._heap is read on every turn: a ``set`` between two yields may rebuild it
        while self._heap and self._heap[0][0] <= now:
            deadline, seq, key = heapq.heappop(self._heap)
            if current.get(key) == (deadline, seq):
                del current[key]
                yield key

    def clear(self) -> list[Hashable]:
        """Forget every key; returns them (in no particular order)."""
        keys = list(self._current)
        self._current.clear()
        self._heap.clear()
        return keys

    def _bound(self) -> None:
        if len(self._heap) > STALE_RATIO * len(self._current) + SLACK:
            self._heap = [(deadline, seq, key) for key, (deadline, seq) in self._current.items()]
            heapq.heapify(self._heap)
