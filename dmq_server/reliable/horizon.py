"""How far this incarnation's message ids are settled: the horizon a cursor may cover.

A channel's cursor says "every message of this owner up to the floor is done". The
node proposing a floor knows what its channels hold in memory, but message ids are
drawn inside the insert, and concurrent group commits (several writer connections,
the delay movers) commit them out of order: while a batch is on its way, some id
below the highest one seen may still appear. Covering it would lose it.

So every write of this incarnation that stores messages is open from the moment it is
sent until its messages reached the channels in memory (``begin``/``end``). A batch's
ids are all higher than any id this incarnation had seen committed when it was sent,
so every id up to ``horizon()`` (the least such bound over open writes; unbounded when
none is open) is settled: committed and handed to the channels, or never to be.

A write whose answer was lost stays open (``hold``) until the PostgreSQL backend that
ran it is gone (``release``: its transaction committed or rolled back, and either is
visible now); the store asks PostgreSQL which held backends still run. A write that
failed before reaching PostgreSQL, or was refused, is settled at once.

Owners other than this incarnation: a retired one stores nothing more, so everything
of it is settled (``math.inf``); one that is not retired belongs to a live process this
node cannot see into, so nothing of it is (``None``: only exact acknowledgements).

An ordered topic's orderer in a cluster (``reliable.cursor.ChannelCursor.loads_only``)
needs no horizon at all: the topic's commits are serialised across the nodes, so a
commit's ids are above every id of the topic visible before it, and its channels read
every owner's copies by loads alone. Whatever a load passed is settled, for every owner
(``limit(owner, orderer=True)``: ``math.inf``), so floors rise over every node's copies.

One per store, not per channel: a write spans every channel of its topics. Each
channel's cursor (``reliable.cursor.ChannelCursor.progress``) is handed ``limit(owner)``
when a durable-ack batch asks what it may propose.
"""

from __future__ import annotations

import math

__all__ = ["OwnWrites"]


class OwnWrites:
    """The open writes of incarnation ``owner`` (set when the server starts)."""

    def __init__(self, owner: int = 0):
        self.owner = owner
        self.retired: set[int] = set()  # other incarnations known to be retired
        self.max_seen = 0  # highest id this incarnation has seen committed
        self._open: dict[int, int] = {}  # write -> ids of that write are above this
        self._held: dict[int, int | None] = {}  # open writes of unknown outcome -> backend pid
        self._next = 0

    def begin(self) -> int:
        """A write is being sent; returns its token."""
        self._next += 1
        self._open[self._next] = self.max_seen
        return self._next

    def seen(self, message_id: int) -> None:
        if message_id > self.max_seen:
            self.max_seen = message_id

    def end(self, token: int) -> None:
        """Its messages are in the channels (or it stored nothing)."""
        self._open.pop(token, None)
        self._held.pop(token, None)

    def hold(self, token: int, backend_pid: int | None) -> None:
        """Its answer was lost: open until ``backend_pid`` is gone. Without a pid the
        statement never reached a backend, so nothing of it can commit: settled."""
        if backend_pid is None:
            self.end(token)
        elif token in self._open:
            self._held[token] = backend_pid

    def held_pids(self) -> set[int]:
        return {pid for pid in self._held.values() if pid is not None}

    def release(self, gone: set[int]) -> bool:
        """The backends in ``gone`` ended: their held writes are settled. True if any was."""
        done = [token for token, pid in self._held.items() if pid in gone]
        for token in done:
            self.end(token)
        return bool(done)

    def horizon(self) -> float:
        """Every id of this incarnation up to this is settled."""
        return min(self._open.values()) if self._open else math.inf

    def limit(self, owner: int, orderer: bool = False) -> float | None:
        """How far ``owner``'s ids are settled, as seen from this node; for a channel
        this node orders (``orderer``), every id its loads passed."""
        if orderer:
            return math.inf
        if owner == self.owner:
            return self.horizon()
        if owner in self.retired:
            return math.inf
        return None

    @property
    def open(self) -> int:
        return len(self._open)
