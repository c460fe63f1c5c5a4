"""Every reliable channel's stored depth, counted a slice at a time.

A channel's depth (``/stats``, ``/metrics``, the console) counts the copies stored in
PostgreSQL and not acknowledged yet, whichever node stored them. Counting them reads every
stored copy: 0.3-0.45 s of a PostgreSQL backend for a backlog of 400,000 on the 2-core test
machine. Read in one statement every ``--channel-state-interval`` (5 s), that burst took a
core from the group commit's backends, and the commits queued behind it were the steady
scenario's latency tail, at the same second of every five (docs/benchmarks.md, session 14).

So a pass walks the stored messages in id order, a slice of ``rows`` at a time
(``db.messages.depth_slice_steps``), and adds up each channel's copies; the pass's sums
become the channels' stored counts when it reaches the last message, and the lowest id it
saw per channel that channel's oldest unacknowledged message (``/metrics`` reads its
publish time: one probe by primary key, where reading it per channel from the pending
view took 3.1 s of a backend with 400,000 stored). Two rules bound what
it costs, whatever the backlog:

* each slice aims at ``SLICE_SECONDS`` (2 ms): the next slice's rows are scaled by how long
  this one took, and at most doubled (one slice answered fast, from cached pages, must not
  make the next ten times as long);
* after a slice that took ``t``, the next starts ``t / DUTY`` later (at least ``MIN_PAUSE``):
  the count keeps one backend busy at most ``DUTY`` (5 %) of the time; a pass starts at most
  once per ``period``.

Why 2 ms and not 10: a slice holds one of the machine's cores while the group commit's
backends need it. Over three alternated full sequences on the 2-core test machine the steady
scenario's median per-second p99 was 5.2-6.3 ms with 2 ms slices against 6.5-7.0 ms with
10 ms ones, and 11-18 commits over 5 ms against 20-34 (docs/benchmarks.md, session 16). A
pass keeps the same share of a backend in more, smaller statements, whose fixed cost makes it
somewhat longer (not measured).

A small backlog is one slice, counted every ``period`` as before. A large one is counted
over several seconds (400,000 copies: an estimated 7 to 22 s): the depth is then as old as the last
pass, and not a snapshot (a copy acknowledged after its slice was counted still counts
until the next pass). New messages committed below the pass's position are counted by the
next pass. A failed slice drops the pass; the next starts after ``period``.
"""

from __future__ import annotations

from typing import Callable

from twisted.application.service import Service
from twisted.internet.defer import Deferred
from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_server.core.clock import Clock, Timer
from dmq_server.db.runner import StepRunner
from dmq_server.db.storage_errors import StorageError
from dmq_server.db.messages import depth_slice_steps

__all__ = ["DepthCount", "DUTY", "SLICE_SECONDS"]

log = Logger()

#: the share of one PostgreSQL backend the count may keep busy
DUTY = 0.05
#: what a slice aims to cost
SLICE_SECONDS = 0.002
#: the shortest pause between slices (a database answering at once: tests, the double);
#: below SLICE_SECONDS / DUTY, so the duty, not this, paces slices of the aimed cost
MIN_PAUSE = 0.02
#: bounds of a slice's size in stored messages
MIN_ROWS, FIRST_ROWS, MAX_ROWS = 500, 5_000, 200_000


Counts = dict[tuple[str, str], int]


class DepthCount(Service):
    """Passes over the stored messages on ``db`` (an admin worker), each one's sums and
    lowest ids handed to ``apply({(topic, channel): copies}, {(topic, channel): id})``
    when complete."""

    def __init__(self, db: StepRunner, clock: Clock, apply: Callable[[Counts, Counts], None], period: float,
                 *, rows: int = FIRST_ROWS, min_rows: int = MIN_ROWS, max_rows: int = MAX_ROWS):
        self.db = db
        self.clock = clock
        self.apply = apply
        self.period = period
        self.rows = rows  # the next slice's size, scaled after each slice
        self.min_rows, self.max_rows = min_rows, max_rows
        self.passes = 0
        self.counted_at: float | None = None  # when the last pass completed
        self._low: int | None = None  # where the next slice starts; None: a new pass
        self._sums: Counts = {}
        self._lowest: Counts = {}  # per channel, the lowest pending id of the pass so far
        self._pass_started = 0.0
        self._timer: Timer | None = None
        self._busy = False
        self._generation = 0  # bumped by ``restart``: a slice of an abandoned pass is not added

    def startService(self) -> None:
        super().startService()
        self._schedule(0.0)

    def stopService(self) -> Deferred[None] | None:
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        return super().stopService()

    def restart(self) -> None:
        """Drop the pass in progress (its sums include copies an operator just emptied):
        the next slice begins a new pass."""
        self._generation += 1
        self._low = None
        self._sums, self._lowest = {}, {}

    def _schedule(self, delay: float) -> None:
        if self.running and self._timer is None:
            self._timer = self.clock.callLater(delay, self._slice)

    def _slice(self) -> None:
        self._timer = None
        if self._busy:
            return
        started = self.clock.seconds()
        if self._low is None:
            self._pass_started = started
            self._sums, self._lowest = {}, {}
        self._busy = True
        d = self.db.run_steps(depth_slice_steps, self._low, self.rows)
        d.addCallbacks(self._counted, self._failed, callbackArgs=(started, self._generation),
                       errbackArgs=(self._generation,))

    def _counted(self, result: tuple[int, int | None, Counts, Counts], started: float, generation: int) -> None:
        self._busy = False
        now = self.clock.seconds()
        took = now - started
        if generation != self._generation:  # restarted meanwhile
            self._schedule(MIN_PAUSE)
            return
        _, high, counts, lowest = result
        for key, copies in counts.items():
            self._sums[key] = self._sums.get(key, 0) + copies
        for key, message_id in lowest.items():  # slices go up in id order: the first one seen is lowest
            self._lowest.setdefault(key, message_id)
        scaled = self.rows * SLICE_SECONDS / took if took > 0 else self.rows * 2
        self.rows = int(min(self.max_rows, self.rows * 2, max(self.min_rows, scaled)))
        pause = max(MIN_PAUSE, took / DUTY)
        if high is None:  # the pass reached the last stored message
            self._low = None
            self.passes += 1
            self.counted_at = now
            try:
                self.apply(dict(self._sums), dict(self._lowest))
            except Exception:
                log.failure("applying the stored depths failed")
            pause = max(pause, self._pass_started + self.period - now)
        else:
            self._low = high
        self._schedule(pause)

    def _failed(self, failure: Failure, generation: int) -> None:
        self._busy = False
        if not failure.check(StorageError):
            log.failure("counting the stored depths failed", failure)
        self._low = None  # a new pass, once PostgreSQL answers again
        self._schedule(self.period)
