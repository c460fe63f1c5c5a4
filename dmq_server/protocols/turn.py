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

**Bytes that outlived a stall.** The pushes held here were decided while this node held
their copies. If the process stands still before the turn ends (SIGSTOP, a paused VM, a
long stall) past its ZooKeeper session, another node takes the copies over, pushes them
again and may see them acknowledged for good; the held pushes would then reach their
consumer after a durable ack (the chaos suite's node-pause counted one in about 25 runs:
the woken node's turn end ran before anything told it). A push is decided before its
bytes are held (the channel asks its gate, then hands the copies over): a stop between
the two holds bytes decided before it (the ordered-nodes chaos test saw the woken
orderer push one such copy 10 ms after SIGCONT). So the bytes' age counts from the last
turn end, not from their own arrival here: whatever this turn decided came after it.
A buffer with a ``guard`` asks it, when that age is over ``STALL`` seconds at the
flush, whether bytes decided that long ago may still leave (``Broker.may_push``: not
after the node stood still, until ZooKeeper confirms its session; the cluster node finds
the gap itself). After an idle spell the guard is asked once, at the first turn's end,
and answers yes, also while the node is paused with its session merely in doubt (its
fast topics' consumers are not cut off). If not, ``on_stale`` decides: a connection
holding copies in flight closes (True: the bytes are dropped; its copies go back, its
client connects again, and a send answer among the bytes is lost with it: its client
resends, idempotent by session id); one holding none (a producer) gets its answers
(False). Bytes already in the kernel left before the stall: nothing in user space can
call them back.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from typing import Any, Callable

from twisted.logger import Logger

from dmq_server.core.clock import Clock

__all__ = ["TurnBuffer", "STALL"]

log = Logger()

#: a turn whose bytes are older than this at their flush spanned a stall of the process:
#: the guard is asked (a turn takes microseconds to milliseconds; the cluster's own gap
#: threshold is a third of the ZooKeeper session, seconds)
STALL = 0.25


class _TurnEnd:
    """One ``callLater(0)`` per reactor turn for every buffer that holds bytes: at small
    batches (the steady scenario's five messages a commit, to four connections) a call
    per connection was 3 % of dmq-server's samples."""

    __slots__ = ("_clock", "_held", "ended", "__weakref__")

    def __init__(self, clock: Clock):
        self._clock = weakref.ref(clock)  # a strong one would keep its entry in _TURN_ENDS forever
        self._held: list[TurnBuffer] = []
        #: when the last turn end ran: what a turn decides, it decides after this
        self.ended = clock.seconds()

    def hold(self, buffer: TurnBuffer) -> None:
        held = self._held
        held.append(buffer)
        clock = self._clock()
        if len(held) == 1 and clock is not None:  # None: the reactor is gone (it never is while it runs)
            clock.callLater(0, self._run)

    def _run(self) -> None:
        held, self._held = self._held, []
        clock = self._clock()
        if clock is not None:
            self.ended = clock.seconds()
        for buffer in held:
            try:
                buffer.flush()
            except Exception:  # one connection's failure must not leave the others' bytes held
                log.failure("writing a connection's turn failed")


_TURN_ENDS: weakref.WeakKeyDictionary[Any, _TurnEnd] = weakref.WeakKeyDictionary()


class TurnBuffer:
    """``add`` holds bytes until the turn ends (or ``flush``), then ``emit`` gets them
    joined. ``emit`` decides whether a closed connection still writes."""

    __slots__ = ("_turn_end", "_emit", "_out", "_clock", "_guard", "_on_stale", "_since")

    def __init__(
        self,
        clock: Clock,
        emit: Callable[[bytes], None],
        guard: Callable[[], bool] | None = None,
        on_stale: Callable[[], bool] | None = None,
    ):
        turn_end = _TURN_ENDS.get(clock)
        if turn_end is None:
            turn_end = _TURN_ENDS[clock] = _TurnEnd(clock)
        self._turn_end = turn_end
        self._emit = emit
        self._out: list[bytes] = []
        self._clock = clock
        self._guard = guard  # None: no node can take this one's copies over (no cluster)
        self._on_stale = on_stale
        self._since = 0.0  # the turn end before the held bytes were decided (read only with a guard)

    def __bool__(self) -> bool:
        return bool(self._out)

    def add(self, data: bytes) -> None:
        out = self._out
        out.append(data)
        if len(out) == 1:
            self._held()

    def extend(self, parts: Sequence[bytes]) -> None:
        """``add`` of the parts' concatenation, without making it."""
        out = self._out
        if not out:
            self._held()
        out += parts

    def _held(self) -> None:
        turn_end = self._turn_end
        turn_end.hold(self)
        self._since = turn_end.ended

    def flush(self) -> None:
        out = self._out
        if out:
            self._out = []
            guard = self._guard
            if guard is not None and self._clock.seconds() - self._since > STALL and not guard():
                age = self._clock.seconds() - self._since
                if self._on_stale is not None and self._on_stale():
                    log.warn("{n} bytes held for a consumer since before this process stood still {age:.1f}s "
                             "were not sent, and its connection is closed: their copies may be another node's "
                             "now", n=sum(len(part) for part in out), age=age)
                    return
            self._emit(b"".join(out))
