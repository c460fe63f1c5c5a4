"""Per-key order on a channel of an ordered topic: one copy of a key out at a time.

An ordered topic (``dmq topic create NAME --ordered``) delivers, per channel, at most one
copy of a key at a time: the next message of the key waits until the one before it was
acknowledged or dead-lettered, and other keys keep flowing (Pulsar's ``Key_Shared``,
SQS FIFO's message group, pg-boss's ``key_strict_fifo``). This is that rule for one
channel, in memory and free of IO; the channel asks it before each push and tells it
each outcome.

A key is *held* by one message id from the moment its copy is pushed until that copy is
acknowledged or dead-lettered (or dropped: expired into a dead letter, or forgotten with
the node's memory). A copy that comes back unacknowledged (a timeout, a ``REQ``, its
consumer gone) keeps the key: it goes back to the front of the channel's queue and is
the next of its key to go out, so a redelivery keeps its place at the head of its key.
Copies of a held key met on the way are *parked* behind it, in the order met (id order,
the order their commits made them visible: ``reliable.writer`` commits an ordered topic's
sends one transaction at a time); when the key is released the first of them is handed
back to be pushed next.

A message without a key is its own key: it is never parked and holds nothing.

Parked copies stay in the channel's memory window (counted as waiting there), so memory
stays bounded by the window. A key with more copies waiting than a share of the window
(a hot key) keeps only its first few in memory (``set_aside``): the rest wait in
PostgreSQL and are read with their key as those go out (``reliable.cursor``'s skipped
keys), so one key never fills the window the other keys flow through.
"""

from __future__ import annotations

from collections import deque
from typing import Generic, Iterable, Iterator, Protocol, TypeVar

__all__ = ["KeyGate"]


class _Keyed(Protocol):
    @property
    def message_id(self) -> int: ...
    @property
    def key(self) -> str | None: ...


class _Copy(Protocol):
    @property
    def message(self) -> _Keyed: ...


CopyT = TypeVar("CopyT", bound=_Copy)


class KeyGate(Generic[CopyT]):
    """Which message holds each key of a channel, and the copies parked behind it."""

    __slots__ = ("holders", "parked", "parked_count")

    def __init__(self) -> None:
        self.holders: dict[str, int] = {}  # key -> the id of its copy out (or coming back)
        self.parked: dict[str, deque[CopyT]] = {}  # key -> copies waiting behind it, in order met
        self.parked_count = 0

    def admit(self, copy: CopyT) -> bool:
        """Whether ``copy`` may be pushed now; if so its key is held by it from now on.
        False: its key is held by another copy, and ``copy`` is parked behind it."""
        message = copy.message
        key = message.key
        if key is None:
            return True
        holder = self.holders.get(key)
        mid = message.message_id
        if holder is None:
            self.holders[key] = mid
            return True
        if holder == mid:  # a redelivery of the key's own copy
            return True
        self.park(key, copy)
        return False

    def release(self, copy: CopyT) -> CopyT | None:
        """``copy`` is done (acknowledged, dead-lettered, dropped): its key is free again
        if it held it. Returns the copy parked first behind the key, taken out of the
        gate (the channel queues it to be pushed next), or None."""
        message = copy.message
        key = message.key
        if key is None or self.holders.get(key) != message.message_id:
            return None
        del self.holders[key]
        waiting = self.parked.get(key)
        if not waiting:
            return None
        first = waiting.popleft()
        self.parked_count -= 1
        if not waiting:
            del self.parked[key]
        return first

    def discard(self, message_ids: set[int]) -> list[CopyT]:
        """Take the parked copies of ``message_ids`` out (their stored state is gone) and
        release the keys they hold; returns the copies each release hands back (to be
        pushed next), none of them among ``message_ids``."""
        for key in list(self.parked):
            waiting = self.parked[key]
            kept = deque(c for c in waiting if c.message.message_id not in message_ids)
            self.parked_count -= len(waiting) - len(kept)
            if kept:
                self.parked[key] = kept
            else:
                del self.parked[key]
        freed: list[CopyT] = []
        for key, holder in list(self.holders.items()):
            if holder in message_ids:
                del self.holders[key]
                behind = self.parked.get(key)
                if behind:
                    freed.append(behind.popleft())
                    self.parked_count -= 1
                    if not behind:
                        del self.parked[key]
        return freed

    def park(self, key: str, copy: CopyT) -> None:
        """Park ``copy`` behind ``key`` as met (a copy read with its key, after those of it
        in memory)."""
        waiting = self.parked.get(key)
        if waiting is None:
            self.parked[key] = waiting = deque()
        waiting.append(copy)
        self.parked_count += 1

    def hand_on(self, key: str) -> CopyT | None:
        """If ``key`` is free and has copies parked (read with their key), the first of
        them, out of the gate and holding the key already (as a copy coming back does):
        the channel pushes it next, and copies parked later wait behind it."""
        waiting = self.parked.get(key)
        if not waiting or key in self.holders:
            return None
        first = waiting.popleft()
        self.parked_count -= 1
        if not waiting:
            del self.parked[key]
        self.holders[key] = first.message.message_id
        return first

    def set_aside(self, key: str, later: Iterable[CopyT], keep: int) -> list[CopyT]:
        """``key`` has too many copies waiting: of those parked behind it and ``later`` (its
        copies not met yet), in id order, the first ``keep`` stay parked and the others
        are returned (they leave memory)."""
        waiting = self.parked.pop(key, deque())
        copies = sorted([*waiting, *later], key=lambda c: c.message.message_id)
        kept = copies[:keep]
        if kept:
            self.parked[key] = deque(kept)
        self.parked_count += len(kept) - len(waiting)
        return copies[keep:]

    def clear(self) -> list[CopyT]:
        """Forget every key and return the parked copies (the channel drops its memory)."""
        copies = list(self.waiting())
        self.holders.clear()
        self.parked.clear()
        self.parked_count = 0
        return copies

    def waiting(self) -> Iterator[CopyT]:
        """Every parked copy."""
        for waiting in self.parked.values():
            yield from waiting

    def held_by(self, message_id: int) -> str | None:
        """The key ``message_id``'s copy waits for, if it is parked (for operators)."""
        for key, waiting in self.parked.items():
            if any(c.message.message_id == message_id for c in waiting):
                return key
        return None
