"""A connection's outgoing bytes of one reactor turn, written together at its end.

One group commit answers hundreds of sends and pushes hundreds of copies, many of them
to the same few connections; an NSQ consumer's RDY window fills the same way. Twisted's
``transport.write`` is a chain of calls and a writer registration each time (about a
tenth of dmq-server's CPU in e2e4, docs/benchmarks.md session 17), so the hot frames
(pushes, messages, send answers) are held here and written as one ``bytes`` when the
turn ends (``callLater(0)`` runs after the turn's I/O). Both wire protocols use it.

The connection keeps the order its client sees: a frame it writes at once flushes this
buffer first, and so does closing. Memory is bounded by what one turn can produce for
one connection: its subscriptions' credit in pushes, its own sends in answers.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["TurnBuffer"]


class TurnBuffer:
    """``add`` holds bytes until the turn ends (or ``flush``), then ``emit`` gets them
    joined. ``emit`` decides whether a closed connection still writes."""

    __slots__ = ("_clock", "_emit", "_out")

    def __init__(self, clock: Any, emit: Callable[[bytes], None]):
        self._clock = clock
        self._emit = emit
        self._out: list[bytes] = []

    def __bool__(self) -> bool:
        return bool(self._out)

    def add(self, data: bytes) -> None:
        out = self._out
        out.append(data)
        if len(out) == 1:
            self._clock.callLater(0, self.flush)

    def flush(self) -> None:
        out = self._out
        if out:
            self._out = []
            self._emit(b"".join(out))
