"""The server's scheduled work: the delay scheduler and the expiry sweep.

One stage of the service tree, started after the broker and before the listeners
(database → cluster → fast store → broker → **scheduler** → listeners):

* an APScheduler ``TwistedScheduler`` on the reactor whose jobs only wake things
  up: each delay worker's poll, and the expiry sweep (copies past their topic's
  time to live → dead letters). Jobs run on the reactor thread (APScheduler's
  debug executor) and hand database work to ``DbWorker`` threads;
* the ``DelayScheduler`` with this node's ``FragmentAssignment``.

Stopped before the broker drains, so no delayed row is moved while the writers drain.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Generator, Sequence, cast

from twisted.internet import defer
from twisted.internet.interfaces import IReactorTime
from twisted.logger import Logger

from dmq_server.core.options import Options
from dmq_server.db.runner import StepRunner
from dmq_server.reliable.store import ReliableStore
from dmq_server.reliable.delay import DelayScheduler
from dmq_server.core.fragment_ranges import FragmentAssignment, StaticAssignment

from dmq_server.cluster.fragments import ThreadedClock

if TYPE_CHECKING:  # imported where used: APScheduler and kazoo load only when a scheduler or ZooKeeper runs
    from apscheduler.schedulers.twisted import TwistedScheduler
    from kazoo.client import KazooClient

__all__ = ["worker_roles", "Scheduling", "make_assignment", "make_scheduler"]

log = Logger()


def worker_roles(options: Options) -> tuple[str, ...]:
    """The DbWorker roles (one connection each) this module needs."""
    delay = tuple(f"delay{i + 1}" for i in range(options.delay_workers))
    return ("delay-writer", "deadletter", *delay)


def make_scheduler(reactor: ThreadedClock) -> TwistedScheduler:
    from apscheduler.executors.debug import DebugExecutor
    from apscheduler.schedulers.twisted import TwistedScheduler

    return TwistedScheduler(reactor=reactor, executors={"default": DebugExecutor()}, timezone="UTC")


def make_assignment(options: Options, reactor: ThreadedClock, node_id: str) -> FragmentAssignment:
    """With ZooKeeper (``--zk``), fragments are shared among live nodes; without it this
    node owns every fragment."""
    if options.zk:
        from dmq_server.cluster.fragments import ZkFragmentAssignment

        def connect() -> KazooClient:
            from registry.zk import connect as zk_connect

            return zk_connect(
                options.zk,
                timeout=options.zk_connect_timeout,
                session_timeout=options.zk_session_timeout,
                security=options.zk_security,
            )

        return ZkFragmentAssignment(connect, options.delay_fragments, reactor, node_id)
    return StaticAssignment(options.delay_fragments)


class Scheduling:
    """The scheduler stage: what it needs is passed in; ``start``/``stop`` are the
    stage's two halves. ``assignment`` is called once, at start (ZooKeeper's party
    is joined only then)."""

    def __init__(
        self,
        options: Options,
        reactor: ThreadedClock,
        node_id: str,
        store: ReliableStore,
        delay_dbs: Sequence[StepRunner],
        assignment: Callable[[], FragmentAssignment],
    ):
        self.options = options
        self.reactor = reactor
        self.node_id = node_id
        self.store = store  # the reliable store: delayed messages become its copies
        self.delay_dbs = list(delay_dbs)
        self.assignment = assignment
        self.scheduler: TwistedScheduler | None = None
        self.delays: DelayScheduler | None = None

    def start(self) -> None:
        options = self.options
        store = self.store
        self.scheduler = make_scheduler(self.reactor)
        self.delays = DelayScheduler(
            clock=self.reactor,
            dbs=self.delay_dbs,
            assignment=self.assignment(),
            fragments=options.delay_fragments,
            poll_interval=options.delay_poll_interval,
            batch_size=options.delay_batch_size,
            tick=options.delay_tick,
            node_id=self.node_id,
            on_moved=store.deliver_moved,
            on_unknown=lambda: store.outcome_unknown(None),
            scheduler=self.scheduler,
            writes=store.writes,
        )
        store.schedule_delays_with(self.delays)
        self.scheduler.add_job(
            store.dead_letters.sweep_expired,
            "interval",
            seconds=options.expiry_interval,
            id="expiry-sweep",
            name="expired copies to dead letters",
            max_instances=1,
            coalesce=True,
        )
        self.scheduler.add_job(
            lambda: store.trace.sweep(options.trace_retention),
            "interval",
            seconds=60,
            id="trace-sweep",
            name="message trace rows past --trace-retention",
            max_instances=1,
            coalesce=True,
        )
        self.delays.start()
        self.scheduler.start()

    @defer.inlineCallbacks
    def stop(self) -> Generator[defer.Deferred, object, None]:
        if self.scheduler is not None and self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        if self.delays is not None:
            left = self.delays.stop()
            if isinstance(left, defer.Deferred):
                # the reactor provides IReactorTime: zope's @implementer is invisible to mypy
                left.addTimeout(10, cast(IReactorTime, self.reactor))
                try:
                    yield left
                except Exception as exc:  # a slow or lost ZooKeeper must not block shutdown
                    log.warn("leaving the delay fragment party failed: {why}", why=exc)
