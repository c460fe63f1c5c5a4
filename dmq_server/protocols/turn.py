"""A connection's outgoing bytes of one reactor turn, written together at its end.

One group commit answers hundreds of sends and pushes hundreds of copies, many of them
to the same few connections; an NSQ consumer's RDY window fills the same way. Twisted's
``transport.write`` is a chain of calls and a writer registration each time (6–8 % of
dmq-server's profile samples in e2e4, docs/benchmarks.md session 17), so the hot frames
(pushes, messages, send answers) are held here and written as one ``bytes`` when the
turn ends (``callLater(0)`` runs after the turn's I/O). Both wire protocols use it.

The connection keeps the order its client sees: a frame it writes at once flushes this
buffer first, and so does closing. Memory is bounded by what one turn can produce for
one connection: its subscriptions' credit in pushes, its own sends in answers.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Callable

from twisted.logger import Logger

__all__ = ["TurnBuffer"]

log = Logger()


class _TurnEnd:
    """One ``callLater(0)`` per reactor turn for every buffer that holds bytes: at small
    batches (the steady scenario's five messages a commit, to four connections) a call
    per connection was 3 % of dmq-server's samples."""

    __slots__ = ("_clock", "_held", "__weakref__")

    def __init__(self, clock: Any):
        self._clock = weakref.ref(clock)  # a strong one would keep its entry in _TURN_ENDS forever
        self._held: list[TurnBuffer] = []

    def hold(self, buffer: TurnBuffer) -> None:
        held = self._held
        held.append(buffer)
        if len(held) == 1:
            self._clock().callLater(0, self._run)

    def _run(self) -> None:
        held, self._held = self._held, []
        for buffer in held:
            try:
                buffer.flush()
            except Exception:  # one connection's failure must not leave the others' bytes held
                log.failure("writing a connection's turn failed")


_TURN_ENDS: weakref.WeakKeyDictionary[Any, _TurnEnd] = weakref.WeakKeyDictionary()


class TurnBuffer:
    """``add`` holds bytes until the turn ends (or ``flush``), then ``emit`` gets them
    joined. ``emit`` decides whether a closed connection still writes."""

    __slots__ = ("_turn_end", "_emit", "_out")

    def __init__(self, clock: Any, emit: Callable[[bytes], None]):
        turn_end = _TURN_ENDS.get(clock)
        if turn_end is None:
            turn_end = _TURN_ENDS[clock] = _TurnEnd(clock)
        self._turn_end = turn_end
        self._emit = emit
        self._out: list[bytes] = []

    def __bool__(self) -> bool:
        return bool(self._out)

    def add(self, data: bytes) -> None:
        out = self._out
        out.append(data)
        if len(out) == 1:
            self._turn_end.hold(self)

    def extend(self, parts: Sequence[bytes]) -> None:
        """``add`` of the parts' concatenation, without making it."""
        out = self._out
        if not out:
            self._turn_end.hold(self)
        out += parts

    def flush(self) -> None:
        out = self._out
        if out:
            self._out = []
            self._emit(b"".join(out))
