"""Unit tests of dmq_server.db.supervisor: restart on death, backoff, logging, stop.

A fake EmbeddedPostgres and an injected clock (task.Clock) make the backoff
exact; the pidfd watch is tested on a real process (its exit is the event).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys

import pytest
from twisted.internet import defer, task
from twisted.logger import LogLevel, Logger, formatEvent

from dmq_server.db.supervisor import PostgresSupervisor, pidfd_watch, polling_watch


class FakePostgres:
    """``start()`` pops the next outcome: an exception to raise, or the new pid."""

    def __init__(self, pid: int | None = 100):
        self.current = pid
        self.outcomes: list = []
        self.starts: list[tuple[float, bool]] = []
        self.clock: task.Clock | None = None

    def pid(self) -> int | None:
        return self.current

    def start(self, timeout: float = 60, keep_port: bool = False) -> str:
        self.starts.append((self.clock.seconds() if self.clock else 0.0, keep_port))
        outcome = self.outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        self.current = outcome
        return "dsn"


class FakeWatch:
    def __init__(self) -> None:
        self.watching: dict[int, object] = {}
        self.cancelled: list[int] = []

    def __call__(self, pid, on_exit):
        self.watching[pid] = on_exit

        def cancel() -> None:
            self.cancelled.append(pid)
            self.watching.pop(pid, None)

        return cancel

    def die(self, pid: int) -> None:
        self.watching.pop(pid)()


def _make(pg: FakePostgres, **kwargs):
    clock = task.Clock()
    pg.clock = clock
    watch = FakeWatch()
    events: list[dict] = []
    sup = PostgresSupervisor(
        pg, reactor=None, clock=clock, watch=watch,
        run_in_thread=lambda f, *a: defer.maybeDeferred(f, *a),
        log=Logger(observer=events.append), **kwargs,
    )
    sup.start()
    return sup, clock, watch, events


def _logged(events: list[dict], level: LogLevel) -> list[str]:
    return [formatEvent(e) for e in events if e["log_level"] == level]


def test_death_restarts_at_once_and_logs_death_and_recovery_once() -> None:
    pg = FakePostgres(pid=100)
    sup, clock, watch, events = _make(pg)
    assert list(watch.watching) == [100]
    assert not sup.down

    pg.current = None  # the postmaster is gone
    pg.outcomes = [200]
    watch.die(100)

    assert pg.starts == [(0.0, True)]  # at once, and never on another port
    assert list(watch.watching) == [200]  # the new postmaster is watched
    assert sup.restarts == 1 and not sup.down
    errors, infos = _logged(events, LogLevel.error), _logged(events, LogLevel.info)
    assert len(errors) == 1 and "pid 100" in errors[0] and "exited" in errors[0]
    assert len(infos) == 1 and "pid 200" in infos[0] and "1 attempt" in infos[0]
    assert _logged(events, LogLevel.warn) == []


def test_failed_restarts_back_off_exponentially_up_to_the_bound() -> None:
    pg = FakePostgres(pid=100)
    sup, clock, watch, events = _make(pg, min_backoff=0.5, max_backoff=4.0)
    busy = RuntimeError("pre-existing shared memory block is still in use")
    pg.outcomes = [busy] * 6 + [300]
    pg.current = None
    watch.die(100)

    # 0.5, 1, 2, 4, then capped at 4
    for _ in range(6):
        clock.advance(clock.getDelayedCalls()[0].getTime() - clock.seconds())
    assert [t for t, _ in pg.starts] == [0.0, 0.5, 1.5, 3.5, 7.5, 11.5, 15.5]
    assert not clock.getDelayedCalls()  # succeeded: nothing more scheduled
    assert sup.restarts == 1 and list(watch.watching) == [300]
    # the same reason six times is logged once; death and recovery once each
    warns = _logged(events, LogLevel.warn)
    assert len(warns) == 1 and "shared memory" in warns[0]
    assert len(_logged(events, LogLevel.error)) == 1
    infos = _logged(events, LogLevel.info)
    assert len(infos) == 1 and "7 attempt" in infos[0] and "15.5 s down" in infos[0]


def test_a_new_failure_reason_is_logged_again() -> None:
    pg = FakePostgres(pid=100)
    sup, clock, watch, events = _make(pg)
    pg.outcomes = [RuntimeError("a"), RuntimeError("a"), RuntimeError("b"), 5]
    pg.current = None
    watch.die(100)
    clock.advance(0.5)
    clock.advance(1.0)
    clock.advance(2.0)
    assert [w.rsplit(": ", 1)[1] for w in _logged(events, LogLevel.warn)] == ["a", "b"]
    assert sup.restarts == 1


def test_stop_cancels_the_pending_attempt_and_the_watch() -> None:
    pg = FakePostgres(pid=100)
    sup, clock, watch, events = _make(pg)
    pg.outcomes = [RuntimeError("port taken")]
    pg.current = None
    watch.die(100)
    assert clock.getDelayedCalls()
    done = sup.stop()
    assert done.called
    assert not clock.getDelayedCalls()
    clock.advance(100)
    assert len(pg.starts) == 1

    # a postmaster watched when stop() runs is no longer watched
    pg2 = FakePostgres(pid=7)
    sup2, _, watch2, _ = _make(pg2)
    sup2.stop()
    assert watch2.cancelled == [7] and not watch2.watching


def test_stop_waits_for_an_attempt_under_way() -> None:
    pg = FakePostgres(pid=100)
    clock = task.Clock()
    pg.clock = clock
    watch = FakeWatch()
    pending: list[defer.Deferred] = []

    def later(f, *a):
        d = defer.Deferred()
        d.addCallback(lambda _: f(*a))
        pending.append(d)
        return d

    sup = PostgresSupervisor(pg, None, clock=clock, watch=watch, run_in_thread=later,
                             log=Logger(observer=lambda e: None))
    sup.start()
    pending.pop(0).callback(None)  # start(): pid() answered
    pg.current = None
    pg.outcomes = [42]
    watch.die(100)
    stopped = sup.stop()
    assert not stopped.called  # the restart is still running
    pending.pop(0).callback(None)
    assert stopped.called
    assert not watch.watching  # not watched after stop, although it started


def test_dead_before_watching_is_restarted() -> None:
    pg = FakePostgres(pid=None)
    pg.outcomes = [9]
    sup, clock, watch, events = _make(pg)
    assert sup.restarts == 1 and list(watch.watching) == [9]


def test_backoff_bounds_are_checked() -> None:
    with pytest.raises(ValueError):
        PostgresSupervisor(FakePostgres(), None, clock=task.Clock(), watch=FakeWatch(),
                           min_backoff=5, max_backoff=1)


def test_polling_watch_reports_exit_once() -> None:
    clock = task.Clock()
    alive = {"value": True}
    exits: list[int] = []
    watch = polling_watch(clock, lambda pid: defer.succeed(alive["value"]), interval=1.0)
    cancel = watch(5, lambda: exits.append(5))
    clock.advance(1)
    clock.advance(1)
    assert exits == []
    alive["value"] = False
    clock.advance(1)
    clock.advance(1)
    assert exits == [5]
    cancel()  # harmless after the exit


@pytest.mark.skipif(pidfd_watch(object()) is None, reason="no pidfd_open on this system")
def test_pidfd_watch_fires_when_an_unreaped_process_exits() -> None:
    """The descriptor becomes readable when the process exits although nobody reaps it
    (a killed postmaster re-parented to a PID 1 that does not reap stays a zombie)."""

    class Reactor:
        def __init__(self) -> None:
            self.readers: list = []

        def addReader(self, r) -> None:
            self.readers.append(r)

        def removeReader(self, r) -> None:
            self.readers.remove(r)

        def callLater(self, delay, f, *a):
            f(*a)

    reactor = Reactor()
    watch = pidfd_watch(reactor)
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        exits: list[bool] = []
        watch(proc.pid, lambda: exits.append(True))
        (reader,) = reactor.readers
        assert select.select([reader.fileno()], [], [], 0)[0] == []  # alive: not readable
        os.kill(proc.pid, 9)
        # the exit is an event on the descriptor: wait for it with a deadline
        assert select.select([reader.fileno()], [], [], 10)[0] == [reader.fileno()]
        reader.doRead()
        assert exits == [True] and reactor.readers == []
    finally:
        proc.kill()
        proc.wait()


def test_without_a_reactor_what_stands_in_for_it_must_be_given() -> None:
    """No reactor: the clock and the thread runner it would provide are required, named
    in the error at once, rather than failing at the first restart."""
    with pytest.raises(ValueError, match="needs clock"):
        PostgresSupervisor(FakePostgres(), None, watch=FakeWatch())
    with pytest.raises(ValueError, match="needs run_in_thread"):
        PostgresSupervisor(FakePostgres(), None, clock=task.Clock(), watch=FakeWatch())
