"""Responses in command order (nsqd answers each command before reading the next).

dmq answers some commands later than others (a PUB to a reliable topic waits for
the PostgreSQL commit), so each command that is not answered at once holds a
slot, and answers that follow queue behind it. A fatal error is a slot like any
other: written in its turn, then the connection closes. Message frames and
heartbeats are not responses and never wait here.
"""

from __future__ import annotations

from collections import deque
from typing import Callable

__all__ = ["Slot", "ResponseQueue"]


class Slot:
    __slots__ = ("data", "fatal", "after")

    def __init__(self) -> None:
        self.data: bytes | None = None
        self.fatal = False
        self.after: Callable[[], None] | None = None


class ResponseQueue:
    """``write(bytes)`` sends; ``close()`` is called after a fatal answer is written;
    ``after`` callbacks run right after their answer is written (e.g. a compression
    upgrade, or letting messages flow once SUB's OK is out)."""

    def __init__(self, write: Callable[[bytes], None], close: Callable[[], None],
                 flush: Callable[[], None] = lambda: None):
        """``write`` may hold bytes back (the connection's turn buffer); ``flush`` writes
        them out, and runs before an ``after`` callback, which may change the transport."""
        self._write = write
        self._close = close
        self._flush = flush
        self._slots: deque[Slot] = deque()
        self.done = False

    def __len__(self) -> int:
        return len(self._slots)

    def reply(self, data: bytes, fatal: bool = False, after: Callable[[], None] | None = None) -> None:
        """Answer now, or after the answers still pending."""
        if not self._slots:
            self._send(data, fatal, after)
            return
        slot = Slot()
        slot.data, slot.fatal, slot.after = data, fatal, after
        self._slots.append(slot)

    def reserve(self) -> Slot:
        slot = Slot()
        self._slots.append(slot)
        return slot

    def fill(self, slot: Slot, data: bytes, fatal: bool = False, after: Callable[[], None] | None = None) -> None:
        if self.done:
            return
        slot.data, slot.fatal, slot.after = data, fatal, after
        slots = self._slots
        while slots and slots[0].data is not None and not self.done:
            head = slots.popleft()
            self._send(head.data, head.fatal, head.after)  # type: ignore[arg-type]

    def clear(self) -> None:
        self.done = True
        self._slots.clear()

    def _send(self, data: bytes, fatal: bool, after: Callable[[], None] | None) -> None:
        if self.done:
            return
        self._write(data)
        if fatal:
            self.clear()
            self._close()
        elif after is not None:
            self._flush()
            after()
