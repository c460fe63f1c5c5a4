"""The server as a tree of stages, started in order and stopped in reverse.

========== ===============================================================================
stage      start (each waits for the one before)   /  stop (in reverse)
========== ===============================================================================
database   embedded PostgreSQL and its supervisor when there is no --pg-dsn, migrations,
           the DB workers  /  the workers, the supervisor (so that it does not restart
           what we stop), the embedded PostgreSQL
cluster    with --zk: ZooKeeper, the registry mirror; heartbeat and node-list timers
           /  leave the cluster (other nodes take over what is still stored)
fast-store NSQ's store from ``nsqd.dat``; its disk-sync timer  /  memory,
           in-flight and deferred messages to disk
broker     registry cache and channel state; the scanner of both stores, refresh,
           each reliable store's own timers (sweep, channel state, heartbeat,
           depth count)  /  commit and
           answer every queued send, make acknowledgements durable, close connections
scheduler  delay scheduler and expiry sweep  /  leave the delay fragment party
listeners  TCP (dmq protocol and NSQ V2; TLS-only with --tls-address), HTTP (API, nsqd,
           lookupd, admin; HTTPS with --https-address), the admin console  /
           SERVER_REBOOT to dmq clients, stop listening
announce   with --zk: register this node (ports known) and start delivering
========== ===============================================================================

``DmqServer`` holds what the stages make and passes it on explicitly; nothing reads
the server's attributes from elsewhere.

Why one long module: it is the assembly, a short start and stop per stage and the
values they hand on (the /info and /metrics snapshots among them); the work of each
stage is in the modules it calls.
"""

from __future__ import annotations

import socket
from typing import TYPE_CHECKING, Generator
from typing import Callable, Iterator, Mapping, Protocol, TypeVar, cast

from twisted.internet import defer
from twisted.internet.endpoints import SSL4ServerEndpoint, TCP4ServerEndpoint, TCP6ServerEndpoint
from twisted.internet.interfaces import IReactorFromThreads, IReactorSSL, IReactorTCP, IReactorTime
from twisted.internet.ssl import CertificateOptions
from twisted.python.threadpool import ThreadPool
from twisted.internet.threads import deferToThread
from twisted.logger import Logger

from dmq_client.spelling import parse_address
from dmq_client.wire import MAGIC

from dmq_server.admin.line_console import AdminConsoleFactory
from dmq_server.admin.inspect import Inspector
from dmq_server.admin.operations import AdminOps
from dmq_server.core.client_memory import ClientMemory
from dmq_server.core.clock import Clock
from dmq_server.core.peers import is_loopback
from dmq_server.core.transport import Address, TlsTransport
from dmq_server.broker import Broker, Fence
from dmq_server.protocols.dmq import DmqConnection
from dmq_server.http import admin_api as admin_api
from dmq_server.http.web_console import install as install_console
from dmq_server.http.metrics import Snapshot, metrics_resource
from dmq_server.http.guard import HttpGuard
from dmq_server.http.root import VERSION, make_site
from dmq_server.http.sampling import Sampling
from dmq_server.http.site import BoundedSite
from dmq_server.http.stats import outbox_stats
from dmq_server.protocols.flow import FlowLimits, MemoryWatch
from dmq_server.protocols.listener import NSQ_MAGIC, Handler, PortFactory
from dmq_server.protocols.nsq_context import NsqContext
from dmq_server.http.nsqd import install as install_nsq_http
from dmq_server.fast.fast_store import FastStore
from dmq_server.protocols.nsq_v2 import NsqConnection
from dmq_server.core.options import Options
from dmq_server.scheduling import Scheduling, make_assignment, worker_roles
from dmq_server.db.reactor import ReactorDb
from dmq_server.protocols.outbox_relay import OutboxRelays
from dmq_server.db.messages import HOT_STATEMENTS
from dmq_server.db.clusters import describe as describe_clusters, place_clusters
from dmq_server.db.mirror import Mirror
from dmq_server.db.topic_steps import list_topics_steps
from dmq_server.db.schema import migrate, ping_steps
from dmq_server.core.fragment_ranges import SharedAssignment
from dmq_server.db.worker import DbWorker
from dmq_server.security.authorizer import Authorizer, make_authorizer
from dmq_server.security.exposure import exposure_warnings
from dmq_server.security.session import CredentialCache
from dmq_server.security.tls import ServerTls
from dmq_server.tree import ServiceTree, Stage

if TYPE_CHECKING:  # imported where used: only an embedded server or a cluster node needs them
    from dmq_server.cluster.node import ClusterNode
    from dmq_server.db.embedded import EmbeddedPostgres
    from dmq_server.db.supervisor import PostgresSupervisor

__all__ = ["DmqServer", "DmqService", "ServerReactor", "make_service"]

#: an ``inlineCallbacks`` generator: it yields Deferreds (of any result: Twisted's
#: ``inlineCallbacks`` asks for that) and is sent their results
Steps = Generator["defer.Deferred", object, None]

log = Logger()

WORKER_ROLES = ("acker", "loader", "admin", "health", "adminops", "metrics")
# the roles of every other cluster's store (``--pg-cluster``): no health, no metrics sampling
CLUSTER_ROLES = ("acker", "loader", "admin", "adminops")


T = TypeVar("T")


class ServerReactor(Clock, Protocol):
    """What the assembly and ``main`` ask of the reactor: timers, the database
    connections' readers and writers and thread pool, the answer from a thread, and
    running, stopping and the shutdown trigger. Twisted states these as zope
    interfaces, which mypy reads without ``self``; the installed reactor has them all."""

    def addReader(self, reader: object) -> None: ...
    def removeReader(self, reader: object) -> None: ...
    def addWriter(self, writer: object) -> None: ...
    def removeWriter(self, writer: object) -> None: ...
    def getThreadPool(self) -> ThreadPool: ...
    def callFromThread(self, callable: Callable[..., object], *args: object, **kwargs: object) -> None: ...
    def callWhenRunning(self, callable: Callable[..., object], *args: object, **kwargs: object) -> object: ...
    def addSystemEventTrigger(self, phase: str, eventType: str, callable: Callable[..., object],
                              *args: object, **kwargs: object) -> object: ...
    def run(self, installSignalHandlers: bool = ...) -> None: ...
    def stop(self) -> None: ...


class ListeningPort(Protocol):
    """What the service asks of a port it listens on (Twisted's ``IListeningPort``)."""

    def getHost(self) -> Address: ...
    def stopListening(self) -> defer.Deferred[None] | None: ...


def _started(part: T | None, stage: str) -> T:
    """What a stage made, asked for by a later one (the tree starts them in order)."""
    if part is None:
        raise RuntimeError(f"the {stage} stage has not started")
    return part


def _listen_on(reactor: ServerReactor, host: str, port: int, factory: object,
               tls: ServerTls | None = None) -> Generator[defer.Deferred, object, ListeningPort]:
    """``port = yield from _listen_on(...)``: the port ``factory`` listens on (with ``tls``: TLS from the first byte)."""
    # the installed reactor provides IReactorTCP and IReactorSSL: zope's @implementer is invisible to mypy
    endpoint: SSL4ServerEndpoint | TCP4ServerEndpoint | TCP6ServerEndpoint
    if tls is not None:
        # ServerTls is Twisted's IOpenSSLContextFactory (getContext), which the endpoint asks for
        endpoint = SSL4ServerEndpoint(cast(IReactorSSL, reactor), port, cast(CertificateOptions, tls), interface=host, backlog=511)
    elif ":" in host:
        endpoint = TCP6ServerEndpoint(cast(IReactorTCP, reactor), port, interface=host)
    else:
        endpoint = TCP4ServerEndpoint(cast(IReactorTCP, reactor), port, interface=host, backlog=511)
    listening = yield endpoint.listen(factory)
    # an IListeningPort (zope, read by mypy without self) has getHost and stopListening
    return listening  # type: ignore[return-value]


def _address(port: ListeningPort | None) -> str | None:
    if port is None:
        return None
    addr = port.getHost()
    return f"{addr.host}:{addr.port}"


class DmqServer:
    """What the stages make (workers, stores, broker, ports) and share."""

    def __init__(self, options: Options, reactor: ServerReactor):
        self.options = options
        self.reactor = reactor
        self.dsn = options.pg_dsn
        self.embedded: EmbeddedPostgres | None = None
        self.pg_supervisor: PostgresSupervisor | None = None  # when embedded
        self.workers: dict[str, DbWorker | ReactorDb] = {}
        # every --pg-cluster's DSN and database roles, and each cluster's id slot
        self.cluster_dsns: dict[str, str] = dict(options.pg_clusters)
        self.cluster_workers: dict[str, dict[str, DbWorker | ReactorDb]] = {}
        self.slots: dict[str, int] = {"main": 0}
        self.cluster_scheduling: list[Scheduling] = []
        self.cluster: ClusterNode | None = None  # with --zk
        self.fast_store: FastStore | None = None
        self.broker: Broker | None = None
        self.scheduling: Scheduling | None = None
        self.connections: set[DmqConnection] = set()
        self.nsq: NsqContext | None = None
        self.tcp_port: ListeningPort | None = None
        self.port_factory: PortFactory | None = None
        self.http_port: ListeningPort | None = None
        self.console_port: ListeningPort | None = None
        self.sampling: Sampling | None = None  # /metrics' stored gauges, the console's history
        self.tls_port: ListeningPort | None = None  # --tls-address
        self.https_port: ListeningPort | None = None  # --https-address
        self.tls: ServerTls | None = None
        self.authorizer: Authorizer | None = None
        # the one budget of bytes held for clients (--max-client-memory): the TCP ports'
        # connections and both stores' channel windows count against it
        self.client_memory = ClientMemory(options.max_client_memory, read_size=options.max_output_buffer)
        self.memory_watch: MemoryWatch | None = None
        # --outbox and the outboxes attached: one relay each
        self.relays = OutboxRelays(options, reactor, self._threads())
        host, port = options.tcp_endpoint
        self.node_id = options.node_id or f"{socket.gethostname()}:{port}"
        self.relays.node_id = self.node_id

    def stages(self) -> list[Stage]:
        clock = self.reactor
        stages = [Stage("database", self._start_database, self._stop_database)]
        if self.options.zk:
            stages.append(
                Stage("cluster", self._connect_cluster, self._leave_cluster, timers=lambda: _started(self.cluster, "cluster").timers, clock=clock)
            )
        stages += [
            Stage("fast-store", self._open_fast_store, self._close_fast_store, timers=lambda: _started(self.fast_store, "fast-store").timers, clock=clock),
            Stage("broker", self._start_broker, self._drain_broker, timers=lambda: _started(self.broker, "broker").timers, clock=clock),
            Stage("scheduler", self._start_scheduling, self._stop_scheduling),
            Stage("listeners", self._listen, self._stop_listening, timers=lambda: _started(self.sampling, "listeners").timers, clock=clock),
        ]
        # after the broker and the scheduler, before the listeners; always: an outbox may be
        # attached at run time (dmq outbox attach)
        stages.insert(-1, Stage("outbox-relays", self._start_relays, self.relays.stop))
        if self.options.zk:
            stages.append(Stage("announce", self._announce))
        return stages

    def _start_relays(self) -> None:
        """The outbox relays; in a cluster placed through ZooKeeper (``cluster.outboxes``)."""
        zk = None
        if self.cluster is not None:
            from dmq_server.cluster.outboxes import ClusterOutboxes

            zk = ClusterOutboxes(self.cluster)
        self.relays.start(_started(self.broker, "broker"), self.dsn, zk=zk)

    # -- database -------------------------------------------------------------------
    @defer.inlineCallbacks
    def _start_database(self) -> Steps:
        options = self.options
        if not self.dsn:
            from dmq_server.db.embedded import EmbeddedPostgres
            from dmq_server.db.supervisor import PostgresSupervisor

            data_dir = options.data_dir
            data_dir.mkdir(parents=True, exist_ok=True)
            embedded = self.embedded = EmbeddedPostgres(data_dir)
            dsn = yield deferToThread(embedded.start)
            assert isinstance(dsn, str)
            self.dsn = dsn
            # restarts the postmaster if it dies while we run (nothing else would)
            self.pg_supervisor = PostgresSupervisor(embedded, self.reactor)
            yield self.pg_supervisor.start()
        for name, dsn in {"main": self.dsn, **self.cluster_dsns}.items():
            applied = yield deferToThread(migrate, dsn)
            if applied:
                log.info("applied schema migrations {versions} on cluster {name}", versions=applied, name=name)
        if self.cluster_dsns:
            slots = yield deferToThread(place_clusters, {"main": self.dsn, **self.cluster_dsns})
            assert isinstance(slots, dict)
            self.slots = slots
            log.info("PostgreSQL clusters: {clusters}", clusters=describe_clusters(self.slots))
        writers = [f"writer{i}" for i in range(options.commit_writers)]
        self.workers = self._db_workers(self.dsn, (*writers, *WORKER_ROLES, *worker_roles(options)))
        for name, dsn in self.cluster_dsns.items():
            self.cluster_workers[name] = self._db_workers(dsn, (*writers, *CLUSTER_ROLES, *worker_roles(options)))

    def _db_workers(self, dsn: str, roles: tuple[str, ...]) -> dict[str, DbWorker | ReactorDb]:
        workers: dict[str, DbWorker | ReactorDb] = {}
        for role in roles:
            hot = role.startswith("writer") or role == "acker"
            workers[role] = worker = self._db_worker(dsn, role, hot)
            worker.start()
        return workers

    def _db_worker(self, dsn: str, role: str, hot: bool) -> DbWorker | ReactorDb:
        """Group commit and durable acks (``hot``) run one statement per batch,
        committed on its own; by default on a connection the reactor reads itself
        (``db.reactor``), the other roles on a thread each."""
        if hot and self.options.db_io == "reactor":
            return ReactorDb(self.reactor, dsn, role, prepare=HOT_STATEMENTS, timeout=self.options.pg_timeout)
        return DbWorker(self._threads(), dsn, role, autocommit=hot, timeout=self.options.pg_timeout)

    def _threads(self) -> IReactorFromThreads:
        # the reactor provides IReactorFromThreads: zope's @implementer is invisible to mypy
        return cast(IReactorFromThreads, self.reactor)

    def _timeouts(self) -> IReactorTime:
        # the reactor provides IReactorTime (addTimeout asks for it): zope's @implementer is invisible to mypy
        return cast(IReactorTime, self.reactor)

    @property
    def tcp_address(self) -> tuple[str, int]:
        addr = _started(self.tcp_port, "listeners").getHost()
        return addr.host, addr.port

    @property
    def http_address(self) -> tuple[str, int]:
        addr = _started(self.http_port, "listeners").getHost()
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
            "tls_address": _address(self.tls_port),
            "https_address": _address(self.https_port),
            "auth_required": self.authorizer is not None,
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

    def _stats(self) -> dict:
        """``/stats``' JSON: the broker's, and what held the reactor up (``pauses``)."""
        out = dict(self.broker.stats()) if self.broker is not None else {}
        if self.sampling is not None:
            out["pauses"] = self.sampling.pauses.stats()
        out["outboxes"] = outbox_stats(self.relays.figures())
        return out

    def _metrics_snapshot(self) -> Snapshot:
        """One scrape's data (on the reactor thread): what /stats shows, both stores."""
        broker = self.broker.snapshot() if self.broker is not None else None
        snapshot = Snapshot(
            node_id=self.node_id,
            version=VERSION,
            broker=broker.stats if broker is not None else {},
            fast_topics=[topic.stats for topic in broker.fast_topics] if broker is not None else [],
            connections={"dmq": len(self.connections), "nsq": len(self.nsq.connections) if self.nsq else 0},
            zk_state=self.cluster.zk_state if self.cluster is not None else None,
            stored=self.sampling.gauges.snapshot() if self.sampling is not None else None,
            db_pool={role: worker.state() for role, worker in self.workers.items()},
            client_memory=self.client_memory.stats(),
            outboxes=self.relays.figures(),
            histograms=dict(broker.histograms) if broker is not None else {},
        )
        if self.sampling is not None:
            snapshot.histograms["dmq_reactor_lag_seconds"] = self.sampling.pauses.lag.buckets.snapshot()
            snapshot.histograms["dmq_gc_pause_seconds"] = self.sampling.pauses.collector.buckets.snapshot()
        return snapshot

    def _channel_stats(self) -> Iterator[tuple[str, str, str, dict[str, object]]]:
        """Every channel of both stores, ``(store, topic, channel, stats)`` (the console's history)."""
        if self.broker is None:
            return
        snap = self.broker.snapshot()
        for topic in snap.stats["topics"]:
            for channel in topic["channels"]:
                yield "reliable", topic["topic_name"], channel["channel_name"], channel
        for fast in snap.fast_topics:
            for channel in fast.stats["channels"]:
                yield "fast", fast.name, channel["channel_name"], dict(channel, ack_count=channel.get("finish_count", 0))

    def _ping(self) -> defer.Deferred[object]:
        d = self.workers["health"].run_steps(ping_steps)
        d.addTimeout(5, self._timeouts())
        return d

    def _health_changed(self, ok: bool) -> None:
        for conn in list(self.connections):
            conn.health_changed(ok)

    def _stop_database(self) -> defer.Deferred[object]:
        for workers in (self.workers, *self.cluster_workers.values()):
            for worker in workers.values():
                worker.stop()
        d: defer.Deferred[object] = defer.succeed(None)
        supervisor, embedded = self.pg_supervisor, self.embedded
        if supervisor is not None:
            d.addCallback(lambda _: supervisor.stop())
        if embedded is not None:
            d.addCallback(lambda _: deferToThread(embedded.stop))
        return d

    # -- cluster --------------------------------------------------------------------
    def _connect_cluster(self) -> defer.Deferred:
        """The registry in ZooKeeper, mirrored into PostgreSQL (dmq_server.cluster.node)."""
        from dmq_server.cluster.node import ClusterNode

        cluster = self.cluster = ClusterNode(
            self.options, self.reactor, self.node_id, self.dsn, self.workers["admin"],
            mirror=self._mirrors() if self.cluster_workers else None,
            cluster_dsns=self.cluster_dsns,
        )
        return cluster.connect()

    def _leave_cluster(self) -> defer.Deferred[None] | None:
        return self.cluster.stop() if self.cluster is not None else None

    # -- fast store -----------------------------------------------------------------
    def _open_fast_store(self) -> None:
        """NSQ's fast store: topics registered with store=fast and NSQ's topics made on
        first use (nsqd's semantics); the broker routes publishes to it."""
        fast = self.fast_store = FastStore.from_options(self.options, self.reactor, self.options.data_dir / "nsq",
                                                        client_memory=self.client_memory)
        fast.start()

    def _close_fast_store(self) -> None:
        if self.fast_store is not None:
            self.fast_store.close()  # memory, in-flight and deferred messages go to disk

    # -- broker ---------------------------------------------------------------------
    def _start_broker(self) -> defer.Deferred:
        options, cluster = self.options, self.cluster
        if cluster is None:
            broker = self.broker = Broker(
                options, self.reactor, self.workers, self.node_id,
                self._mirrored_topics() if self.cluster_workers else None, fast=self.fast_store,
                clusters=self.cluster_workers, slots=self.slots, alone=True, memory=self.client_memory,
            )
            broker.health_listeners.append(self._health_changed)
            return broker.start()
        # a cluster's node fences the stores (they load and push only what it owns) and
        # checks for a gap in its time before each scan
        broker = self.broker = Broker(
            options.replace(registry_refresh=options.zk_refresh), self.reactor, self.workers, self.node_id,
            cluster.fetch_topics, fast=self.fast_store, clusters=self.cluster_workers, slots=self.slots,
            alone=False, memory=self.client_memory,
            fence=Fence(self.node_id, cluster.may_deliver, cluster.stood_still),
            before_scan=cluster.check_gap,
        )
        broker.health_listeners.append(self._health_changed)
        cluster.attach(broker.cluster_stores(), broker.refresh_registry, self._fast_topics)
        d = cluster.begin_incarnation(broker.cluster_stores())
        return d.addCallback(lambda _: broker.start())

    def _mirrors(self) -> Mirror:
        """The registry's rows into every cluster but main (``db.mirror``)."""
        return Mirror({name: workers["admin"] for name, workers in self.cluster_workers.items()}, self.reactor)

    def _mirrored_topics(self) -> Callable[[], defer.Deferred[object]]:
        """Without ZooKeeper: the main cluster's registry tables, mirrored into the others."""
        mirror, admin = self._mirrors(), self.workers["admin"]
        return lambda: admin.run_steps(list_topics_steps).addCallback(mirror.mirror)

    @defer.inlineCallbacks
    def _drain_broker(self) -> Steps:
        """Commit and answer what is queued (bounded by --shutdown-timeout), then close
        the client connections: every send a client is waiting on was answered first."""
        if self.broker is not None:
            done = self.broker.stop()
            done.addTimeout(self.options.shutdown_timeout, self._timeouts())
            try:
                yield done
            except defer.TimeoutError:
                log.error("shutdown timed out waiting for batches to commit")
        for conn in list(self.connections):
            conn.close()
        if self.nsq is not None:
            for nsq_conn in list(self.nsq.connections):
                nsq_conn.close()

    # -- scheduler ------------------------------------------------------------------
    def _start_scheduling(self) -> None:
        """A delay scheduler per cluster; the node serves the same delay fragments on
        each (one assignment, one party: ``core.fragment_ranges.SharedAssignment``)."""
        options = self.options
        shared = SharedAssignment(make_assignment(options, self.reactor, self.node_id))
        made = []
        stores = _started(self.broker, "broker").cluster_stores()
        for name, workers in {"main": self.workers, **self.cluster_workers}.items():
            made.append(Scheduling(
                options,
                self.reactor,
                self.node_id,
                stores[name],
                [workers[f"delay{i + 1}"] for i in range(options.delay_workers)],
                lambda: shared,
            ))
        self.scheduling, self.cluster_scheduling = made[0], made[1:]
        for scheduling in made:
            scheduling.start()

    @defer.inlineCallbacks
    def _stop_scheduling(self) -> Steps:
        for scheduling in (*self.cluster_scheduling, self.scheduling):
            if scheduling is not None:
                yield scheduling.stop()

    # -- listeners ------------------------------------------------------------------
    @defer.inlineCallbacks
    def _listen(self) -> Steps:
        options, reactor, broker = self.options, self.reactor, _started(self.broker, "broker")
        self.tls = ServerTls.from_options(options)  # a bad certificate fails the start, naming it
        self.authorizer = make_authorizer(options, reactor)
        nsq = self.nsq = NsqContext(broker, options, reactor, tls=self.tls, authorizer=self.authorizer)

        def make_dmq(transport: TlsTransport) -> Handler:
            return DmqConnection(transport, broker, reactor, self.connections, tls=self.tls, authorizer=self.authorizer)

        def make_nsq(transport: TlsTransport) -> Handler:
            return NsqConnection(transport, nsq)

        handlers: dict[bytes, Callable[[TlsTransport], Handler]] = {MAGIC: make_dmq, NSQ_MAGIC: make_nsq}
        refused = {}
        if options.tls_required_mode != "false":
            where = f"the TLS port {options.tls_address}" if options.tls_address else "a TLS port (--tls-address)"
            refused[MAGIC] = f"E_TLS_REQUIRED this server requires TLS: connect to {where}"
        # its budget is the port's flow-control state (/admin/flow), shared with the TLS port
        self.port_factory = PortFactory(
            reactor, handlers, FlowLimits.from_options(options), tls=self.tls,
            handshake_timeout=options.tls_handshake_timeout, refused=refused, memory=self.client_memory,
        )
        self.memory_watch = MemoryWatch(self.client_memory, self.port_factory.budget, reactor)
        self.memory_watch.start()
        host, port = options.tcp_endpoint
        self.tcp_port = yield from _listen_on(reactor, host, port, self.port_factory)
        if options.tls_address:
            tls_factory = PortFactory(
                reactor, handlers, self.port_factory.limits, tls=self.tls, tls_port=True,
                handshake_timeout=options.tls_handshake_timeout, budget=self.port_factory.budget,
            )
            tls_host, tls_port = parse_address(options.tls_address)
            self.tls_port = yield from _listen_on(reactor, tls_host, tls_port, tls_factory, self.tls)
        ops = AdminOps(
            broker=broker,
            delays=self.scheduling.delays if self.scheduling is not None else None,
            db=self.workers["adminops"],
            options=options,
            clock=reactor,
            node_id=self.node_id,
            dmq_connections=self.connections,
            nsq=self.nsq,
            port_factory=self.port_factory,
            clusters={
                scheduling.store.cluster: (self.cluster_workers[scheduling.store.cluster]["adminops"], scheduling.delays)
                for scheduling in self.cluster_scheduling
            },
        )
        self.sampling = Sampling(self.workers["metrics"], reactor, self._channel_stats, options.metrics_db_interval,
                                 others=[workers["adminops"] for workers in self.cluster_workers.values()],
                                 lowest=lambda: dict(broker.snapshot().oldest_stored))
        credentials = CredentialCache(self.authorizer, reactor) if self.authorizer is not None else None
        host, port = options.http_endpoint
        site = make_site(self._ping, self._stats, self.info, options, guard=self._http_guard(host, False, credentials))
        site.resource.putChild(b"metrics", metrics_resource(self._metrics_snapshot, reactor))
        install_nsq_http(
            site.resource,
            ctx=self.nsq,
            broker=broker,
            options=options,
            cluster=self.cluster,
            addresses=lambda: (self.tcp_address, self.http_address),
            gc_pauses=self.sampling.pauses.collector,
        )
        http_host, _ = options.http_endpoint
        inspector = Inspector(ops, cluster=self.cluster, info=self.info, history=self.sampling.history,
                              channels=self._channel_stats, gauges=self.sampling.gauges)
        admin_api.install(site.resource, ops, http_host, options.admin_token, inspector,
                          outboxes=lambda: outbox_stats(self.relays.figures()))
        install_console(site.resource)
        self.http_port = yield from _listen_on(reactor, host, port, site)
        if options.https_address:
            https_host, https_port = parse_address(options.https_address)
            https_site = BoundedSite(site.resource, options, guard=self._http_guard(https_host, True, credentials))
            https_site.noisy = False
            self.https_port = yield from _listen_on(reactor, https_host, https_port, https_site, self.tls)
        yield self._listen_console(ops, credentials)
        self._warn_exposure()

    def _http_guard(self, host: str, secure: bool, credentials: CredentialCache | None) -> HttpGuard:
        options = self.options
        return HttpGuard(
            listen_host=host,
            secure=secure,
            server_tls=self.tls,
            tls_required=options.tls_required_mode == "true",
            https_port=self._https_port,
            credentials=credentials,
            admin_token=options.admin_token,
            open_reads=options.http_open_reads,
            broadcast_address=options.broadcast_address,
        )

    def _https_port(self) -> int | None:
        return self.https_port.getHost().port if self.https_port is not None else None

    def _warn_exposure(self) -> None:
        options = self.options
        auth, required = options.auth_enabled, options.tls_required_mode
        listeners = [
            ("the TCP port (dmq and NSQ)", options.tcp_endpoint[0], required != "false", auth),
            ("the HTTP port", options.http_endpoint[0], required == "true", auth),
        ]
        if options.tls_address:
            listeners.append(("the TLS port", parse_address(options.tls_address)[0], True, auth))
        if options.https_address:
            listeners.append(("the HTTPS port", parse_address(options.https_address)[0], True, auth))
        if options.admin_endpoint is not None:
            listeners.append(("the admin console", options.admin_endpoint[0], options.admin_tls, bool(options.admin_token)))
        for line in exposure_warnings(listeners):
            log.warn("SECURITY WARNING: {line}", line=line)

    def reload(self) -> dict[str, str | None]:
        """SIGHUP: the certificate, key and CA files and the auth file are read again;
        open connections keep going. What failed keeps its previous version."""
        results: dict[str, str | None] = {}
        if self.tls is not None:
            results["tls"] = self.tls.reload()
        if self.authorizer is not None:
            results["auth"] = self.authorizer.reload()
        return results

    @defer.inlineCallbacks
    def _listen_console(self, ops: AdminOps, credentials: CredentialCache | None = None) -> Steps:
        """The admin console on --admin-address; an auxiliary surface, so a port it
        cannot have is logged and the node serves on without it."""
        options = self.options
        if options.admin_endpoint is None:
            return
        host, port = options.admin_endpoint
        if not is_loopback(host) and not options.admin_token:
            log.warn("admin console on non-loopback {host} without --admin-token: it will refuse every command", host=host)
        factory = AdminConsoleFactory(
            ops, host, options.admin_token, self.reactor, options.admin_idle_timeout, credentials,
            read_timeout=options.read_timeout,
        )
        try:
            tls = self.tls if options.admin_tls else None
            console_port = self.console_port = yield from _listen_on(self.reactor, host, port, factory, tls)
        except Exception as exc:  # CannotListenError
            log.error("admin console not started: cannot listen on {host}:{port}: {why}", host=host, port=port, why=exc)
            return
        log.info("admin console on {host}:{port}", host=host, port=console_port.getHost().port)

    @defer.inlineCallbacks
    def _stop_listening(self) -> Steps:
        """SERVER_REBOOT first, so dmq clients send elsewhere while queued sends are
        still committed and answered (the broker's stage, next)."""
        log.info("shutting down: SERVER_REBOOT to {n} connections", n=len(self.connections))
        if self.memory_watch is not None:
            self.memory_watch.stop()
        if self.console_port is not None:
            yield defer.maybeDeferred(self.console_port.stopListening)
        for conn in list(self.connections):
            conn.reboot()
        if self.tcp_port is not None:
            yield defer.maybeDeferred(self.tcp_port.stopListening)
        if self.http_port is not None:
            yield defer.maybeDeferred(self.http_port.stopListening)
        for port in (self.tls_port, self.https_port):
            if port is not None:
                yield defer.maybeDeferred(port.stopListening)

    @property
    def console_address(self) -> tuple[str, int] | None:
        if self.console_port is None:
            return None
        addr = self.console_port.getHost()
        return addr.host, addr.port

    # -- announce -------------------------------------------------------------------
    def _announce(self) -> defer.Deferred:
        """Announced (and delivering) only now that the ports are known."""
        cluster = _started(self.cluster, "cluster")
        return cluster.register(self._broadcast_host(), self.tcp_address[1], self.http_address[1])


class DmqService(ServiceTree):
    """The server's stages as one Twisted service (``ready`` fires when it serves)."""

    def __init__(self, options: Options, reactor: ServerReactor):
        super().__init__()
        self.server = DmqServer(options, reactor)
        for stage in self.server.stages():
            stage.setServiceParent(self)
        self.ready.addCallback(self._log_ready)

    def _log_ready(self, result: T) -> T:
        log.info("dmq node {node} ready", node=self.server.node_id)
        return result

    def stopService(self) -> defer.Deferred:
        d = super().stopService()
        d.addCallback(lambda _: log.info("dmq node {node} stopped", node=self.server.node_id))
        return d


def make_service(options: Options, reactor: ServerReactor | None = None) -> DmqService:
    return DmqService(options, reactor if reactor is not None else installed_reactor())


def installed_reactor() -> ServerReactor:
    """The process's reactor (installed on first import)."""
    from twisted.internet import reactor

    return reactor
