"""Keeps the embedded PostgreSQL running while dmq-server runs.

Why: ``pg_ctl`` daemonises the postmaster, so nothing waits for it; when it died
(OOM killer, ``kill -9``, a crash) dmq answered ``SEND_SERVER_ERROR`` and ``/ping``
500 until an operator started it by hand, although dmq itself recovers within a
second once the database is back.  The supervisor notices the death as it
happens and starts PostgreSQL again (crash recovery included) with backoff.

* **Death is an event**, not a poll: ``pidfd_open`` gives a descriptor that
  becomes readable when the postmaster exits, even though it is not our child
  (and when it is left an unreaped zombie); the reactor watches it like a
  socket.  Where pidfds are missing (not Linux, kernel < 5.3) the postmaster's
  liveness is checked every :data:`POLL_INTERVAL` seconds instead.
* **Backoff**: the first restart is tried at once (a killed postmaster usually
  comes back on the first try); while it fails (backends of the dead postmaster
  still holding its shared memory, the port taken, a full disk) the delay
  doubles from ``min_backoff`` up to ``max_backoff``, so a persistent failure
  costs one attempt per ``max_backoff`` and a short one is over within seconds.
* **Same DSN**: restarts never move to another port (``keep_port``): every DB
  worker of the server holds the DSN and reconnects to it on its own.
* **Logs**: the death once (error), the recovery once (info, with the downtime
  and the number of attempts); a failed attempt only when its reason differs
  from the previous one, so a long outage does not flood the log.
* **Blocking work** (``pg_ctl``, reading ``/proc``) runs in the reactor's
  thread pool, never on the reactor thread; time comes from the injected clock.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Generator, Protocol, TypeVar, cast

from twisted.internet import defer, task
from twisted.internet.interfaces import IReactorFromThreads, IReactorTime, IReadDescriptor
from twisted.python.threadpool import ThreadPool
from twisted.internet.threads import deferToThreadPool
from twisted.logger import Logger
from twisted.python.failure import Failure
from zope.interface import implementer

from dmq_server.core.clock import Clock, Timer

__all__ = ["PostgresSupervisor", "MIN_BACKOFF", "MAX_BACKOFF", "POLL_INTERVAL"]

#: Seconds before the second restart attempt; doubled after each failure.
MIN_BACKOFF = 0.5
#: The longest wait between two restart attempts, in seconds.
MAX_BACKOFF = 30.0
#: How often liveness is checked where pidfd_open is not available, in seconds.
POLL_INTERVAL = 1.0
#: How long one restart attempt (crash recovery included) may take, in seconds.
START_TIMEOUT = 120.0

#: ``watch(pid, on_exit) -> cancel``: call ``on_exit()`` once when ``pid`` exits.
Watch = Callable[[int, Callable[[], None]], Callable[[], None]]
T = TypeVar("T")


class Postmaster(Protocol):
    """What the supervisor asks of the embedded PostgreSQL (``db.embedded.EmbeddedPostgres``)."""

    def pid(self) -> int | None: ...

    def start(self, timeout: float = ..., keep_port: bool = ...) -> object: ...


class RunInThread(Protocol):
    """``run(f, *args)``: a Deferred of ``f(*args)``, run off the reactor thread."""

    def __call__(self, f: Callable[..., T], *args: object) -> defer.Deferred[T]: ...


class Reactor(Clock, Protocol):
    """What the supervisor asks of the reactor: timers, a pidfd watched for reading,
    the thread pool a restart runs on (``callFromThread``: how its thread answers)."""

    def addReader(self, reader: _PidfdReader) -> None: ...
    def removeReader(self, reader: _PidfdReader) -> None: ...
    def getThreadPool(self) -> ThreadPool: ...
    def callFromThread(self, callable: Callable[..., object], *args: object, **kwargs: object) -> None: ...


@implementer(IReadDescriptor)
class _PidfdReader:
    """A pidfd in the reactor: readable once the process has exited."""

    def __init__(self, reactor: Reactor, fd: int, on_exit: Callable[[], None]):
        self._reactor, self._fd, self._on_exit = reactor, fd, on_exit

    def fileno(self) -> int:
        return self._fd

    def logPrefix(self) -> str:
        return "pg-supervisor"

    def doRead(self) -> None:
        self.cancel()
        self._on_exit()

    def connectionLost(self, reason: Failure) -> None:
        self.cancel()

    def cancel(self) -> None:
        if self._fd >= 0:
            self._reactor.removeReader(self)
            os.close(self._fd)
            self._fd = -1


def pidfd_watch(reactor: Reactor) -> Watch | None:
    """A :data:`Watch` built on ``pidfd_open``, or None where the system lacks it."""
    if not hasattr(os, "pidfd_open"):
        return None

    def watch(pid: int, on_exit: Callable[[], None]) -> Callable[[], None]:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            reactor.callLater(0, on_exit)  # already gone
            return lambda: None
        reader = _PidfdReader(reactor, fd, on_exit)
        reactor.addReader(reader)
        return reader.cancel

    try:  # ENOSYS on kernels before 5.3 (and in some sandboxes)
        os.close(os.pidfd_open(os.getpid()))
    except OSError:
        return None
    return watch


def polling_watch(clock: Clock, alive: Callable[[int], defer.Deferred], interval: float = POLL_INTERVAL) -> Watch:
    """A :data:`Watch` that asks ``alive(pid)`` (a Deferred of a bool) every ``interval``."""

    def watch(pid: int, on_exit: Callable[[], None]) -> Callable[[], None]:
        state = {"cancelled": False}

        def check() -> defer.Deferred[None]:
            d = alive(pid)

            def seen(is_alive: bool) -> None:
                if not is_alive and not state["cancelled"]:
                    loop.stop()
                    on_exit()

            # an error reading the pid file says nothing about the process: look again later
            return d.addCallback(seen).addErrback(lambda _: None)

        loop = task.LoopingCall(check)
        # IReactorTime is a zope interface, nominal to mypy; the reactor and task.Clock provide it
        loop.clock = cast(IReactorTime, clock)
        loop.start(interval, now=False).addErrback(lambda _: None)

        def cancel() -> None:
            state["cancelled"] = True
            if loop.running:
                loop.stop()

        return cancel

    return watch


def _given(reactor: Reactor | None, what: str) -> Reactor:
    """The reactor that stands in for ``what``, which was not given."""
    if reactor is None:
        raise ValueError(f"PostgresSupervisor without a reactor needs {what}")
    return reactor


class PostgresSupervisor:
    """Restarts an :class:`~dmq_server.db.embedded.EmbeddedPostgres` whose postmaster exits.

    ``embedded`` needs ``pid()`` and ``start(timeout=..., keep_port=True)``;
    ``clock`` schedules the backoff (the reactor, or ``task.Clock`` in tests);
    ``run_in_thread(f, *args)`` returns a Deferred of ``f(*args)`` run off the
    reactor thread; ``watch`` reports the postmaster's exit (default: pidfd, else
    polling).  ``restarts`` counts successful restarts (for tests and stats).
    """

    def __init__(
        self,
        embedded: Postmaster,
        reactor: Reactor | None,
        *,
        clock: Clock | None = None,
        run_in_thread: RunInThread | None = None,
        watch: Watch | None = None,
        min_backoff: float = MIN_BACKOFF,
        max_backoff: float = MAX_BACKOFF,
        log: Logger | None = None,
    ):
        if not 0 < min_backoff <= max_backoff:
            raise ValueError(f"need 0 < min_backoff <= max_backoff, got {min_backoff}, {max_backoff}")
        self.embedded = embedded
        self.clock: Clock = clock if clock is not None else _given(reactor, "clock")
        if run_in_thread is None:
            pool_reactor = _given(reactor, "run_in_thread")

            def run_in_thread(f: Callable[..., T], *args: object) -> defer.Deferred[T]:
                # IReactorFromThreads is a zope interface, nominal to mypy; Reactor holds
                # the callFromThread it needs, which the reactor provides
                threads = cast(IReactorFromThreads, pool_reactor)
                return deferToThreadPool(threads, pool_reactor.getThreadPool(), f, *args)
        self._run = run_in_thread
        if watch is None:
            watch = (pidfd_watch(reactor) if reactor is not None else None) or polling_watch(self.clock, self._alive)
        self._watch = watch
        self.min_backoff = min_backoff
        self.max_backoff = max_backoff
        self.log = log if log is not None else Logger()
        self.pid: int | None = None
        self.restarts = 0
        self._cancel_watch: Callable[[], None] | None = None
        self._pending: Timer | None = None  # the next attempt
        self._attempt_d: defer.Deferred[int | None] | None = None
        self._stopped = True
        self._down_since: float | None = None
        self._attempts = 0
        self._last_error: str | None = None

    def _alive(self, pid: int) -> defer.Deferred[bool]:
        return self._run(lambda: self.embedded.pid() == pid)

    @property
    def down(self) -> bool:
        """Whether the postmaster is known dead and not yet restarted."""
        return self._down_since is not None

    @defer.inlineCallbacks
    def start(self) -> Generator[defer.Deferred[int | None], int | None, None]:
        """Begin watching the running postmaster (call after ``embedded.start()``)."""
        self._stopped = False
        pid = yield self._run(self.embedded.pid)
        self._watch_pid(pid)

    def _watch_pid(self, pid: int | None) -> None:
        if self._stopped:
            return
        if pid is None:  # died between its start and here
            self.pid = None
            self._died()
            return
        self.pid = pid
        self._cancel_watch = self._watch(pid, self._died)

    def _died(self) -> None:
        self._cancel_watch = None
        if self._stopped or self.down:
            return
        self._down_since = self.clock.seconds()
        self._attempts = 0
        self._last_error = None
        self.log.error(
            "embedded PostgreSQL (postmaster pid {pid}) exited; restarting it", pid=self.pid
        )
        self._attempt()

    def _attempt(self) -> None:
        self._pending = None
        if self._stopped:
            return
        self._attempts += 1

        def restart() -> int | None:
            self.embedded.start(timeout=START_TIMEOUT, keep_port=True)
            return self.embedded.pid()

        d = self._run(restart)
        self._attempt_d = d
        d.addCallbacks(self._restarted, self._failed)
        d.addBoth(self._attempt_done)

    def _attempt_done(self, result: T) -> T:
        self._attempt_d = None
        return result

    def _restarted(self, pid: int | None) -> None:
        if pid is None:  # started, then died at once: the next attempt follows the backoff
            self._failed_because("the postmaster exited right after starting")
            return
        now = self.clock.seconds()
        downtime = now - (self._down_since if self._down_since is not None else now)
        self.restarts += 1
        self.log.info(
            "embedded PostgreSQL restarted (postmaster pid {pid}) after {attempts} attempt(s), "
            "{downtime:.1f} s down",
            pid=pid, attempts=self._attempts, downtime=downtime,
        )
        self._down_since = None
        self._watch_pid(pid)

    def _failed(self, failure: Failure) -> None:
        self._failed_because(failure.getErrorMessage())

    def _failed_because(self, reason: str) -> None:
        if self._stopped:
            return
        delay = min(self.max_backoff, self.min_backoff * 2 ** (self._attempts - 1))
        if reason != self._last_error:
            self._last_error = reason
            self.log.warn(
                "restarting the embedded PostgreSQL failed (attempt {attempts}, next in {delay:.1f} s, "
                "then at most every {most:.0f} s): {reason}",
                attempts=self._attempts, delay=delay, most=self.max_backoff, reason=reason,
            )
        self._pending = self.clock.callLater(delay, self._attempt)

    @defer.inlineCallbacks
    def stop(self) -> Generator[defer.Deferred[None], object, None]:
        """Stop watching and restarting; waits for an attempt under way to finish."""
        self._stopped = True
        if self._cancel_watch is not None:
            self._cancel_watch()
            self._cancel_watch = None
        if self._pending is not None and self._pending.active():
            self._pending.cancel()
        self._pending = None
        if self._attempt_d is not None:
            done: defer.Deferred[None] = defer.Deferred()

            def finished(result: T) -> T:
                done.callback(None)
                return result

            self._attempt_d.addBoth(finished)
            yield done
