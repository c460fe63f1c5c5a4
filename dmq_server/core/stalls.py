"""What holds the reactor thread up: its lateness on a timer, and the garbage collector.

Why: a reliable send is answered by the reactor thread once its group commit returns,
so anything that keeps that thread from running (a long callback, a collection of the
old generation, a host that takes the CPU away) is added to every answer due in the
meantime. The group-commit histograms time the database; these two time the rest, so
that a tail in publish->ack latency can be put on the one or the other
(docs/observability.md).

* ``ReactorLag`` asks the clock for a call every ``interval`` seconds and records how
  late each call ran (Node's and Go's "event loop lag"). A stall shorter than the
  interval is seen only when a call fell due inside it, so the interval is short
  (25 ms: 40 calls a second, about 1 ms of CPU).
* ``GcPauses`` is a ``gc.callbacks`` hook: the length of every collection, whichever
  thread ran it (a collection stops every thread), by generation. nsqd's ``/stats``
  reports Go's last 256 pauses as percentiles; ``percentiles_usec`` gives the same
  figures for Python's.

Both keep the latest stalls of at least ``STALL_SECONDS`` with their wall-clock time,
bounded, so that an operator (or a benchmark) can line them up with a latency spike.
Standard library only: the clock is injected (the reactor, or ``task.Clock`` in tests).
"""

from __future__ import annotations

import gc
import math
import time
from collections import deque
from typing import Callable, Mapping

from dmq_server.core.buckets import Buckets
from dmq_server.core.clock import Clock, Timer

__all__ = ["ReactorLag", "GcPauses", "LAG_SECONDS", "GC_SECONDS", "STALL_SECONDS", "RECENT_PAUSES"]

#: lateness of the reactor's timer: 1 ms to 10 s
LAG_SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
#: a collection: 0.1 ms (a young generation) to 1 s (the whole heap of a big process)
GC_SECONDS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)
#: lateness or a pause at least this long is kept among the recent stalls
STALL_SECONDS = 0.01
#: stalls kept (each kind)
RECENT_STALLS = 32
#: pauses the percentiles are taken over (Go's runtime keeps its last 256)
RECENT_PAUSES = 256


class ReactorLag:
    """Lateness of a call asked for every ``interval`` seconds on ``clock``."""

    def __init__(self, clock: Clock, interval: float = 0.025, wall: Callable[[], float] = time.time):
        if interval <= 0:
            raise ValueError("interval must be positive")
        self.clock = clock
        self.interval = interval
        self.wall = wall
        self.buckets = Buckets(LAG_SECONDS)
        self.worst = 0.0
        #: ``(wall time the call was due, seconds late)``, newest last
        self.stalls: deque[tuple[float, float]] = deque(maxlen=RECENT_STALLS)
        self._call: Timer | None = None
        self._due = 0.0

    @property
    def running(self) -> bool:
        return self._call is not None

    def start(self) -> None:
        if self._call is None:
            self._schedule(self.clock.seconds())

    def stop(self) -> None:
        if self._call is not None:
            if self._call.active():
                self._call.cancel()
            self._call = None

    def _schedule(self, now: float) -> None:
        self._due = now + self.interval
        self._call = self.clock.callLater(self.interval, self._tick)

    def _tick(self) -> None:
        now = self.clock.seconds()
        late = max(0.0, now - self._due)
        self.buckets.observe(late)
        if late > self.worst:
            self.worst = late
        if late >= STALL_SECONDS:
            self.stalls.append((self.wall() - late, late))
        self._schedule(now)  # the next call an interval after this one ran: one lateness per stall

    def stats(self) -> dict[str, object]:
        return {
            "interval_s": self.interval,
            "samples": self.buckets.count,
            "worst_s": self.worst,
            "stalls": [{"at": at, "seconds": late} for at, late in self.stalls],
        }


class GcPauses:
    """Every collection's length, from ``gc.callbacks``' start and stop."""

    def __init__(self, timer: Callable[[], float] = time.perf_counter, wall: Callable[[], float] = time.time,
                 hooks: list | None = None):
        self.timer = timer
        self.wall = wall
        self.hooks = gc.callbacks if hooks is None else hooks
        self.buckets = Buckets(GC_SECONDS)
        self.by_generation = [0, 0, 0]
        self.recent: deque[float] = deque(maxlen=RECENT_PAUSES)
        #: ``(wall time the collection started, seconds, generation)``, newest last
        self.stalls: deque[tuple[float, float, int]] = deque(maxlen=RECENT_STALLS)
        self._started: float | None = None

    def install(self) -> None:
        if self.callback not in self.hooks:
            self.hooks.append(self.callback)

    def uninstall(self) -> None:
        while self.callback in self.hooks:
            self.hooks.remove(self.callback)

    def callback(self, phase: str, info: Mapping[str, int]) -> None:
        """Called by the interpreter around each collection (on the collecting thread;
        collections never overlap, so this is the only writer)."""
        if phase == "start":
            self._started = self.timer()
            return
        if self._started is None:  # installed during a collection
            return
        seconds = max(0.0, self.timer() - self._started)
        self._started = None
        generation = int(info.get("generation", 0))
        if 0 <= generation < len(self.by_generation):
            self.by_generation[generation] += 1
        self.buckets.observe(seconds)
        self.recent.append(seconds)
        if seconds >= STALL_SECONDS:
            self.stalls.append((self.wall() - seconds, seconds, generation))

    def percentiles_usec(self) -> dict[int, int]:
        """The 100th, 99th and 95th percentile of the last ``RECENT_PAUSES`` pauses in
        microseconds (nearest rank; 0 when none), nsqd's ``gc_pause_usec_*``."""
        pauses = sorted(self.recent)
        out = {}
        for pct in (100, 99, 95):
            if not pauses:
                out[pct] = 0
                continue
            rank = min(len(pauses), max(1, math.ceil(pct / 100 * len(pauses))))
            out[pct] = round(pauses[rank - 1] * 1_000_000)
        return out

    def stats(self) -> dict[str, object]:
        return {
            "collections": list(self.by_generation),
            "seconds": self.buckets.total,
            "percentiles_usec": self.percentiles_usec(),
            "stalls": [{"at": at, "seconds": s, "generation": g} for at, s, g in self.stalls],
        }
