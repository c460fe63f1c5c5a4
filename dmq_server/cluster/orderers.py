"""One orderer per ordered topic: the node that delivers its channels in a cluster.

Per-key order (issue 45, ``docs/protocol.md`` §5) needs one place that sees every copy of
a key: with ``--zk`` every node stores an ordered topic's messages, but only its
*orderer* loads and pushes the topic's channels, holding the cursors of every owner
(``claim_ordered_cursors``); on the other nodes the channels are gated
(``ReliableStore.order_elsewhere``: consumers may subscribe, nothing is pushed).

Placement is a ZooKeeper lock per topic (``registry.placement_lock.PlacementLock`` at
``/dmq/orderer/<topic>``), tried without waiting once a second by every registered
node; the winner keeps it while its session lives. The lock only places: the fence is
the database. The winner claims the topic's cursors *before* its first load, so an ack
the previous orderer sends late (a frozen process waking up) is refused, and its copy
goes out again at the head of its key. What makes loading every node's copies safe is
that an ordered topic's commits are serialised cluster-wide (a transaction-scoped
advisory lock in ``insert_messages`` and ``move_due``): the ids PostgreSQL shows are
always a prefix, so a load never passes an id that becomes visible later.

A handover may leave copies in flight at the previous orderer's consumers: a killed
node broke their connections, but a frozen or cut-off one did not, and its consumers
may still be working on a key's copy when the new orderer pushes the same key. So when
the claim takes cursors from another node that did not let them go cleanly, the new
orderer waits the topic's message timeout (what the old orderer itself allowed a copy in
flight, ``handover_wait``) before it pushes. A clean stop (its consumers gone) leaves a
note on the lock naming the node (``PlacementLock.leave_note``), and the next orderer
delivers at once. A topic that stops being ordered goes back to every node delivering
its own copies: its last orderer gives the cursors back (``release_ordered_cursors``).
A cluster that has the topic only later (``dmq topic move`` to it) is claimed at the
orderer's next round and delivered from then; the other nodes gate it then too.

Every method runs on the reactor; ZooKeeper's blocking calls go through the node's
bridge (``ClusterNode._zk``), which fails at once while disconnected: a round that
cannot ask leaves things as they were.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping, Protocol

from twisted.internet import defer
from twisted.logger import Logger

from dmq_server.core.clock import Clock, Timer
from dmq_server.db.runner import StepRunner
from dmq_server.db.orderer_steps import (
    Claimed,
    claim_ordered_cursors_steps,
    reclaim_ordered_cursors_steps,
    release_ordered_cursors_steps,
)
from dmq_server.cluster.takeover import ZkCall

if TYPE_CHECKING:
    from kazoo.client import KazooClient

    from registry.placement_lock import PlacementLock

__all__ = ["ClusterOrderers", "OrderedStore"]

log = Logger()

#: seconds between two rounds of contending for the ordered topics' locks
ROUND_EVERY = 1.0
#: claims failing this many rounds in a row (this node's way to the database is broken,
#: say, while ZooKeeper's is not): the orderer lets the topic go, so another node delivers
STEP_ASIDE_AFTER = 5
#: seconds a node that stepped aside, or failed to claim, leaves the topic to the others
BENCHED_FOR = 10.0


class OrderedStore(Protocol):
    """What the orderers ask of each cluster's reliable store (``reliable.store``)."""

    def ordered_topics(self) -> set[str]: ...
    def order_here(self, topic: str) -> None: ...
    def order_elsewhere(self, topic: str, orderer: str | None) -> None: ...
    def msg_timeout_of(self, topic: str) -> float: ...


class ClusterOrderers:
    """Contends for every ordered topic's lock, claims and delivers the ones it wins.

    ``stores``/``workers``: by PostgreSQL cluster name (a topic being moved has copies
    on two); ``can_order()``: registered and delivering (a node whose session is in
    doubt neither contends nor claims)."""

    def __init__(
        self,
        zk_call: ZkCall,
        client: KazooClient | None,
        node_id: str,
        stores: Mapping[str, OrderedStore],
        workers: Mapping[str, StepRunner],
        can_order: Callable[[], bool],
        clock: Clock,
    ):
        self._zk = zk_call
        self._client = client
        self.node_id = node_id
        self._stores = stores
        self._workers = workers
        self._can_order = can_order
        self._clock = clock
        self._locks: dict[str, PlacementLock] = {}
        self.here: set[str] = set()  # topics this node delivers (claimed, lock held)
        self._waiting: dict[str, Timer] = {}  # claimed, waiting out a handover before pushing
        self._seen: dict[str, str | None] = {}  # the orderer last named to the stores
        # the clusters whose stores were last told who orders a topic: one that has the
        # topic since (a move to it, ``dmq topic move``) is told at the next round
        self._told: dict[str, set[str]] = {}
        self._failures: dict[str, int] = {}  # claims failed in a row while ordering
        self._benched: dict[str, float] = {}  # topic -> until when this node does not contend
        self._round: defer.Deferred | None = None
        self.gained = 0
        self.lost_count = 0

    # -- the round ----------------------------------------------------------------------
    def tick(self) -> None:
        """One round, unless the last is still running (a slow ZooKeeper or database)."""
        if self._round is not None or not self._can_order():
            return
        self._round = defer.ensureDeferred(self._contend())

        def finished(_: object) -> None:
            self._round = None

        self._round.addErrback(lambda f: log.warn("ordered topics: a round failed: {why}", why=f.getErrorMessage()))
        self._round.addBoth(finished)

    def _topics(self) -> set[str]:
        topics: set[str] = set()
        for store in self._stores.values():
            topics |= store.ordered_topics()
        return topics

    async def _contend(self) -> None:
        topics = self._topics()
        for topic in sorted(set(self._locks) - topics):  # no longer ordered, or deleted
            await self._let_go(topic, ordered=False)
            self._locks.pop(topic, None)
            self._seen.pop(topic, None)
            self._told.pop(topic, None)
        for topic in sorted(topics):
            if not self._can_order():
                return
            lock = self._locks.get(topic)
            if lock is None:
                lock = self._locks[topic] = self._new_lock(topic)
            if self._benched.get(topic, 0.0) > self._clock.seconds():
                await self._name_holder(topic, lock)
                continue
            try:
                held = await self._zk(lock.hold)
            except Exception as exc:  # ZooKeeper away: as things were
                log.warn("ordered topic {topic}: ZooKeeper did not say who orders it ({why})", topic=topic, why=exc)
                continue
            if held:
                if topic not in self.here:
                    await self._gain(topic, lock)
                else:
                    await self._reclaim(topic, lock)
                continue
            if topic in self.here:
                self._lost(topic)
            await self._name_holder(topic, lock)

    async def _name_holder(self, topic: str, lock: PlacementLock) -> None:
        try:
            holder = await self._zk(lock.holder)
        except Exception:  # ZooKeeper away: as things were
            return
        self._name(topic, holder)

    def _new_lock(self, topic: str) -> PlacementLock:
        from registry import paths
        from registry.placement_lock import PlacementLock

        return PlacementLock(self._client, paths.orderer(topic), self.node_id)

    def _having(self, topic: str) -> set[str]:
        """The clusters whose stores have ``topic`` (ordered) now."""
        return {name for name, store in self._stores.items() if topic in store.ordered_topics()}

    def _name(self, topic: str, holder: str | None) -> None:
        """Tell the stores which node orders ``topic`` (they gate its channels)."""
        having = self._having(topic)
        renamed = topic not in self._seen or self._seen[topic] != holder
        tell = having if renamed else having - self._told.get(topic, set())
        self._seen[topic] = holder
        self._told[topic] = having
        for name in sorted(tell):  # a cluster that has the topic since is told too
            self._stores[name].order_elsewhere(topic, holder)

    async def _gain(self, topic: str, lock: PlacementLock) -> None:
        """The lock is ours: claim the topic's cursors on every cluster that has it, then
        deliver (after ``handover_wait`` when they came from a node that did not let them
        go cleanly: its note names it). A claim that fails lets the lock go: another node
        may reach the database."""
        try:
            note = await self._zk(lock.note)
            taken_from = await self._claim(topic)
            if note:
                await self._zk(lock.leave_note, "")
        except Exception as exc:
            log.warn("ordered topic {topic}: claiming its cursors failed ({why}); letting its lock go",
                     topic=topic, why=exc)
            self._benched[topic] = self._clock.seconds() + BENCHED_FOR
            await self._release_lock(topic, lock)
            return
        if not self._can_order() or topic not in self._topics():
            await self._release_lock(topic, lock)
            return
        unclean = taken_from - {note}
        self.here.add(topic)
        self._seen[topic] = self.node_id
        self._failures[topic] = 0
        self.gained += 1
        wait = self.handover_wait(topic) if unclean else 0.0
        log.info("ordered topic {topic}: this node orders it now{after}", topic=topic,
                 after=f" (taken from {', '.join(sorted(unclean))}: pushing in {wait:g}s)" if wait else "")
        if wait:
            self._waiting[topic] = self._clock.callLater(wait, self._deliver, topic)
        else:
            self._deliver(topic)

    async def _claim(self, topic: str, again: frozenset[str] = frozenset()) -> set[str]:
        """Hold every cursor of ``topic`` on every cluster that has it; the nodes that held
        some before. Run on a gain and again at every round while held (on the clusters
        in ``again`` only the second half, ``reclaim_ordered_cursors``): a late ack of the
        previous orderer (a copy it loaded before it learnt of the loss) may open a cursor
        in its own name, whose acks would be refused here until claimed."""
        taken_from: set[str] = set()
        for name, store in sorted(self._stores.items()):
            if topic in store.ordered_topics():
                steps = reclaim_ordered_cursors_steps if name in again else claim_ordered_cursors_steps
                claimed: Claimed = await self._workers[name].run_steps(steps, topic, self.node_id)
                taken_from |= claimed.taken_from - {self.node_id}
        return taken_from

    def handover_wait(self, topic: str) -> float:
        """How long a copy the previous orderer pushed may still be at its consumer: the
        topic's message timeout (a reliable channel's; a touch renews it only while that
        orderer's session is not in doubt: ``ReliableChannel.touch``)."""
        return max((store.msg_timeout_of(topic) for store in self._stores.values() if topic in store.ordered_topics()),
                   default=0.0)

    def _deliver(self, topic: str, only: set[str] | None = None) -> None:
        """Deliver ``topic`` from every cluster that has it (``only``: from those)."""
        self._waiting.pop(topic, None)
        if topic not in self.here:
            return
        having = self._having(topic)
        for name in sorted(having if only is None else having & only):
            self._stores[name].order_here(topic)
        self._told[topic] = having

    def _not_here(self, topic: str) -> None:
        """No longer delivered from here, nor waiting to be (a handover's wait cancelled)."""
        self.here.discard(topic)
        waiting = self._waiting.pop(topic, None)
        if waiting is not None and waiting.active():
            waiting.cancel()

    def _lost(self, topic: str) -> None:
        """The lock is no longer ours (the session that held it ended): stop at once."""
        self._not_here(topic)
        self.lost_count += 1
        self._seen.pop(topic, None)
        self._told.pop(topic, None)
        for store in self._stores.values():
            if topic in store.ordered_topics():
                store.order_elsewhere(topic, None)
        log.warn("ordered topic {topic}: this node lost its lock and stops delivering it", topic=topic)

    async def _reclaim(self, topic: str, lock: PlacementLock) -> None:
        try:
            taken_from = await self._claim(topic, again=frozenset(self._told.get(topic, ())))
        except Exception as exc:  # again at the next round, or step aside
            failures = self._failures[topic] = self._failures.get(topic, 0) + 1
            log.warn("ordered topic {topic}: claiming its cursors again failed ({failures} in a row): {why}",
                     topic=topic, failures=failures, why=exc)
            if failures >= STEP_ASIDE_AFTER:
                await self._step_aside(topic, lock)
            return
        self._failures[topic] = 0
        if taken_from:
            log.info("ordered topic {topic}: took back cursors a late ack of {nodes} opened", topic=topic,
                     nodes=", ".join(sorted(taken_from)))
        if topic not in self._waiting:
            # a cluster that has the topic since the last round (it was moved there): its
            # cursors are claimed now, so it may deliver; its channels were gated till then
            new = self._having(topic) - self._told.get(topic, set())
            if new:
                log.info("ordered topic {topic}: delivering it from cluster(s) {names} too", topic=topic,
                         names=", ".join(sorted(new)))
            self._deliver(topic, new)

    async def _step_aside(self, topic: str, lock: PlacementLock) -> None:
        """This node keeps its ZooKeeper session but not its way to the database: stop
        delivering the topic (no note: its consumers may still hold copies) and leave it
        to the other nodes for ``BENCHED_FOR`` seconds."""
        self._lost(topic)
        self._benched[topic] = self._clock.seconds() + BENCHED_FOR
        await self._release_lock(topic, lock)

    async def _let_go(self, topic: str, ordered: bool) -> None:
        """Stop ordering ``topic`` and release its lock. Still ordered (a clean stop: this
        node's consumers are gone): leave a note naming this node, so the next orderer
        pushes at once. No longer ordered: give the cursors back to the nodes that stored
        the copies (``release_ordered_cursors``)."""
        if topic not in self.here:
            return
        self._not_here(topic)
        lock = self._locks.get(topic)
        if ordered:
            for store in self._stores.values():
                if topic in store.ordered_topics():
                    store.order_elsewhere(topic, None)
            if lock is not None:
                try:
                    await self._zk(lock.leave_note, self.node_id)
                except Exception as exc:  # the next orderer waits out the handover instead
                    log.warn("ordered topic {topic}: leaving a note failed: {why}", topic=topic, why=exc)
        else:
            for name in sorted(self._stores):
                try:
                    await self._workers[name].run_steps(release_ordered_cursors_steps, topic, self.node_id)
                except Exception as exc:  # the nodes' acks stay refused until an orderer releases
                    log.warn("ordered topic {topic}: giving its cursors back failed: {why}", topic=topic, why=exc)
        if lock is not None:
            await self._release_lock(topic, lock)

    async def _release_lock(self, topic: str, lock: PlacementLock) -> None:
        try:
            await self._zk(lock.release)
        except Exception as exc:  # it goes with the session
            log.warn("ordered topic {topic}: releasing its lock failed: {why}", topic=topic, why=exc)

    # -- the node's session and stop ----------------------------------------------------------
    def session_lost(self) -> None:
        """The ZooKeeper session ended: every lock went with it; stop delivering at once."""
        for topic in sorted(self.here):
            self._lost(topic)

    async def stop(self) -> None:
        """A clean stop (the node's consumers are gone): let every topic go cleanly, so
        the next orderer pushes without waiting out a handover."""
        if self._round is not None:
            try:
                await self._round
            except Exception:
                pass
        for topic in sorted(self.here):
            await self._let_go(topic, ordered=True)

    def stats(self) -> dict[str, object]:
        return {
            "here": sorted(self.here),
            "waiting": sorted(self._waiting),
            "elsewhere": {t: h for t, h in sorted(self._seen.items()) if h != self.node_id},
            "gained": self.gained,
            "lost": self.lost_count,
        }
