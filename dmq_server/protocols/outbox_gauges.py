"""Each relayed outbox's figures for operators, read on a connection of their own.

``core.outbox_figures`` says what is read; this is the Twisted side: per outbox, one
worker connection to the application's database (besides the relay's) reads the figures
every ``MEASURE_EVERY`` seconds, the next reading timed from the end of the last one, so
a slow database is never asked twice at once. Its own connection because the figures
matter most when the relay is stuck: a relay whose delete waits for a row lock, or whose
database call hangs, cannot measure, and a reading on its connection would add a round
trip to the relay's cycle. Every node reads, relaying or not: a node standing by still
shows what waits and which node holds the lock.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from twisted.internet.defer import Deferred, ensureDeferred, succeed
from twisted.logger import Logger

from dmq_server.core.clock import Clock, Timer
from dmq_server.core.outbox_figures import MEASURE_EVERY, PENDING_BOUND, Measured
from dmq_server.core.outbox_rows import OutboxSource
from dmq_server.db import outbox

__all__ = ["OutboxGauge", "GaugeDb"]

log = Logger()

T = TypeVar("T")

#: seconds between readings while they fail (the relay logs the database's state itself)
RETRY = 30.0


class GaugeDb(Protocol):
    """The connection a gauge reads on: ``db.worker.DbWorker``'s calls."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def run(self, fn: Callable[..., T], *args: object) -> Deferred[T]: ...


class OutboxGauge:
    """One outbox's last reading (``measured``, taken at ``measured_at`` by ``clock``)."""

    def __init__(self, source: OutboxSource, db: GaugeDb, clock: Clock):
        self.source = source
        self._db = db
        self._clock = clock
        self._q = outbox.relay_queries(source.schema)
        self.measured: Measured | None = None
        self.measured_at = 0.0
        self._timer: Timer | None = None
        self._reading: Deferred[None] | None = None
        self._failing = False
        self._running = False

    def start(self) -> None:
        self._db.start()
        self._running = True
        self._read()

    def stop(self) -> Deferred[None]:
        """No reading after this; fires once the one under way (if any) ended."""
        self._running = False
        if self._timer is not None and self._timer.active():
            self._timer.cancel()
        self._timer = None
        reading = self._reading
        if reading is None or reading.called:
            self._db.stop()
            return succeed(None)
        return reading.addCallback(lambda _: self._db.stop())

    def _read(self) -> None:
        self._timer = None
        self._reading = ensureDeferred(self._take())

    async def _take(self) -> None:
        pause = MEASURE_EVERY
        try:
            measured = await self._db.run(outbox.read_figures, self._q, self.source.schema, PENDING_BOUND)
        except Exception as exc:  # the database's failure: the old reading stays, its age grows
            pause = RETRY
            if not self._failing:
                log.warn("outbox {name}: its figures were not read ({why}); trying every {retry:g}s",
                         name=self.source.name, why=exc, retry=RETRY)
            self._failing = True
        else:
            if self._failing:
                log.info("outbox {name}: its figures are read again", name=self.source.name)
            self._failing = False
            self.measured, self.measured_at = measured, self._clock.seconds()
        self._reading = None
        if self._running:
            self._timer = self._clock.callLater(pause, self._read)
