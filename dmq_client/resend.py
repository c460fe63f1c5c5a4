"""The resend map: sends written to a server and not yet answered.

DMQ's ``resendMap``, keyed by ``(producer, session_id)``: what the server
identifies a message by (a journal replays messages under the producer id they
were first sent with, which may not be the client's current one). A message enters when it is first
written and leaves when a reply arrives, or when it has had ``tries`` resends,
``interval`` apart, and still no reply (OUT_OF_RETRY). With the defaults a
message is written at t, resent at t+30, t+60 and t+90 s, and reported
OUT_OF_RETRY at t+120 s: every write, the last included, gets a full interval
to be answered.

The map does no IO and reads no clock: callers pass ``now`` (from the client's
injectable monotonic clock), so the schedule is unit-tested without sleeping.
Entries are kept in the order of their last write, so finding the due ones
costs only the due ones, not a scan of the whole map every second.

Memory is bounded by ``capacity`` (``MqConfig.max_in_flight``): the send
runner waits in ``wait_for_room`` before it writes a new message, which backs
up into the bounded send queue and, from there, QUEUE_FULL.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Iterable

from .pending import PendingSend

__all__ = ["ResendMap"]


class ResendMap:
    def __init__(self, capacity: int, interval: float, tries: int):
        self.capacity = capacity
        self.interval = interval
        self.tries = tries
        self._items: OrderedDict[tuple[str, int], PendingSend] = OrderedDict()
        self._lock = threading.Lock()
        self._room = threading.Condition(self._lock)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: tuple[str, int]) -> bool:
        return key in self._items

    def wait_for_room(self, n: int = 1, timeout: float | None = None) -> bool:
        """Block until ``n`` more entries fit under ``capacity`` (or timeout)."""
        limit = self.capacity - min(n, self.capacity)
        with self._room:
            if len(self._items) <= limit:
                return True
            return self._room.wait_for(lambda: len(self._items) <= limit, timeout)

    def add(self, item: PendingSend, server: str, now: float) -> bool:
        """Record the first write of ``item`` to ``server``. False if a send with
        the same producer and session id is already awaiting its reply."""
        return bool(self.add_many([item], server, now)[0])

    def add_many(
        self, items: list[PendingSend], server: str, now: float
    ) -> tuple[list[PendingSend], list[PendingSend]]:
        """``add`` for a batch under one lock. An item whose ``(producer,
        session_id)`` is already awaiting a reply is not added: if it is a resend
        (``item.resend``: a journal replay, ``client.resend``) it is the same
        message, so it becomes a follower of the entry and gets that entry's
        answer (``leader.followers``); otherwise (a new send reusing a
        caller-chosen session id) it is refused. Returns ``(added, refused)``. Followers are
        attached under the map's lock, while the leader is in the map, so
        whoever removes the leader sees every follower it will ever have."""
        added: list[PendingSend] = []
        refused: list[PendingSend] = []
        with self._lock:
            entries = self._items
            for item in items:
                leader = entries.get(item.key)
                if leader is not None:
                    if item.resend:
                        if leader.followers is None:
                            leader.followers = []
                        leader.followers.append(item)
                    else:
                        refused.append(item)
                    continue
                item.attempts += 1
                item.last_attempt = now
                item.server = server
                entries[item.key] = item
                added.append(item)
        return added, refused

    def get(self, key: tuple[str, int]) -> PendingSend | None:
        return self._items.get(key)

    def rewritten(self, item: PendingSend, server: str, now: float) -> None:
        """A failover write of ``item`` to another server: a fresh interval to be
        answered, but no try used up (the first server failed, not the message)."""
        with self._lock:
            if self._items.get(item.key) is item:
                item.attempts += 1
                item.last_attempt = now
                item.server = server
                self._items.move_to_end(item.key)

    def pop(self, key: tuple[str, int]) -> PendingSend | None:
        """Remove and return the entry a reply answers (None if already gone)."""
        found = self.pop_many((key,))
        return found[0] if found else None

    def pop_many(self, keys: Iterable[tuple[str, int]]) -> list[PendingSend]:
        """``pop`` for a batch of replies under one lock acquisition."""
        found = []
        with self._lock:
            pop = self._items.pop
            for key in keys:
                item = pop(key, None)
                if item is not None:
                    found.append(item)
            if found:
                self._room.notify_all()
        return found

    def due(self, now: float) -> tuple[list[PendingSend], list[PendingSend]]:
        """Entries whose last write is ``interval`` old: ``(resend, expired)``.

        A resend entry is marked as written now (its ``resends`` and
        ``attempts`` incremented) before it is returned, so a failed resend
        (no server reachable) still uses up its try, and the give-up time
        stays on schedule however long the servers are away. Expired entries
        are removed; the caller reports them OUT_OF_RETRY.
        """
        resend: list[PendingSend] = []
        expired: list[PendingSend] = []
        with self._lock:
            items = self._items
            while items:
                key, item = next(iter(items.items()))
                if now - item.last_attempt < self.interval:
                    break
                if item.resends >= self.tries:
                    del items[key]
                    expired.append(item)
                else:
                    item.resends += 1
                    item.attempts += 1
                    item.last_attempt = now
                    items.move_to_end(key)
                    resend.append(item)
            if expired:
                self._room.notify_all()
        return resend, expired

    def on_server(self, server: str) -> list[PendingSend]:
        """Entries last written to ``server`` (to fail them over when it goes)."""
        with self._lock:
            return [item for item in self._items.values() if item.server == server]

    def drain(self) -> list[PendingSend]:
        """Remove and return every entry (used when closing)."""
        with self._lock:
            items = list(self._items.values())
            self._items.clear()
            self._room.notify_all()
            return items
