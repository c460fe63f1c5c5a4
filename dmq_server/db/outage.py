"""Logging an outage once: when it starts, and when it ends.

A dependency that fails (PostgreSQL down, a restart in progress) makes every batcher,
loader and worker retry with backoff; a line per retry buried the one line an operator
needs (51 warnings in 20 s), and a line per component still made a dozen. Each retrying
component holds an ``Outage`` of the dependency it uses; the components of one
dependency share a ``Dependency``, so that:

* the first failure of any of them logs one warning (the outage started: which
  component saw it, and why);
* further failures, of it or of the others, log nothing (``debug`` names them);
* the first success after them logs one line: how long the dependency was failing and
  how many attempts failed meanwhile, all components together.

A component that failed during the outage and works again later logs nothing more. A
failure after the end is a new outage.

The end of an outage also wakes the components still waiting to retry (those given a
``wake``): one that backed off to its longest wait (the durable acks: 5 s) would
otherwise stay idle for up to that long after PostgreSQL answers another component
again, with acknowledgements held in memory and copies redelivered meanwhile. A woken
component retries at once, on its own clock, in a reactor turn of its own (never
inside the call that saw the dependency work).
"""

from __future__ import annotations

from typing import Callable

from twisted.logger import Logger

from dmq_server.core.clock import Clock

__all__ = ["Outage", "Dependency", "POSTGRESQL"]

log = Logger()


class Dependency:
    """Something many components use; its outage is logged once for all of them."""

    def __init__(self, name: str):
        self.name = name
        self.since: float | None = None  # when the current outage started
        self.failures = 0
        # the components whose last attempt failed and that retry on a timer (``Outage.wake``)
        self.waiting: set[Outage] = set()

    def failed(self, what: str, why: object, now: float, first: bool = True) -> None:
        """``first``: the component's first failure since it last worked (its retries
        are counted, not logged)."""
        self.failures += 1
        if self.since is None:
            self.since = now
            log.warn(
                "{dependency} outage: {what} failing ({why}); retrying quietly until it works",
                dependency=self.name, what=what, why=why,
            )
        elif first:
            log.debug("{dependency} outage: {what} failing too ({why})", dependency=self.name, what=what, why=why)

    def recovered(self, what: str, now: float) -> None:
        if self.since is None:
            return
        log.info(
            "{dependency} outage over after {seconds:.1f}s ({failures} failed attempts; {what} works again)",
            dependency=self.name, seconds=now - self.since, failures=self.failures, what=what,
        )
        self.since = None
        self.failures = 0
        for outage in list(self.waiting):
            outage.woken()


#: the database every component of a node uses; one per process, as the log is
POSTGRESQL = Dependency("PostgreSQL")


class Outage:
    """The failing/working state of one component, as the log sees it."""

    def __init__(self, what: str, clock: Clock, dependency: Dependency | None = None,
                 wake: Callable[[], None] | None = None):
        self.what = what
        self.clock = clock
        self.dependency = dependency or POSTGRESQL
        self.since: float | None = None  # when this component's failures started
        self.failures = 0
        # retry now: called when the dependency works again for another component while
        # this one waits (``Dependency.recovered``); None: it is not woken
        self.wake = wake

    @property
    def ongoing(self) -> bool:
        return self.since is not None

    def failed(self, why: object) -> None:
        self.failures += 1
        now = self.clock.seconds()
        first = self.since is None
        if first:
            self.since = now
        self.dependency.failed(self.what, why, now, first)
        if self.wake is not None:
            self.dependency.waiting.add(self)

    def recovered(self) -> None:
        self.dependency.waiting.discard(self)
        if self.since is not None:
            self.dependency.recovered(self.what, self.clock.seconds())
            self.since = None
            self.failures = 0

    def woken(self) -> None:
        """The dependency works again: retry in a turn of its own (once: the component
        is listed again if that attempt fails)."""
        self.dependency.waiting.discard(self)
        if self.wake is not None:
            self.clock.callLater(0, self.wake)

    def close(self) -> None:
        """The component stopped: nothing to wake."""
        self.dependency.waiting.discard(self)
