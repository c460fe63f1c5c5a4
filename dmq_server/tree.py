"""An ordered tree of Twisted services: each stage starts after the one before it
has finished starting, and they stop in reverse, one at a time.

Twisted's ``MultiService`` starts its children all at once and ignores the Deferred
a child's ``startService`` returns; a server whose listeners must wait for the
database, the registry and the stores needs the opposite. ``ServiceTree`` walks its
stages in order and waits for each; a failed start stops what had started, in
reverse, and fails the tree's ``ready``. A ``Stage`` is one named step: a ``start``
and a ``stop`` (either may return a Deferred) and, optionally, a component's
periodic jobs (a ``MultiService`` of named ``TimerService``s) that run only while
the stage is up: adopted once ``start`` has finished, stopped before ``stop`` runs.
"""

from __future__ import annotations

from typing import Callable, Generator, cast

from twisted.application.service import MultiService, Service
from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_server.core.clock import Clock

__all__ = ["ServiceTree", "Stage", "StoppedWhileStarting"]

log = Logger()


class StoppedWhileStarting(Exception):
    """The tree was asked to stop before every stage had started."""


class Stage(MultiService):
    """One step of the tree. ``timers`` (called after ``start``) gives the component's
    timer services; a timer whose call is still running when the stage stops is
    waited for at most ``grace`` seconds on ``clock`` (a query stuck on a paused
    database must not hold the shutdown)."""

    def __init__(
        self,
        name: str,
        start: Callable[[], object],
        stop: Callable[[], object] | None = None,
        *,
        timers: Callable[[], MultiService] | None = None,
        clock: Clock | None = None,
        grace: float = 5.0,
    ):
        super().__init__()
        self.setName(name)
        self._start = start
        self._stop = stop
        self._timers = timers
        self._clock = clock
        self._grace = grace

    def startService(self) -> defer.Deferred:
        Service.startService(self)  # running from here on: a half-done start is undone by stop

        def adopt_timers(_: object) -> None:
            if self._timers is not None:
                timers = self._timers()
                timers.setName("timers")
                timers.setServiceParent(self)  # started now: the stage is running

        return defer.maybeDeferred(self._start).addCallback(adopt_timers)

    @defer.inlineCallbacks
    def stopService(self) -> Generator[defer.Deferred, object, None]:
        Service.stopService(self)
        children = list(self)
        if children:
            stopped: defer.Deferred = defer.gatherResults(
                [defer.maybeDeferred(child.stopService) for child in reversed(children)], consumeErrors=True
            )
            if self._clock is not None:
                # IReactorTime is a zope interface, nominal to mypy; the reactor and task.Clock provide it
                stopped.addTimeout(self._grace, cast(IReactorTime, self._clock))
            try:
                yield stopped
            except defer.TimeoutError:
                log.warn("{stage}: a timer's call still runs after {grace}s; not waiting", stage=self.name, grace=self._grace)
            except Exception:
                log.failure("{stage}: stopping its timers failed", stage=self.name)
            for child in children:
                yield defer.maybeDeferred(self.removeService, child)
        if self._stop is not None:
            yield defer.maybeDeferred(self._stop)


class ServiceTree(MultiService):
    """Stages started in the order added; ``ready`` fires when the last has started
    (or fails with the first failure, after the started stages were stopped)."""

    def __init__(self) -> None:
        super().__init__()
        self.ready: defer.Deferred = defer.Deferred()

    def startService(self) -> None:
        Service.startService(self)
        self._start_in_order().chainDeferred(self.ready)

    @defer.inlineCallbacks
    def _start_in_order(self) -> Generator[defer.Deferred, object, ServiceTree]:
        for stage in list(self):
            if not self.running:
                raise StoppedWhileStarting(f"stopped before {stage.name!r} started")
            try:
                yield defer.maybeDeferred(stage.startService)
            except BaseException:
                failure = Failure()
                log.error("{stage} failed to start: {why}", stage=stage.name, why=failure.getErrorMessage())
                yield self._stop_in_reverse()
                failure.raiseException()
        return self

    def stopService(self) -> defer.Deferred:
        Service.stopService(self)
        return self._stop_in_reverse()

    @defer.inlineCallbacks
    def _stop_in_reverse(self) -> Generator[defer.Deferred, object, None]:
        """Every running stage, last first; one that fails to stop is logged and the
        others still stop (a shutdown goes all the way)."""
        for stage in reversed(list(self)):
            if not stage.running:
                continue
            try:
                yield defer.maybeDeferred(stage.stopService)
            except Exception:
                log.failure("{stage} failed to stop", stage=stage.name)
