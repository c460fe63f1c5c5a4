"""The server's scheduled work and admin surfaces, started and stopped as one piece.

Started after the broker (store → registry → **scheduler** → listeners):

* an APScheduler ``TwistedScheduler`` on the reactor whose jobs only wake things
  up: each delay worker's poll, and the expiry sweep (copies past their topic's
  time to live → dead letters). Jobs run on the reactor thread (APScheduler's
  debug executor) and hand database work to ``DbWorker`` threads;
* the ``DelayScheduler`` with this node's ``FragmentAssignment``;
* the admin API under ``/admin`` on the HTTP port and the admin console on
  ``--admin-address``.

Stopped first on shutdown, so no delayed row is moved while the writers drain.
"""

from __future__ import annotations

from typing import Any

from twisted.internet import defer
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint
from twisted.logger import Logger

from dmq_server.http import admin as admin_api
from dmq_server.admin.console import AdminConsoleFactory
from dmq_server.admin.operations import AdminOps, is_loopback
from dmq_server.reliable.delay import DelayScheduler
from dmq_server.core.fragments import FragmentAssignment, StaticAssignment

__all__ = ["worker_roles", "Extras", "make_scheduler"]

log = Logger()


def worker_roles(options: Any) -> tuple[str, ...]:
    """The DbWorker roles (one connection each) this module needs."""
    delay = tuple(f"delay{i + 1}" for i in range(options.delay_workers))
    return ("delay-writer", "deadletter", "adminops", *delay)


def make_scheduler(reactor: Any) -> Any:
    from apscheduler.executors.debug import DebugExecutor
    from apscheduler.schedulers.twisted import TwistedScheduler

    return TwistedScheduler(reactor=reactor, executors={"default": DebugExecutor()}, timezone="UTC")


def make_assignment(server: Any) -> FragmentAssignment:
    """With ZooKeeper (``--zk``), fragments are shared among live nodes; without it this
    node owns every fragment. ``server.fragment_assignment_factory(count)``, when set,
    overrides both (tests, other membership schemes)."""
    options = server.options
    factory = getattr(server, "fragment_assignment_factory", None)
    if factory is not None:
        return factory(options.delay_fragments)
    address = getattr(options, "zk", "")
    if address:
        from dmq_server.cluster.fragments import ZkFragmentAssignment

        def connect() -> Any:
            from registry.zk import connect as zk_connect

            return zk_connect(
                address,
                timeout=getattr(options, "zk_connect_timeout", 30.0),
                session_timeout=getattr(options, "zk_session_timeout", 10.0),
            )

        return ZkFragmentAssignment(connect, options.delay_fragments, server.reactor, server.node_id)
    return StaticAssignment(options.delay_fragments)


class Extras:
    def __init__(self, server: Any):
        self.server = server
        self.scheduler: Any = None
        self.delays: DelayScheduler | None = None
        self.ops: AdminOps | None = None
        self.console_port: Any = None

    def start_scheduler(self) -> None:
        server = self.server
        options = server.options
        broker = server.broker
        self.scheduler = make_scheduler(server.reactor)
        self.delays = DelayScheduler(
            clock=server.reactor,
            dbs=[server.workers[f"delay{i + 1}"] for i in range(options.delay_workers)],
            assignment=make_assignment(server),
            fragments=options.delay_fragments,
            poll_interval=options.delay_poll_interval,
            batch_size=options.delay_batch_size,
            tick=options.delay_tick,
            node_id=server.node_id,
            on_moved=broker.deliver_moved,
            on_unknown=lambda: broker.outcome_unknown(None),
            scheduler=self.scheduler,
        )
        broker.delays = self.delays
        server.delays = self.delays
        self.scheduler.add_job(
            broker.dead_letters.sweep_expired,
            "interval",
            seconds=options.expiry_interval,
            id="expiry-sweep",
            name="expired copies to dead letters",
            max_instances=1,
            coalesce=True,
        )
        self.delays.start()
        self.scheduler.start()

    def install_http(self, site_root: Any) -> None:
        server = self.server
        # made here, once the fast store and what NSQ connections share exist
        self.ops = AdminOps(
            broker=server.broker,
            delays=self.delays,
            db=server.workers["adminops"],
            options=server.options,
            clock=server.reactor,
            node_id=server.node_id,
            dmq_connections=server.connections,
            nsq=server.nsq,
            port_factory=server.port_factory,
        )
        host, _ = self.server.options.http_endpoint
        admin_api.install(site_root, self.ops, host, self.server.options.admin_token)

    @defer.inlineCallbacks
    def listen(self) -> Any:
        options = self.server.options
        endpoint = options.admin_endpoint
        if endpoint is None:
            return None
        host, port = endpoint
        if not is_loopback(host) and not options.admin_token:
            log.warn(
                "admin console on non-loopback {host} without --admin-token: it will refuse every command",
                host=host,
            )
        factory = AdminConsoleFactory(
            self.ops, host, options.admin_token, self.server.reactor, getattr(options, "admin_idle_timeout", 900.0)
        )
        reactor = self.server.reactor
        if ":" in host:
            ep = TCP6ServerEndpoint(reactor, port, interface=host)
        else:
            ep = TCP4ServerEndpoint(reactor, port, interface=host)
        try:
            self.console_port = yield ep.listen(factory)
        except Exception as exc:  # CannotListenError: an auxiliary surface must not stop the node
            log.error(
                "admin console not started: cannot listen on {host}:{port}: {why}",
                host=host, port=port, why=exc,
            )
            return None
        log.info("admin console on {host}:{port}", host=host, port=self.console_address[1])
        return self.console_port

    @property
    def console_address(self) -> tuple[str, int] | None:
        if self.console_port is None:
            return None
        addr = self.console_port.getHost()
        return addr.host, addr.port

    @defer.inlineCallbacks
    def stop_scheduler(self) -> Any:
        if self.scheduler is not None and self.scheduler.running:
            self.scheduler.shutdown(wait=False)
        if self.delays is not None:
            left = self.delays.stop()
            if isinstance(left, defer.Deferred):
                left.addTimeout(10, self.server.reactor)
                try:
                    yield left
                except Exception as exc:  # a slow or lost ZooKeeper must not block shutdown
                    log.warn("leaving the delay fragment party failed: {why}", why=exc)

    @defer.inlineCallbacks
    def stop_listening(self) -> Any:
        if self.console_port is not None:
            yield self.console_port.stopListening()
            self.console_port = None
