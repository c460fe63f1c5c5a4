"""This node as a member of a cluster: ZooKeeper registration, registry, takeover.

With ``--zk`` the server starts a ``ClusterNode`` between storage and the broker:

* **registry**: topics and channels come from ZooKeeper (``registry.watcher``).
  Every read is mirrored into ``dmq_topic``/``dmq_channel`` *before* the broker sees
  it, because the group commit joins ``dmq_channel`` to decide which channels get a
  delivery row: a channel the broker knows is always one PostgreSQL knows. Watches
  apply changes within milliseconds; the broker's periodic refresh
  (``--zk-refresh``) is the safety net. On the first start of a cluster the
  PostgreSQL registry seeds an empty ZooKeeper registry.
* **membership**: the ephemeral ``/dmq/node/<node-id>`` (``registry.membership``),
  written on start once the listeners have their ports, refreshed every
  ``--node-heartbeat``, deleted on a clean shutdown.
* **ownership**: the node loads and delivers only the copies of its own incarnation
  and of the cursors it holds (``dmq_cursor.holder``), and nothing until it is
  registered; its incarnation begins, and is registered, under its takeover lock.

What the node does when its ZooKeeper session is in doubt (kazoo's states):

=============  ================================================================
SUSPENDED      connection lost, session maybe alive. Delivery continues for a third
               of the session timeout (the session cannot have expired before),
               then pauses: no pushes, no loads. Sends are still stored.
CONNECTED      same session again: resume. New session (after LOST): register
               again (under the takeover lock), then resume.
LOST           session expired: the znode is gone and another node may be taking
               the copies over. Every copy held in memory is dropped (``forget``);
               after registering again the node loads what it still owns.
=============  ================================================================

kazoo's threads reach this module only through ``dmq_server.cluster.bridge``: every method
here runs on the reactor thread.

Why one long module: membership, the registry mirror, the session states and the
takeover triggers are one state machine around one ZooKeeper session.
"""

from __future__ import annotations

import os
import socket
import time
import uuid
from typing import TYPE_CHECKING, Any, Callable, Generator, Mapping

from twisted.internet import defer
from twisted.application.internet import TimerService
from twisted.application.service import MultiService
from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_server.cluster.bridge import KazooBridge
from registry.model import NodeInfo, RegistryError

from dmq_server.core.clock import Timer
from dmq_server.core.options import Options
from dmq_server.db.storage_errors import StorageError
from dmq_server.db.runner import StepRunner
from dmq_server.db.worker import DbWorker
from dmq_server.db.topic_steps import list_topics_steps, mirror_topics_steps
from dmq_server.db.mirror import note_kept
from dmq_server.cluster.orderers import ROUND_EVERY, ClusterOrderers
from dmq_server.cluster.takeover import ClusterStore, Takeover

if TYPE_CHECKING:
    from kazoo.client import KazooClient

    from dmq_server.db.mirror import Mirror
    from registry.membership import NodeMembership
    from registry.takeover_lock import TakeoverLock
    from registry.watcher import RegistryWatcher
    from registry.model import TopicSpec

__all__ = ["ClusterNode"]

log = Logger()

VERSION = "0.1.0"


class ClusterNode:
    def __init__(
        self,
        options: Options,
        reactor: Any,
        node_id: str,
        dsn: str,
        admin: StepRunner,
        mirror: Mirror | None = None,
        cluster_dsns: dict[str, str] | None = None,
    ):
        self.options = options
        self.reactor = reactor
        self.node_id = node_id
        self.instance = f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        self._dsn = dsn
        self._admin = admin
        self._mirror = mirror  # db.mirror.Mirror into the other clusters (--pg-cluster), or None
        self._dsns = {"main": dsn, **(cluster_dsns or {})}
        self._workers: dict[str, DbWorker] = {}  # a connection per cluster for takeovers
        self.takeovers: dict[str, Takeover] = {}  # one per cluster: its incarnations are its own
        self.bridge = KazooBridge(reactor)
        self.client: KazooClient | None = None
        self.membership: NodeMembership | None = None
        self.watcher: RegistryWatcher | None = None
        self.takeover: Takeover | None = None
        self.orderers: ClusterOrderers | None = None  # who delivers each ordered topic (``attach``)
        # the reliable stores by cluster and the broker's registry refresh (``attach``)
        self._stores: Mapping[str, ClusterStore] = {}
        self._refresh: Callable[[bool], defer.Deferred] | None = None
        self._worker: DbWorker | None = None
        #: live nodes by id, as last read from /dmq/node
        self.nodes: dict[str, NodeInfo] = {}
        self.registered = False
        self.stopping = False
        self.zk_state = "CONNECTED"
        self._pause_timer: Timer | None = None
        self._suspended_pause = False
        self._last_scan: float | None = None  # reactor time of the broker's last scan
        self._gap_check: str = ""  # "", "asking" (ZooKeeper asked), "again" (ask at the next scan)
        self._stalls = 0  # gaps found: an answer to a question asked before the last one resumes nothing
        self._registering: defer.Deferred | None = None
        self._start_lock: TakeoverLock | None = None  # the takeover lock held from the incarnation's start
        self._last_specs: list[TopicSpec] | None = None
        self.timers = self._timers()
        self._nodes_reading = False
        self._nodes_again = False
        self._fast_topics: Callable[[], dict[str, tuple[str, ...]]] = dict
        self._announced: dict[str, tuple[str, ...]] = {}
        self.re_registrations = 0
        self._started = False
        self._takeover_due = False
        # bumped by every registration: an answer to a question asked under an earlier
        # registration (a node list read, a heartbeat) says nothing about this one
        self._registration = 0

    # -- start --------------------------------------------------------------------------
    @defer.inlineCallbacks
    def connect(self) -> Generator[defer.Deferred, Any, None]:
        """Reach ZooKeeper (bounded by --zk-connect-timeout) and prepare the registry."""
        from registry import zk
        from registry.watcher import RegistryWatcher

        self.bridge.start()
        options = self.options
        self.client = yield self.bridge.call(
            zk.connect,
            options.zk,
            timeout=options.zk_connect_timeout,
            session_timeout=options.zk_session_timeout,
            security=options.zk_security,
        )
        self.client.add_listener(self.bridge.relay(self._state_changed))
        self.watcher = RegistryWatcher(self.client, self.bridge.relay(self._changed))
        # the first node of a cluster brings the single-node registry along
        rows = yield self._admin.run_steps(list_topics_steps)
        registry = zk.ZkRegistry(self.client)
        seeded = yield self._zk(registry.seed, rows)
        for name in options.pg_clusters:  # `dmq topic create --cluster` checks the names
            yield self._zk(registry.add_cluster, name)
        if seeded:
            log.info("seeded the ZooKeeper registry with {n} topics from PostgreSQL", n=len(rows))
        for name, dsn in self._dsns.items():
            self._workers[name] = DbWorker(self.reactor, dsn, "cluster", timeout=options.pg_timeout)
            self._workers[name].start()
        self._worker = self._workers["main"]
        log.info("connected to ZooKeeper at {zk}", zk=options.zk)

    def _member(self) -> NodeMembership:
        """This node's registration (made by ``register``, before any caller runs)."""
        if self.membership is None:
            raise RegistryError(f"node {self.node_id!r} has not registered yet")
        return self.membership

    def _watching(self) -> RegistryWatcher:
        """The registry's watches (set by ``connect``, before any caller runs)."""
        if self.watcher is None:
            raise RegistryError("not connected to ZooKeeper yet")
        return self.watcher

    def _zk(self, fn: Callable[..., Any], *args: Any, timeout: float | None = -1.0) -> defer.Deferred:
        """Run registry work on the bridge, failing at once while disconnected, and
        (unless ``timeout`` is None) giving up after ``timeout`` seconds on the reactor."""
        from registry.zk import when_connected

        d = self.bridge.call(when_connected, self.client, fn, *args)
        if timeout is not None:
            d.addTimeout(timeout if timeout > 0 else 2 * self.options.zk_session_timeout + 5, self.reactor)
        return d

    @defer.inlineCallbacks
    def begin_incarnation(self, stores: Mapping[str, ClusterStore]) -> Generator[defer.Deferred, Any, None]:
        """Begin this process's incarnation on every cluster (``store.start``) holding the
        node's takeover lock, and keep it until the first registration names them: a
        takeover running meanwhile would see the node absent and retire them."""
        from registry.takeover_lock import TakeoverLock

        lock = TakeoverLock(self.client, self.node_id, f"start {self.instance}")
        got = yield self._zk(lock.acquire, 2 * self.options.zk_session_timeout + 30, timeout=None)
        if not got:
            raise RegistryError(f"node {self.node_id!r}: its takeover lock stayed busy")
        try:
            for store in stores.values():
                yield store.start(alone=False)
        except BaseException:
            yield self._zk(lock.release)
            raise
        self._start_lock = lock

    def attach(
        self,
        stores: Mapping[str, ClusterStore],
        refresh_registry: Callable[[bool], defer.Deferred],
        fast_topics: Callable[[], dict[str, tuple[str, ...]]],
    ) -> None:
        """The broker's reliable stores (made fenced by this node: ``reliable.store.Fence``
        of its id and ``may_deliver``) deliver nothing before
        registration; ``refresh_registry(fresh)`` is the broker's, called when a watch
        fires."""
        self._stores = stores
        self._refresh = refresh_registry
        self._fast_topics = fast_topics
        self._pause()
        main = stores["main"]
        for name, store in stores.items():
            self.takeovers[name] = Takeover(
                self._zk,
                self.client,
                self._workers[name],
                store,
                self.node_id,
                self.options.takeover_batch_size,
                can_claim=lambda: self.registered and not main.paused,
                cluster=name,
            )
        self.takeover = self.takeovers["main"]
        self.orderers = ClusterOrderers(
            self._zk,
            self.client,
            self.node_id,
            stores,
            self._workers,
            can_order=lambda: self.registered and not main.paused and not self.stopping,
            clock=self.reactor,
        )
        rounds = TimerService(ROUND_EVERY, self.orderers.tick)
        rounds.clock = self.reactor
        rounds.setName("orderers")
        rounds.setServiceParent(self.timers)

    # -- a node that stood still -------------------------------------------------------------
    def may_deliver(self) -> bool:
        """Asked by a channel before it pushes: after a gap in this node's time (found
        here before the overdue scan would find it: an ack read on waking pumps at once),
        delivery pauses until ZooKeeper confirms the session, so nothing held from before
        the gap is pushed while other nodes may have taken it over."""
        self._check_gap_if_due()
        main = self._stores.get("main")
        return main is None or not main.paused

    def stood_still(self) -> bool:
        """Asked before bytes that may have been decided before a stall leave
        (``protocols.turn``, through ``Broker.may_push``): whether this node stood still
        (a gap found here or by the scan) and ZooKeeper has not confirmed its session
        since. Not whether it may deliver: a pause for a session in doubt stops new
        pushes, not those decided while the node held their copies."""
        self._check_gap_if_due()
        return bool(self._gap_check)

    def _check_gap_if_due(self) -> None:
        """``check_gap`` now if the last scan is older than a third of the session timeout
        (asked between scans: the first push or flush after waking may come before the scan)."""
        last = self._last_scan
        if last is not None and self.reactor.seconds() - last > self.options.zk_session_timeout / 3:
            self.check_gap()

    def check_gap(self) -> None:
        """Run before each of the broker's scans (its ``before_scan``).

        A node frozen (SIGSTOP, a paused VM, a long stall) or whose clock stepped ahead
        for longer than its session may allow has had its copies taken over by other
        nodes without knowing it: kazoo's thread stood still too. When it runs again,
        the overdue scan would redeliver copies whose message timeout passed meanwhile,
        copies other nodes delivered and saw acknowledged (the chaos suite's
        node-pause counted such duplicates). The scan runs before any IO that would
        tell the node, so the check runs first, in the scan itself: after a gap longer
        than a third of the session timeout (the earliest an expiry may follow), delivery
        pauses until ZooKeeper confirms that the node's znode is still its session's.
        """
        now = self.reactor.seconds()
        last, self._last_scan = self._last_scan, now
        if not self.registered or self.stopping or self.membership is None:
            return
        gap = now - last if last is not None else 0.0
        if gap > self.options.zk_session_timeout / 3:
            log.warn("node {node} stood still {gap:.1f}s: pausing delivery until ZooKeeper confirms its session",
                     node=self.node_id, gap=gap)
            self._pause()  # paused already or not: a gap needs its own answer
            self._stalls += 1
        elif not self._gap_check:
            return
        if self._gap_check != "asking":  # (an answer on its way asks again if a gap came after its question)
            self._ask_session()

    def _ask_session(self) -> None:
        """Ask ZooKeeper whether this node's znode is still its session's; resume on a yes
        unless the node stood still again after the question (then ask again)."""
        self._gap_check = "asking"
        asked_under, stalls = self._registration, self._stalls

        def answered(ok: bool) -> None:
            self._gap_check = ""
            if asked_under != self._registration or self.stopping:
                return
            if not ok:
                self._evicted()
            elif self._stalls != stalls:
                self._ask_session()
            elif self.zk_state == "CONNECTED":
                log.info("node {node}: session confirmed, delivering again", node=self.node_id)
                self._resume()

        def unanswered(failure: Failure) -> None:
            # disconnected: kazoo's state changes decide (CONNECTED resumes, LOST drops
            # what is held); ask again at the next scan meanwhile
            self._gap_check = "again"

        assert self.membership is not None
        self._zk(self.membership.heartbeat).addCallbacks(answered, unanswered)

    @defer.inlineCallbacks
    def register(self, host: str, tcp_port: int, http_port: int) -> Generator[defer.Deferred, Any, None]:
        """Announce this node (listeners are up), then start delivering."""
        from registry.membership import NodeMembership

        now = time.time()
        info = NodeInfo(
            self.node_id,
            host,
            tcp_port,
            http_port,
            VERSION,
            now,
            now,
            socket.gethostname(),
            self.instance,
            dict(self._fast_topics()),
        )
        self.membership = NodeMembership(
            self.client, info, stale_wait=2 * self.options.zk_session_timeout + 2
        )
        yield self._register()
        if not self.registered:
            raise RegistryError(f"node {self.node_id!r} could not register in ZooKeeper")
        self._started = True
        nodes = yield self._zk(self._watching().read_nodes)  # lookups answer at once
        self.nodes = {n.node_id: n for n in nodes}
        self._check_takeover()  # copies of nodes that died while none was watching

    def _timers(self) -> MultiService:
        """Heartbeat, node-list refresh and fast-topic announcements: named
        ``TimerService``s that the service tree runs from ``connect`` until the node
        leaves (so heartbeats go on while the broker drains). Each does nothing
        before ``register``."""
        timers = MultiService()
        for name, fn, step in (
            ("heartbeat", self._heartbeat, self.options.node_heartbeat),
            ("nodes", self._periodic, self.options.zk_refresh),
            ("announce", self._announce, 1.0),
        ):
            timer = TimerService(step, fn)
            timer.clock = self.reactor
            timer.setName(name)
            timer.setServiceParent(timers)
        return timers

    def _register(self) -> defer.Deferred:
        """Register (idempotent); one attempt at a time. Fires when done or failed."""
        if self._registering is not None:
            waiter: defer.Deferred = defer.Deferred()

            def settled(result: object) -> object:
                waiter.callback(None)
                return result

            self._registering.addBoth(settled)
            return waiter

        def done(_: object) -> None:
            self._registering = None
            self.registered = True
            self._registration += 1
            self._takeover_due = True  # once the nodes are read (below)
            log.info("node {node} registered in ZooKeeper", node=self.node_id)
            self._resume()
            self._read_nodes()
            self._refresh_topics()

        def failed(failure: Failure) -> Failure | None:
            self._registering = None
            if self.stopping:
                return None
            if not self._started:
                return failure  # at start: the error (e.g. a duplicate node id) ends the start
            log.warn("registration failed, retrying: {why}", why=failure.getErrorMessage())
            self.reactor.callLater(1.0, self._retry_register)
            return None

        d = self._register_incarnation()
        d.addCallbacks(done, failed)
        self._registering = d
        return d

    @defer.inlineCallbacks
    def _register_incarnation(self) -> Generator[defer.Deferred, Any, None]:
        """Create the znode naming this process's incarnation, holding the takeover lock.
        After a lost session other nodes may have taken the incarnation over (retired:
        it stores nothing more), so under the lock a retired one is replaced by a new
        incarnation before the znode names it."""
        from dmq_server.db.messages import create_owner_steps, read_owners_steps

        lock, self._start_lock = self._start_lock, None
        if lock is None:
            lock = yield self._zk(self._member().lock, timeout=None)
        try:
            stores = self._stores
            for name, store in stores.items():
                worker = self._workers[name]
                owners = yield worker.run_steps(read_owners_steps)
                mine = [o for o in owners if o.owner == store.incarnation]
                if not mine or mine[0].retired:  # taken over while the session was lost
                    store.renew_incarnation((yield worker.run_steps(create_owner_steps, self.node_id)))
            if stores:
                self._member().update(
                    incarnation=stores["main"].incarnation,
                    incarnations={name: s.incarnation for name, s in stores.items() if name != "main"},
                )
        except BaseException:
            yield self._zk(lock.release)
            raise
        yield self._zk(self._member().register_locked, lock, timeout=None)

    def _retry_register(self) -> None:
        if not self.stopping and not self.registered and self.zk_state == "CONNECTED":
            self._register()

    # -- the registry, for the broker ---------------------------------------------------
    def fetch_topics(self) -> defer.Deferred:
        """Topics from ZooKeeper (re-arming the watches), mirrored into PostgreSQL first.

        While ZooKeeper cannot be read, the last snapshot stands (the node keeps
        serving what it knew, and mirrors it again without removing anything: a topic or
        channel created since is not in it); with none yet, StorageError."""
        d = self._zk(self._watching().read_topics)

        def unreadable(failure: Failure) -> tuple[list[TopicSpec], bool]:
            if self._last_specs is not None:
                log.warn("ZooKeeper registry unreadable, keeping the last view: {why}", why=failure.getErrorMessage())
                return self._last_specs, False
            raise StorageError(f"ZooKeeper registry unreadable: {failure.getErrorMessage()}")

        def mirror(read: tuple[list[TopicSpec], bool]) -> defer.Deferred:
            specs, fresh = read
            mirrored = self._admin.run_steps(mirror_topics_steps, specs, fresh)
            mirrored.addCallback(lambda outcome: note_kept("main", outcome))
            other = self._mirror
            if other is None:
                return mirrored.addCallback(lambda _: remember(specs))
            # routed by what the other clusters were made safe for (db.mirror: an ordered
            # topic's move away from one out of reach waits); the view is remembered
            def routable(safe: list[TopicSpec]) -> list[TopicSpec]:
                remember(specs)
                return safe

            return mirrored.addCallback(lambda _: other.mirror(specs, fresh)).addCallback(routable)

        def remember(specs: list[TopicSpec]) -> list[TopicSpec]:
            self._last_specs = specs
            return specs

        return d.addCallbacks(lambda specs: (specs, True), unreadable).addCallback(mirror)

    def _refresh_topics(self) -> None:
        if self._refresh is not None and not self.stopping:
            self._refresh(True).addErrback(
                lambda f: log.warn("registry refresh failed: {why}", why=f.getErrorMessage())
            )

    def _changed(self, kind: str) -> None:
        """A watch fired (reactor thread, relayed by the bridge)."""
        if self.stopping:
            return
        if kind == "topics":
            self._refresh_topics()
        else:
            self._read_nodes()

    # -- live nodes ---------------------------------------------------------------------
    def live_nodes(self) -> list[NodeInfo]:
        return [self.nodes[k] for k in sorted(self.nodes)]

    def _read_nodes(self) -> None:
        if self.stopping or self.watcher is None:
            return
        if self._nodes_reading:
            self._nodes_again = True
            return
        self._nodes_reading = True
        asked_under = self._registration if self.registered else None

        def read(nodes: list[NodeInfo]) -> None:
            before = set(self.nodes)
            self.nodes = {n.node_id: n for n in nodes}
            for gone in sorted(before - set(self.nodes)):
                log.info("node {node} left the cluster", node=gone)
            for new in sorted(set(self.nodes) - before):
                log.info("node {node} is in the cluster", node=new)
            if (
                self.node_id not in self.nodes
                and self.registered
                and asked_under == self._registration
                and self.zk_state == "CONNECTED"
            ):
                self._evicted()
            elif before - set(self.nodes) or self._takeover_due:
                self._takeover_due = False
                self._check_takeover()

        def finished(_: object) -> None:
            self._nodes_reading = False
            if self._nodes_again:
                self._nodes_again = False
                self._read_nodes()

        d = self._zk(self.watcher.read_nodes)
        d.addCallbacks(read, lambda f: log.warn("cannot read nodes: {why}", why=f.getErrorMessage()))
        d.addBoth(finished)

    def _check_takeover(self) -> None:
        if self.stopping:
            return
        for name, takeover in self.takeovers.items():
            takeover.check({node: info.incarnation_on(name) for node, info in self.nodes.items()})

    # -- session states -----------------------------------------------------------------
    def _state_changed(self, state: str) -> None:
        """kazoo's KazooState (relayed to the reactor by the bridge)."""
        self.zk_state = str(state)
        if self.stopping:
            return
        if self.zk_state == "SUSPENDED":
            log.warn("ZooKeeper connection lost; the session may still be alive")
            if self._pause_timer is None and self.registered:
                # the session cannot expire before a third of its timeout from now
                delay = self.options.zk_session_timeout / 3 * 0.9
                self._pause_timer = self.reactor.callLater(delay, self._suspended_too_long)
        elif self.zk_state == "LOST":
            log.warn("ZooKeeper session lost: dropping every message held, they may be taken over")
            self._cancel_pause_timer()
            self._lose()
        elif self.zk_state == "CONNECTED":
            self._cancel_pause_timer()
            if not self.registered:
                if self.membership is not None:
                    self.re_registrations += 1
                    self._register()
            else:
                if self._suspended_pause:
                    log.info("ZooKeeper connection back, same session: delivering again")
                if self._gap_check == "again":  # the session kazoo kept is the one asked about
                    self._gap_check = ""
                self._resume()
                self._read_nodes()
                self._refresh_topics()

    def _suspended_too_long(self) -> None:
        self._pause_timer = None
        if self.zk_state != "CONNECTED" and not self.stopping:
            log.warn("still no ZooKeeper connection: pausing delivery until the session is known")
            self._suspended_pause = True
            self._pause()

    def _cancel_pause_timer(self) -> None:
        if self._pause_timer is not None and self._pause_timer.active():
            self._pause_timer.cancel()
        self._pause_timer = None

    def _lose(self) -> None:
        self.registered = False
        self._pause()
        if self.orderers is not None:  # the ordered topics' locks went with the session
            self.orderers.session_lost()
        for store in self._stores.values():
            store.forget_held()

    def _evicted(self) -> None:
        """Our znode vanished while the session lives (deleted by hand): others may be
        taking our copies over, so behave as after a lost session."""
        log.warn("node {node} is no longer registered: dropping messages held, registering again", node=self.node_id)
        self._lose()
        self.re_registrations += 1
        self._register()

    def _pause(self) -> None:
        for store in self._stores.values():
            store.pause_delivery(True)

    def _resume(self) -> None:
        if not self.registered:
            return
        self._suspended_pause = False
        for store in self._stores.values():
            store.pause_delivery(False)

    # -- periodic work ------------------------------------------------------------------
    def _heartbeat(self) -> None:
        if not self.registered or self.zk_state != "CONNECTED":
            return
        asked_under = self._registration

        def beat(ok: bool) -> None:
            if (
                not ok
                and self.registered
                and asked_under == self._registration
                and self.zk_state == "CONNECTED"
                and not self.stopping
            ):
                self._evicted()

        d = self._zk(self._member().heartbeat)
        d.addCallbacks(beat, lambda f: log.warn("heartbeat failed: {why}", why=f.getErrorMessage()))

    def _announce(self) -> None:
        """Publish this node's fast (NSQ) topics when they change, for cluster lookups."""
        if not self.registered or self.zk_state != "CONNECTED":
            return
        current = dict(self._fast_topics())
        if current == self._announced:
            return
        self._announced = current
        self._member().update(fast_topics=current)
        self._zk(self._member().heartbeat).addErrback(lambda f: None)

    def _periodic(self) -> None:
        if not self._started:
            return
        self._read_nodes()
        self._check_takeover()

    # -- stop ---------------------------------------------------------------------------
    @defer.inlineCallbacks
    def stop(self) -> Generator[defer.Deferred, Any, None]:
        """Leave the cluster (others take over what is still stored) and disconnect."""
        self.stopping = True
        self._cancel_pause_timer()
        if self.timers.running:  # stopped by the service tree first
            self.timers.stopService()
        for takeover in self.takeovers.values():
            yield takeover.idle()
        if self.orderers is not None and self.registered:
            yield defer.ensureDeferred(self.orderers.stop())
        if self.membership is not None and self.registered:
            try:
                yield self._zk(self.membership.leave)
                log.info("node {node} left the cluster", node=self.node_id)
            except Exception as exc:  # the session ends anyway when the client stops
                log.warn("could not leave cleanly: {why}", why=exc)
        self.registered = False
        if self.client is not None:
            yield self.bridge.close_client(self.client)
        self.bridge.stop()
        for worker in self._workers.values():
            worker.stop()

    def stats(self) -> dict[str, object]:
        return {
            "zk": self.options.zk,
            "zk_state": self.zk_state,
            "registered": self.registered,
            "delivery_paused": "main" in self._stores and self._stores["main"].paused,
            "re_registrations": self.re_registrations,
            "nodes": sorted(self.nodes),
            "takeover": self.takeover.stats() if self.takeover is not None else {},
            "takeover_by_cluster": {name: t.stats() for name, t in self.takeovers.items()},
            "orderers": self.orderers.stats() if self.orderers is not None else {},
        }
