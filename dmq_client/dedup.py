"""Duplicate suppression of pushed messages, in a window bounded by size and age.

Delivery is at least once: the server pushes a message again after its
timeout, when a consumer reconnects, or after a crash lost an ack. DMQ's
client drops a push it has already seen by ``(session id, client id)``; here
the key is ``(producer, session_id, channel)``. The producer is part of it
because session ids are unique per producer only, so two producers may well
use the same number; the channel is part of it because each channel
legitimately receives its own copy.

A duplicate is not simply dropped. What happens depends on what became of the
first copy:

* still queued or in its handler: drop (the first copy will be acked);
* handled and acked: ack the duplicate too (else the server would keep
  redelivering a copy nobody acknowledges), and drop it;
* its handler raised: the entry was forgotten, so the redelivery is new and
  the handler gets another go (at-least-once for failures).

Memory: at most ``max_entries`` entries, none older than ``max_age`` seconds,
evicted oldest first. Producer and channel strings are interned through a
small table, so an entry costs a key tuple, its session id int, a float and
an ordered-dict slot: about 230 bytes in steady state, measured by
``tests/unit/test_client_dedup.py`` (``docs/client.md`` states the figure).
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict

__all__ = ["Admit", "DedupWindow"]

Key = tuple[str, int, str]

# An entry's value is one float: 1 + the time it was first seen, negated once
# the message is acked. One float instead of a [time, state] list saves ~70
# bytes per entry; the 1 keeps it nonzero so the sign always means something.


class Admit(enum.Enum):
    NEW = "new"
    """First sight (or the earlier copy failed): hand it to the handler."""
    DUPLICATE = "duplicate"
    """The earlier copy is still being handled or awaits a manual ack: drop."""
    DUPLICATE_ACKED = "duplicate_acked"
    """The earlier copy was acked: ack this copy as well, then drop it."""


class DedupWindow:
    def __init__(self, max_entries: int, max_age: float):
        self.max_entries = max_entries
        self.max_age = max_age
        # key -> 1 + admitted at (seconds); negated once acknowledged
        self._entries: OrderedDict[Key, float] = OrderedDict()
        self._names: dict[str, str] = {}
        self._lock = threading.Lock()
        self.suppressed = 0

    def __len__(self) -> int:
        return len(self._entries)

    def _intern(self, name: str) -> str:
        names = self._names
        interned = names.get(name)
        if interned is None:
            if len(names) > 4 * self.max_entries:  # pathological churn of names
                names.clear()
            names[name] = interned = name
        return interned

    def key(self, producer: str, session_id: int, channel: str) -> Key:
        return (self._intern(producer), session_id, self._intern(channel))

    def admit(self, key: Key, now: float) -> Admit:
        with self._lock:
            self._evict(now)
            entry = self._entries.get(key)
            if entry is None:
                self._entries[key] = 1.0 + now
                return Admit.NEW
            self.suppressed += 1
            return Admit.DUPLICATE_ACKED if entry < 0 else Admit.DUPLICATE

    def acked(self, key: Key) -> None:
        """The copy that was admitted has been acknowledged."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry > 0:
                self._entries[key] = -entry

    def forget(self, key: Key) -> None:
        """The handler failed: let the next delivery through."""
        with self._lock:
            self._entries.pop(key, None)

    def _evict(self, now: float) -> None:
        entries = self._entries
        horizon = 1.0 + now - self.max_age
        while entries:
            oldest = next(iter(entries.values()))
            if len(entries) < self.max_entries and abs(oldest) > horizon:
                break
            entries.popitem(last=False)
