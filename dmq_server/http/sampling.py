"""What the HTTP port shows that is sampled on a timer, never computed in a request.

* ``StoredGauges``: the figures ``/metrics`` needs from PostgreSQL (each channel's oldest
  unacknowledged message, delayed messages per topic, stored dead letters by reason) and
  the database's round-trip time, read every ``--metrics-db-interval`` on a connection of
  their own, and sooner when a channel's oldest copy has no age yet (``refresh_unread``).
  A scrape reads the last values: Prometheus' client renders synchronously, and a scrape
  must not queue behind (or add to) a slow database.
* ``History``: the last minutes of every channel (depth, in flight, deferred, and the
  counters rates come from), sampled from memory every few seconds, for the web console's
  charts. Bounded: ``points`` samples per channel, channels only while they exist.

* ``Pauses``: the reactor's lateness on a timer and the garbage collector's pauses
  (``core.stalls``), for ``/metrics``, ``/stats`` and nsqd's ``gc_pause_usec_*``.

All are services on the injected clock, run by the listeners' stage.
"""

from __future__ import annotations

from collections import deque
from typing import Callable, Iterable, Mapping

from twisted.application.internet import TimerService
from twisted.application.service import MultiService, Service
from twisted.internet.defer import Deferred, succeed
from twisted.python.failure import Failure

from dmq_server.core.clock import Clock
from dmq_server.core.gauges import Gauges, GaugeSnapshot
from dmq_server.core.stalls import GcPauses, ReactorLag
from dmq_server.db.runner import StepRunner
from dmq_server.db.schema import ping_steps
from dmq_server.db.trace_steps import read_gauges_steps

__all__ = ["StoredGauges", "History", "Pauses", "Sampling", "HISTORY_INTERVAL", "HISTORY_POINTS"]

#: the console's charts: a sample every 5 s, the last 10 minutes
HISTORY_INTERVAL = 5.0
HISTORY_POINTS = 120

#: ``(store, topic, channel, stats)`` of one channel: its stats are /stats' JSON
ChannelSample = tuple[str, str, str, Mapping[str, object]]

#: what a channel's sample keeps, from its stats
SAMPLED = ("depth", "in_flight_count", "deferred_count", "message_count", "ack_count", "requeue_count",
           "timeout_count")


def merge_gauges(one: Gauges, two: Gauges) -> Gauges:
    """Two clusters' ``read_gauges`` as one node's: the oldest of a channel's copies,
    delayed messages and dead letters added up."""
    oldest = dict(one["oldest_unacked_ms"])
    for key, ms in two["oldest_unacked_ms"].items():
        known = [m for m in (oldest.get(key), ms) if m is not None]
        oldest[key] = min(known) if known else None
    delayed = dict(one["delay_pending"])
    for topic, (count, due) in two["delay_pending"].items():
        have, have_due = delayed.get(topic, (0, None))
        dues = [d for d in (have_due, due) if d is not None]
        delayed[topic] = (have + count, min(dues) if dues else None)
    letters = dict(one["dead_letters"])
    for reason, (total, replayed) in two["dead_letters"].items():
        t, r = letters.get(reason, (0, 0))
        letters[reason] = (t + total, r + replayed)
    return {"oldest_unacked_ms": oldest, "delay_pending": delayed, "dead_letters": letters}


class StoredGauges:
    """The last database-derived figures, refreshed by ``refresh`` (a timer's call)."""

    def __init__(self, db: StepRunner, clock: Clock, others: Iterable[StepRunner] = (),
                 lowest: Callable[[], dict[tuple[str, str], int | None]] = dict):
        self.db = db
        # each channel's lowest unacknowledged id (the stores' depth counts), read on the
        # reactor thread when a refresh starts: its publish time is the oldest's age
        self.lowest = lowest
        self.others = list(others)  # the other PostgreSQL clusters' workers: their figures are added
        self.clock = clock
        self.values: Gauges | None = None
        self.refreshed_at: float | None = None
        self.roundtrip: float | None = None  # seconds, the last ping through the worker
        self.failures = 0
        self._busy = False
        self._asked: dict[tuple[str, str], int | None] = {}  # the lowest ids the last read looked up

    def refresh(self) -> Deferred:
        if self._busy:  # the last refresh is still out (a slow database): skip this turn
            return succeed(None)
        self._busy = True
        started = self.clock.seconds()

        asked: dict[tuple[str, str], int | None] = {}

        def pinged(_: object) -> Deferred[Gauges]:
            self.roundtrip = self.clock.seconds() - started
            lowest = self.lowest()
            asked.update(lowest)

            def add(values: Gauges, db: StepRunner) -> Deferred[Gauges]:
                """Another cluster's figures added; one that fails to answer is left out this turn."""
                more: Deferred[Gauges] = db.run_steps(read_gauges_steps, lowest)
                return more.addCallbacks(lambda more: merge_gauges(values, more), lambda _: values)

            d: Deferred[Gauges] = self.db.run_steps(read_gauges_steps, lowest)
            for other in self.others:
                d.addCallback(add, other)
            return d

        def read(values: Gauges) -> None:
            self.values = values
            self.refreshed_at = self.clock.seconds()
            self._asked = asked

        def failed(failure: Failure) -> None:
            self.failures += 1  # the last values stay; their age says how stale they are

        def done(_: object) -> None:
            self._busy = False

        return self.db.run_steps(ping_steps).addCallback(pinged).addCallbacks(read, failed).addBoth(done)

    def refresh_unread(self) -> Deferred:
        """``refresh`` now if a channel has an oldest copy (the depth count's lowest id)
        that the last read did not look up and so shows no age. Why: the depth and the
        age come from two timers (``--channel-state-interval``, 5 s; ``--metrics-db-interval``,
        15 s), so a channel whose first copies a pass had just counted showed its depth
        (500) and no oldest ("–") for up to 15 s; checked every ``HISTORY_INTERVAL``, the
        age follows the depth within one. A channel that already shows an age keeps it
        until the next timed read (if that copy was acknowledged meanwhile, the age shown is
        its own: older than the oldest now)."""
        shown = self.values["oldest_unacked_ms"] if self.values is not None else {}
        unread = any(
            message_id is not None and shown.get(key) is None and message_id != self._asked.get(key)
            for key, message_id in self.lowest().items()
        )
        return self.refresh() if unread else succeed(None)

    def snapshot(self) -> GaugeSnapshot:
        """A copy for a scrape (taken on the reactor thread)."""
        return {
            "values": self.values,
            "age": None if self.refreshed_at is None else self.clock.seconds() - self.refreshed_at,
            "roundtrip": self.roundtrip,
            "failures": self.failures,
            "now": self.clock.seconds(),
        }


def _count(value: object) -> int:
    """A sampled figure (an int in /stats' JSON; missing: 0)."""
    return value if isinstance(value, int) else 0


class History:
    """Per channel, the last ``points`` samples of its figures. ``channels()`` yields
    ``(store, topic, channel, stats)`` for every channel there is now."""

    def __init__(self, channels: Callable[[], Iterable[ChannelSample]], clock: Clock,
                 points: int = HISTORY_POINTS):
        self._channels = channels
        self.clock = clock
        self.points = points
        self.times: deque[float] = deque(maxlen=points)
        self.series: dict[tuple[str, str, str], deque[tuple[float, ...]]] = {}

    def sample(self) -> None:
        now = self.clock.seconds()
        self.times.append(now)
        seen = set()
        for store, topic, channel, stats in self._channels():
            key = (store, topic, channel)
            seen.add(key)
            series = self.series.get(key)
            if series is None:
                series = self.series[key] = deque(maxlen=self.points)
            series.append((now, *(_count(stats.get(name)) for name in SAMPLED)))
        for key in [k for k in self.series if k not in seen]:
            del self.series[key]  # the channel is gone

    def export(self, topic: str | None = None) -> dict[str, object]:
        """JSON for the console: every channel's (of one topic's) samples as columns."""
        out = []
        for (store, t, channel), samples in sorted(self.series.items()):
            if topic is not None and t != topic:
                continue
            columns = list(zip(*samples)) if samples else [()] * (len(SAMPLED) + 1)
            out.append({
                "store": store, "topic": t, "channel": channel,
                "t": [round(x, 3) for x in columns[0]],
                **{name: list(values) for name, values in zip(SAMPLED, columns[1:])},
            })
        return {"interval": HISTORY_INTERVAL, "points": self.points, "channels": out}


class Pauses(Service):
    """The reactor's lag probe and the collector's hook, on while the service runs: the
    hook is process-wide (``gc.callbacks``), so a stopped node takes it out again."""

    def __init__(self, clock: Clock, lag: ReactorLag | None = None, collector: GcPauses | None = None):
        self.lag = lag if lag is not None else ReactorLag(clock)
        self.collector = collector if collector is not None else GcPauses()

    def startService(self) -> None:
        super().startService()
        self.lag.start()
        self.collector.install()

    def stopService(self) -> Deferred[None] | None:
        self.lag.stop()
        self.collector.uninstall()
        return super().stopService()

    def stats(self) -> dict[str, object]:
        """``/stats``' ``pauses``: the worst lateness, the collections, the latest stalls."""
        return {"reactor_lag": self.lag.stats(), "gc": self.collector.stats()}


class Sampling:
    """The HTTP port's timers: stored gauges every ``gauges_interval``, history every
    ``HISTORY_INTERVAL``. ``timers`` is adopted by the listeners' stage."""

    def __init__(self, db: StepRunner, clock: Clock, channels: Callable[[], Iterable[ChannelSample]],
                 gauges_interval: float, others: Iterable[StepRunner] = (),
                 lowest: Callable[[], dict[tuple[str, str], int | None]] = dict):
        self.gauges = StoredGauges(db, clock, others, lowest)
        self.history = History(channels, clock)
        self.pauses = Pauses(clock)
        self.timers = MultiService()
        self.pauses.setName("pauses")
        self.pauses.setServiceParent(self.timers)
        for name, step, fn in (("stored-gauges", gauges_interval, self.gauges.refresh),
                               ("stored-gauges-unread", HISTORY_INTERVAL, self.gauges.refresh_unread),
                               ("history", HISTORY_INTERVAL, self.history.sample)):
            timer = TimerService(step, fn)
            timer.clock = clock
            timer.setName(name)
            timer.setServiceParent(self.timers)
