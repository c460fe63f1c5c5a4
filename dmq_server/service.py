"""The server as a Twisted service: started in order, stopped in reverse.

Start: storage (embedded PostgreSQL and its supervisor if no DSN, migrations, DB workers) →
broker (registry cache, scanners) → listeners (TCP, HTTP). Stop: tell clients
SERVER_REBOOT, stop listening, commit and answer every queued send, make
acknowledgements durable, close connections, stop the workers, the
supervisor (so that it does not restart what we stop) and the embedded PostgreSQL.
"""

from __future__ import annotations

import socket
from typing import Any

from twisted.application.service import Service
from twisted.internet import defer
from twisted.internet.endpoints import TCP4ServerEndpoint, TCP6ServerEndpoint
from twisted.internet.threads import deferToThread
from twisted.logger import Logger

from dmq_client.wire import MAGIC

from dmq_server.broker import Broker
from dmq_server.protocols.dmq import DmqConnection
from dmq_server.http.root import VERSION, make_site
from dmq_server.protocols.flow import FlowLimits
from dmq_server.protocols.listener import NSQ_MAGIC, PortFactory
from dmq_server.protocols.nsq_context import NsqContext
from dmq_server.http.nsqd import install as install_nsq_http
from dmq_server.fast.store import FastStore
from dmq_server.protocols.nsq_v2 import NsqConnection
from dmq_server.core.options import Options
from dmq_server.scheduling import Extras, worker_roles
from dmq_server.db.reactor import ReactorDb
from dmq_server.db.messages import HOT_STATEMENTS
from dmq_server.db.schema import migrate, ping
from dmq_server.db.worker import DbWorker

__all__ = ["DmqServer", "DmqService", "make_service"]

log = Logger()

WORKER_ROLES = ("acker", "loader", "admin", "health")


def _endpoint(reactor: Any, host: str, port: int) -> Any:
    if ":" in host:
        return TCP6ServerEndpoint(reactor, port, interface=host)
    return TCP4ServerEndpoint(reactor, port, interface=host, backlog=511)


class DmqServer:
    def __init__(self, options: Options, reactor: Any):
        self.options = options
        self.reactor = reactor
        self.dsn = options.pg_dsn
        self.embedded: Any = None
        self.pg_supervisor: Any = None  # dmq_server.db.supervisor.PostgresSupervisor when embedded
        self.workers: dict[str, DbWorker] = {}
        self.broker: Broker | None = None
        self.connections: set[DmqConnection] = set()
        self.fast_store: FastStore | None = None
        self.nsq: NsqContext | None = None
        self.tcp_port: Any = None
        self.port_factory: PortFactory | None = None
        self.http_port: Any = None
        self.extras: Extras | None = None  # delay scheduler, expiry, admin API and console
        self.cluster: Any = None  # dmq_server.cluster.node.ClusterNode with --zk
        self.delays: Any = None
        host, port = options.tcp_endpoint
        self.node_id = options.node_id or f"{socket.gethostname()}:{port}"

    @defer.inlineCallbacks
    def start(self) -> Any:
        options = self.options
        if not self.dsn:
            from dmq_server.db.embedded import EmbeddedPostgres

            data_dir = options.data_dir
            data_dir.mkdir(parents=True, exist_ok=True)
            from dmq_server.db.supervisor import PostgresSupervisor

            self.embedded = EmbeddedPostgres(data_dir)
            self.dsn = yield deferToThread(self.embedded.start)
            # restarts the postmaster if it dies while we run (nothing else would)
            self.pg_supervisor = PostgresSupervisor(self.embedded, self.reactor)
            yield self.pg_supervisor.start()
        applied = yield deferToThread(migrate, self.dsn)
        if applied:
            log.info("applied schema migrations {versions}", versions=applied)
        writers = [f"writer{i}" for i in range(getattr(options, "commit_writers", 2))]
        for role in (*writers, *WORKER_ROLES, *worker_roles(options)):
            worker = self._db_worker(role, hot=role in writers or role == "acker")
            worker.start()
            self.workers[role] = worker
        fetch_topics, broker_options = None, options
        if options.zk:
            # registry in ZooKeeper (mirrored into PostgreSQL); see dmq_server.cluster.node
            from dmq_server.cluster.node import ClusterNode

            self.cluster = ClusterNode(options, self.reactor, self.node_id, self.dsn, self.workers["admin"])
            yield self.cluster.connect()
            fetch_topics = self.cluster.fetch_topics
            broker_options = options.replace(registry_refresh=options.zk_refresh)
        # NSQ's fast store: topics registered with store=fast and NSQ's topics made on
        # first use (nsqd's semantics); the broker routes publishes to it
        self.fast_store = FastStore.from_options(options, self.reactor, options.data_dir / "nsq")
        self.fast_store.start()
        self.broker = Broker(
            broker_options, self.reactor, self.workers, self.node_id, fetch_topics, fast=self.fast_store
        )
        if self.cluster is not None:
            self.cluster.attach(self.broker, self._fast_topics)
        self.broker.health_listeners.append(self._health_changed)
        yield self.broker.start()
        self.extras = Extras(self)
        self.extras.start_scheduler()

        self.nsq = NsqContext(self.fast_store, self.broker, options, self.reactor)

        def make_dmq(transport: Any) -> DmqConnection:
            return DmqConnection(transport, self.broker, self.reactor, self.connections)

        def make_nsq(transport: Any) -> NsqConnection:
            return NsqConnection(transport, self.nsq)

        factory = PortFactory(
            self.reactor, {MAGIC: make_dmq, NSQ_MAGIC: make_nsq}, FlowLimits.from_options(options)
        )
        self.port_factory = factory  # its budget: the port's flow-control state (/admin/flow)
        host, port = options.tcp_endpoint
        self.tcp_port = yield _endpoint(self.reactor, host, port).listen(factory)
        host, port = options.http_endpoint
        site = make_site(self._ping, self.broker.stats, self.info, options)
        install_nsq_http(
            site.resource,
            store=self.fast_store,
            ctx=self.nsq,
            broker=self.broker,
            options=options,
            cluster=self.cluster,
            addresses=lambda: (self.tcp_address, self.http_address),
        )
        self.extras.install_http(site.resource)
        self.http_port = yield _endpoint(self.reactor, host, port).listen(site)
        yield self.extras.listen()
        if self.cluster is not None:
            # announced (and delivering) only now that the ports are known
            yield self.cluster.register(self._broadcast_host(), self.tcp_address[1], self.http_address[1])
        log.info("dmq node {node} ready", node=self.node_id)
        return self

    def _db_worker(self, role: str, hot: bool) -> Any:
        """Group commit and durable acks (``hot``) run one statement per batch,
        committed on its own; by default on a connection the reactor reads itself
        (``db.reactor``), the other roles on a thread each."""
        if hot and self.options.db_io == "reactor":
            return ReactorDb(self.reactor, self.dsn, role, prepare=HOT_STATEMENTS)
        return DbWorker(self.reactor, self.dsn, role, autocommit=hot)

    @property
    def tcp_address(self) -> tuple[str, int]:
        addr = self.tcp_port.getHost()
        return addr.host, addr.port

    @property
    def http_address(self) -> tuple[str, int]:
        addr = self.http_port.getHost()
        return addr.host, addr.port

    def info(self) -> dict:
        tcp_host, tcp_port = self.tcp_address
        http_host, http_port = self.http_address
        return {
            "version": VERSION,
            "node_id": self.node_id,
            "tcp_address": f"{tcp_host}:{tcp_port}",
            "http_address": f"{http_host}:{http_port}",
            "tcp_port": tcp_port,
            "http_port": http_port,
            "start_time": int(self.broker.started_at) if self.broker else 0,
            "data_path": str(self.options.data_dir),
            "embedded_postgres": self.embedded is not None,
            "cluster": self.cluster.stats() if self.cluster is not None else None,
        }

    def _broadcast_host(self) -> str:
        """The host other nodes and clients reach this node at."""
        if self.options.broadcast_address:
            return self.options.broadcast_address
        host = self.tcp_address[0]
        return socket.gethostname() if host in ("", "0.0.0.0", "::") else host

    def _fast_topics(self) -> dict[str, tuple[str, ...]]:
        """This node's NSQ fast topics and their channels (announced for cluster lookups)."""
        if self.fast_store is None:
            return {}
        return {name: tuple(sorted(t.channels)) for name, t in self.fast_store.topics.items()}

    def _ping(self) -> Any:
        d = self.workers["health"].run(ping)
        d.addTimeout(5, self.reactor)
        return d

    def _health_changed(self, ok: bool) -> None:
        for conn in list(self.connections):
            conn.health_changed(ok)

    @defer.inlineCallbacks
    def stop(self) -> Any:
        log.info("shutting down: SERVER_REBOOT to {n} connections", n=len(self.connections))
        if self.extras is not None:
            yield self.extras.stop_scheduler()
            yield self.extras.stop_listening()
        for conn in list(self.connections):
            conn.reboot()
        if self.tcp_port is not None:
            yield self.tcp_port.stopListening()
        if self.broker is not None:
            done = self.broker.stop()
            done.addTimeout(self.options.shutdown_timeout, self.reactor)
            try:
                yield done
            except defer.TimeoutError:
                log.error("shutdown timed out waiting for batches to commit")
        for conn in list(self.connections):
            conn.close()
        if self.nsq is not None:
            for nsq_conn in list(self.nsq.connections):
                nsq_conn.close()
        if self.cluster is not None:
            yield self.cluster.stop()  # leave: other nodes take over what is still stored
        if self.http_port is not None:
            yield self.http_port.stopListening()
        if self.fast_store is not None:
            self.fast_store.close()  # memory, in-flight and deferred messages go to disk
        for worker in self.workers.values():
            worker.stop()
        if self.pg_supervisor is not None:
            yield self.pg_supervisor.stop()
        if self.embedded is not None:
            yield deferToThread(self.embedded.stop)
        log.info("dmq node {node} stopped", node=self.node_id)


class DmqService(Service):
    """Adapts DmqServer to twisted.application (``twistd``-style trees)."""

    def __init__(self, options: Options, reactor: Any):
        self.server = DmqServer(options, reactor)
        self.ready: defer.Deferred = defer.Deferred()

    def startService(self) -> None:
        super().startService()
        self.server.start().chainDeferred(self.ready)

    def stopService(self) -> Any:
        super().stopService()
        return self.server.stop()


def make_service(options: Options, reactor: Any | None = None) -> DmqService:
    if reactor is None:
        from twisted.internet import reactor as default_reactor

        reactor = default_reactor
    return DmqService(options, reactor)
