"""The service tree (dmq_server/tree.py): ordered, waited-for starts; stops in reverse;
a failed start undone; a stage's timers on the injected clock, only while it is up."""

from __future__ import annotations

from typing import Any

import pytest
from twisted.application.internet import TimerService
from twisted.application.service import MultiService
from twisted.internet import defer
from twisted.internet.task import Clock

from dmq_server.broker import Broker
from dmq_server.core.options import options_from_args
from dmq_server.db.memory import MemoryDb
from dmq_server.fast.fast_store import FastStore
from dmq_server.service import DmqServer
from dmq_server.tree import ServiceTree, Stage, StoppedWhileStarting

pytestmark = pytest.mark.unit


class Recorder:
    """Stages whose starts and stops are Deferreds the test fires by hand."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.pending: dict[str, defer.Deferred] = {}

    def step(self, label: str) -> Any:
        def run() -> defer.Deferred:
            self.events.append(label)
            d: defer.Deferred = defer.Deferred()
            self.pending[label] = d
            return d

        return run

    def finish(self, label: str, error: Exception | None = None) -> None:
        d = self.pending.pop(label)
        if error is None:
            d.callback(None)
        else:
            d.errback(error)

    def stage(self, name: str, **kw: Any) -> Stage:
        return Stage(name, self.step(f"start {name}"), self.step(f"stop {name}"), **kw)


def tree_of(rec: Recorder, *names: str) -> ServiceTree:
    tree = ServiceTree()
    for name in names:
        rec.stage(name).setServiceParent(tree)
    return tree


def test_each_stage_starts_only_when_the_one_before_has_started():
    rec = Recorder()
    tree = tree_of(rec, "database", "broker", "listeners")
    tree.startService()
    assert rec.events == ["start database"]  # MultiService would have started all three
    rec.finish("start database")
    assert rec.events == ["start database", "start broker"]
    rec.finish("start broker")
    assert not tree.ready.called
    rec.finish("start listeners")
    assert tree.ready.called and rec.events[-1] == "start listeners"


def test_stages_stop_in_reverse_each_waiting_for_the_one_after_it():
    rec = Recorder()
    tree = tree_of(rec, "database", "broker", "listeners")
    tree.startService()
    for name in ("database", "broker", "listeners"):
        rec.finish(f"start {name}")
    rec.events.clear()
    stopped = tree.stopService()
    assert rec.events == ["stop listeners"]
    rec.finish("stop listeners")
    assert rec.events == ["stop listeners", "stop broker"]
    rec.finish("stop broker")
    rec.finish("stop database")
    assert rec.events == ["stop listeners", "stop broker", "stop database"] and stopped.called


def test_a_failed_start_stops_what_started_in_reverse_and_fails_ready():
    rec = Recorder()
    tree = tree_of(rec, "database", "broker", "listeners")
    tree.startService()
    failures: list[Any] = []
    tree.ready.addErrback(failures.append)
    rec.finish("start database")
    rec.finish("start broker", OSError("port 4150 in use"))
    # the half-started broker is stopped too (its stop undoes what its start did), then the database
    assert rec.events == ["start database", "start broker", "stop broker"]
    rec.finish("stop broker")
    assert rec.events[-1] == "stop database" and not failures
    rec.finish("stop database")
    assert "start listeners" not in rec.events
    assert [f.getErrorMessage() for f in failures] == ["port 4150 in use"]
    assert not any(stage.running for stage in tree)
    assert tree.stopService().called  # the shutdown after a failed start has nothing left to do


def test_a_stop_during_the_start_starts_nothing_more():
    rec = Recorder()
    tree = tree_of(rec, "database", "broker")
    tree.startService()
    failures: list[Any] = []
    tree.ready.addErrback(failures.append)
    tree.stopService()  # SIGTERM while the database starts: its stop runs, it is running
    assert rec.events == ["start database", "stop database"]
    rec.finish("stop database")
    rec.finish("start database")
    assert "start broker" not in rec.events
    assert len(failures) == 1 and failures[0].check(StoppedWhileStarting)


def test_a_stage_that_fails_to_stop_does_not_keep_the_others_running():
    rec = Recorder()
    tree = tree_of(rec, "database", "broker")
    tree.startService()
    rec.finish("start database")
    rec.finish("start broker")
    stopped = tree.stopService()
    rec.finish("stop broker", RuntimeError("drain failed"))
    assert rec.events[-1] == "stop database"
    rec.finish("stop database")
    assert stopped.called


def _timers(clock: Clock, calls: list[str], **steps: float) -> MultiService:
    timers = MultiService()
    for name, step in steps.items():
        timer = TimerService(step, calls.append, name)
        timer.clock = clock
        timer.setName(name)
        timer.setServiceParent(timers)
    return timers


def test_a_stages_timers_run_on_its_clock_only_while_it_is_up():
    clock, calls, rec = Clock(), [], Recorder()
    timers = _timers(clock, calls, scan=1.0, sweep=10.0)
    stage = rec.stage("broker", timers=lambda: timers, clock=clock)
    stage.startService()
    clock.advance(5)
    assert calls == []  # not before the stage's start has finished
    rec.finish("start broker")
    assert stage.getServiceNamed("timers").getServiceNamed("scan") is timers.getServiceNamed("scan")
    assert calls == ["scan", "sweep"]  # each fires once when started
    clock.pump([1.0] * 10)
    assert calls.count("scan") == 11 and calls.count("sweep") == 2
    stage.stopService()
    assert not timers.running and rec.events[-1] == "stop broker"  # timers stopped first
    clock.advance(60)
    assert calls.count("scan") == 11


def test_a_timer_call_still_running_is_waited_for_a_bounded_grace():
    clock, rec = Clock(), Recorder()
    stuck: defer.Deferred = defer.Deferred()  # a query on a paused database
    timers = MultiService()
    timer = TimerService(1.0, lambda: stuck)
    timer.clock = clock
    timer.setServiceParent(timers)
    stage = rec.stage("broker", timers=lambda: timers, clock=clock, grace=5.0)
    stage.startService()
    rec.finish("start broker")
    stage.stopService()
    clock.advance(4.9)
    assert rec.events == ["start broker"]  # still waiting for the call under way
    clock.advance(0.2)
    assert rec.events == ["start broker", "stop broker"]


def test_components_do_not_start_their_own_timers():
    clock = Clock()
    db = MemoryDb(clock)
    roles = {"writer0": db, "acker": db, "loader": db, "admin": db}
    options = options_from_args(["--pg-dsn", "postgresql://x/y"])
    broker = Broker(options, clock, roles, "node-1")
    fast = FastStore(clock, None, node_id=1)
    broker.start()
    fast.start()
    clock.advance(1)
    assert not broker.timers.running and not fast.timers.running
    assert {t.name: t.step for t in broker.timers if t.name != "store-main"} == {
        "scan": options.scan_interval,
        "registry-refresh": options.registry_refresh,
    }
    # the reliable store's own jobs are its own service, adopted under the broker's
    store = broker.timers.getServiceNamed("store-main")
    assert store is broker.reliable.timers and not store.running
    assert {t.name: getattr(t, "step", None) or t.period for t in store} == {
        "sweep": options.sweep_interval,
        "channel-state": options.channel_state_interval,
        "heartbeat": options.owner_silence / 6,
        "depth-count": options.channel_state_interval,  # its passes' shortest period
    }
    assert db.names_run().count("depth_slice_end") == 0  # the depth count waits for the timers too
    # one scanner for both stores: the broker's; the fast store keeps only its disk sync
    assert {t.name: t.step for t in fast.timers} == {"sync": options.sync_timeout}
    timed = [t for t in [*broker.timers, *store, *fast.timers] if t is not store]
    assert all(t.clock is clock for t in timed)


@pytest.mark.parametrize(
    "args, names",
    [
        # outbox-relays always: an outbox may be attached at run time (dmq outbox attach)
        ([], ["database", "fast-store", "broker", "scheduler", "outbox-relays", "listeners"]),
        (
            ["--zk", "127.0.0.1:2181"],
            ["database", "cluster", "fast-store", "broker", "scheduler", "outbox-relays", "listeners", "announce"],
        ),
    ],
)
def test_the_servers_stages_in_start_order(args, names):
    server = DmqServer(options_from_args(["--pg-dsn", "postgresql://x/y", *args]), Clock())
    assert [stage.name for stage in server.stages()] == names
