"""``ClientMemory``: the bytes the server holds on its clients' behalf, against one budget.

Counts of messages do not bound memory when a body may be a megabyte: 300 pipelined
1 MB sends and 300 NSQ PUBs of 1 MB once took a server from 73 MB to 450 MB, and a
consumer's backlog to 1.3 GB (docs/operations.md, "Memory"). So, like a memory
watermark, one budget in bytes (``--max-client-memory``) covers everything held for
clients, by kind:

* ``frames``: incomplete frames in connections' buffers;
* ``pending``: bodies of sends read and not yet answered (waiting for their commit);
* ``output``: replies and pushes the client has not read, in the transports' buffers;
* ``reliable_window`` / ``fast_window``: the channels' in-memory windows (a reliable
  channel's copies waiting to be pushed; a fast channel's or topic's memory queue).

The connections' kinds are what the budget stops (the adapters in
``dmq_server.protocols.flow`` ask ``should_stop``): over the limit, a connection that
holds at least ``large`` bytes of its own (a 256th of the budget: a pipelining producer,
a megabyte frame) is not read until the total is back under three quarters of it (one
*episode*; ``pauses`` counts connections stopped). Smaller ones go on being read, so a
producer of small messages on another topic is still served, until the total passes
the hard mark (an eighth over the limit): then every connection holding at least one
read's worth (``read_size``, 64 KiB: what Twisted reads at once) stops too, as under a
memory watermark. One holding less is never stopped: stopping it would keep back no more
than its next read adds, and a producer whose small frame happened to be split across two
reads would otherwise wait for as long as others hold the budget (clients holding
incomplete megabyte frames until ``--read-timeout``). So every connection holds at most
its threshold plus one read. The same rule, ``over_budget_stops``, decides for the port's
``--max-buffered-bytes`` (``protocols.flow.BufferBudget``). The windows never stop anyone: they have somewhere else to put
a message (PostgreSQL, the disk queue), so they take only what ``window_room`` grants:
at most ``limit / 16`` for one channel, ``limit / 2`` for all windows together, and
nothing that would take the total over the limit. Connections thus always keep at
least half of the budget, and a channel never fills it.

Sans-IO: no clock, no reactor, no logging. ``on_episode(started)`` tells the adapter
when an episode starts and ends (it logs once each); ``trim_due`` says when enough was
freed that returning it to the operating system is worth a call (``release_to_os``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from typing import Any, Callable

__all__ = [
    "over_budget_stops",
    "ClientMemory",
    "WindowBytes",
    "KINDS",
    "FRAMES",
    "PENDING",
    "OUTPUT",
    "RELIABLE_WINDOW",
    "FAST_WINDOW",
    "READ_SIZE",
    "release_to_os",
]

FRAMES, PENDING, OUTPUT = "frames", "pending", "output"
RELIABLE_WINDOW, FAST_WINDOW = "reliable_window", "fast_window"
KINDS = (FRAMES, PENDING, OUTPUT, RELIABLE_WINDOW, FAST_WINDOW)


#: what Twisted reads from a connection at once (its transport's ``bufferSize``, which the
#: ports set to ``--max-output-buffer``, 64 KiB by default)
READ_SIZE = 65536


def over_budget_stops(own: int, total: int, limit: int, large: int, hard_limit: int, read_size: int) -> bool:
    """Whether a connection holding ``own`` bytes stops being read while a budget of
    ``limit`` holds ``total``: over the limit if it holds ``large`` or more, past the hard
    mark if it holds at least one read (see the module's docstring for why never less)."""
    return total > limit and (own >= large or (total > hard_limit and own >= read_size))


class ClientMemory:
    """Bytes held by kind, the budget, and the waiters stopped by it."""

    def __init__(self, limit: int, read_size: int = READ_SIZE):
        self.limit = limit
        self.resume_below = limit * 3 // 4
        self.window_limit = limit // 2  # every channel window together
        self.channel_limit = max(1, limit // 16)  # one channel's (or fast topic's) window
        self.read_size = read_size
        self.large = max(read_size, limit // 256)  # a connection holding this much is stopped first
        self.hard_limit = limit + limit // 8  # past it, one holding a read's worth is too
        self.held = dict.fromkeys(KINDS, 0)
        self.total = 0
        self.peak = 0
        self.windows = 0  # held[RELIABLE_WINDOW] + held[FAST_WINDOW]
        self.pauses = 0  # connections stopped by the budget, counted once per stop
        self.episodes = 0
        self.in_episode = False
        self.on_episode: Callable[[bool], None] | None = None
        self._waiting: dict[Any, Callable[[], None]] = {}
        self._trim_mark = 0  # the highest total since the last release to the OS
        self.trims = 0  # releases to the OS made (counted by the adapter that makes them)

    # -- accounting ----------------------------------------------------------------------
    @property
    def over(self) -> bool:
        return self.total > self.limit

    def add(self, kind: str, delta: int) -> None:
        """``delta`` bytes more (or fewer) held of ``kind``."""
        if not delta:
            return
        self.held[kind] += delta
        total = self.total = self.total + delta
        if kind is RELIABLE_WINDOW or kind is FAST_WINDOW:
            self.windows += delta
        if delta > 0:
            # the peak is never below the trim mark (the highest total since the last
            # trim), so only a new trim mark can be a new peak
            if total > self._trim_mark:
                self._trim_mark = total
                if total > self.peak:
                    self.peak = total
        elif (self._waiting or self.in_episode) and total <= self.resume_below:
            self._release()

    def window_room(self, window: int, size: int) -> bool:
        """Whether a channel window holding ``window`` bytes may keep ``size`` more."""
        return size <= self.window_bytes_left(window)

    def deferred_room(self, size: int) -> bool:
        """Whether ``size`` bytes more of deferred messages (a DPUB to a fast topic) may
        be held: they have no disk to go to, so, unlike a window's, they are refused
        when they do not fit what all windows together and the budget have left; no
        per-channel share, since one DPUB's copies go to every channel at once."""
        return size <= min(self.window_limit - self.windows, self.limit - self.total)

    def window_bytes_left(self, window: int) -> int:
        """How many bytes more a channel window holding ``window`` bytes may keep now
        (``window_room`` of a whole batch, asked once for it)."""
        return min(self.channel_limit - window, self.window_limit - self.windows, self.limit - self.total)

    # -- stopping connections ------------------------------------------------------------
    def should_stop(self, own: int) -> bool:
        """Whether a connection holding ``own`` bytes (frames, sends, unsent output) is
        to be stopped now."""
        return over_budget_stops(own, self.total, self.limit, self.large, self.hard_limit, self.read_size)

    def stop(self, key: Any, resume: Callable[[], None]) -> None:
        """``key`` (a connection's gate) is not read until the total falls under the
        resume mark; then ``resume()`` is called once."""
        if key in self._waiting:
            return
        self._waiting[key] = resume
        self.pauses += 1
        if not self.in_episode:
            self.in_episode = True
            self.episodes += 1
            if self.on_episode is not None:
                self.on_episode(True)

    def forget(self, key: Any) -> None:
        """``key`` went away: it waits no more."""
        self._waiting.pop(key, None)

    @property
    def stopped(self) -> int:
        return len(self._waiting)

    def _release(self) -> None:
        waiting, self._waiting = self._waiting, {}
        for resume in waiting.values():
            resume()
        if self.in_episode and not self._waiting and self.total <= self.resume_below:
            self.in_episode = False
            if self.on_episode is not None:
                self.on_episode(False)

    # -- giving memory back --------------------------------------------------------------
    def trim_due(self) -> bool:
        """True once the total fell by a sixteenth of the budget (or to nothing, from
        anything) below its highest point since the last time this answered True: freed
        memory worth handing back to the operating system."""
        mark, total = self._trim_mark, self.total
        if mark - total >= max(1, self.limit // 16) or (total == 0 and mark > 0):
            self._trim_mark = total
            return True
        return False

    def stats(self) -> dict[str, Any]:
        return {
            "limit": self.limit,
            "held": dict(self.held),
            "total": self.total,
            "peak": self.peak,
            "pauses": self.pauses,
            "episodes": self.episodes,
            "stopped": self.stopped,
            "trims": self.trims,
        }


class WindowBytes:
    """The bodies one memory window (a fast channel's or topic's queue) holds, in bytes,
    counted in the server's ``ClientMemory`` as ``kind`` (None: no byte bound)."""

    __slots__ = ("memory", "kind", "held")

    def __init__(self, memory: ClientMemory | None, kind: str):
        self.memory = memory
        self.kind = kind
        self.held = 0

    def fits(self, size: int) -> bool:
        """Whether ``size`` bytes more may wait in memory."""
        memory = self.memory
        return memory is None or memory.window_room(self.held, size)

    def bytes_left(self) -> int:
        """How many bytes more may wait in memory now (a batch asks once, then counts
        its messages against it)."""
        memory = self.memory
        return sys.maxsize if memory is None else memory.window_bytes_left(self.held)

    def add(self, delta: int) -> None:
        self.held += delta
        if self.memory is not None and delta:
            self.memory.add(self.kind, delta)

    def clear(self) -> None:
        self.add(-self.held)


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or None on another C library (musl, macOS)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes = [ctypes.c_size_t]
    trim.restype = ctypes.c_int
    return trim


_TRIM = _malloc_trim()


def release_to_os() -> bool:
    """Hand freed heap memory back to the operating system: glibc keeps freed arenas
    (and the top of the heap) for reuse, so a process whose clients left keeps its
    peak RSS otherwise. False where there is no ``malloc_trim``."""
    if _TRIM is None:
        return False
    _TRIM(0)
    return True
