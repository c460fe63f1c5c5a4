"""Takeover: a live node claims the stored copies of incarnations that are gone.

Every stored message belongs to the incarnation of the server that stored it (one per
process start, ``dmq_owner``), and a channel's progress over one owner's messages is a
cursor naming the node that delivers them (its holder). When a node disappears from
``/dmq/node`` (crash, ``kill -9``, lost session, clean shutdown), or starts again as a
new incarnation, the copies of its earlier incarnations would wait forever, so a live
node claims them:

1. find nodes with incarnations still storing, or holding cursors, that are not live as
   such (``takeover_candidates``; this also finds nodes that died while no other node
   was running);
2. take ``/dmq/takeover/<node>`` without waiting (someone else busy with it: skip) and,
   holding it, check which of the node's incarnations its registration does not name;
3. claim them in one transaction (``claim_owners``): retire them (their group commits
   store nothing more: a process still running one is fenced) and become the holder of
   their cursors, and of every cursor the departed node held that no live node holds;
4. make the channels whose cursors changed hands read their copies from the first id
   again (``ReliableChannel.rescan``), since the claimed ids sit below their cursors.

Two nodes never claim the same cursor (the UPDATE re-checks its holder), and a node that
starts registers its new incarnation under the same lock, so the incarnation a live
registration names is never retired. Runs are serialised; a request while one runs
makes one more run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Generator, Iterable, Protocol

from twisted.internet import defer
from twisted.logger import Logger

from dmq_server.db.runner import StepRunner
from dmq_server.db.takeover_steps import claim_owners_steps, takeover_candidates_steps

if TYPE_CHECKING:
    from kazoo.client import KazooClient

__all__ = ["ClusterStore", "Takeover", "ZkCall"]

log = Logger()


class ClusterStore(Protocol):
    """What a cluster node asks of each of its reliable stores (``reliable.store``,
    which this layer does not import): its incarnation, begun under the node's
    takeover lock and renewed after a lost session; the incarnations a takeover
    retired; the cluster's pause; the copies held, dropped when the session is lost and
    re-read where a takeover claimed cursors; which ordered topics it delivers."""

    @property
    def incarnation(self) -> int: ...
    @property
    def paused(self) -> bool: ...
    def start(self, alone: bool) -> defer.Deferred: ...
    def renew_incarnation(self, owner: int) -> None: ...
    def retire(self, owners: Iterable[int]) -> None: ...
    def pause_delivery(self, paused: bool) -> None: ...
    def forget_held(self) -> None: ...
    def rescan(self, keys: Iterable[tuple[str, str]]) -> None: ...
    # the ordered topics' side (``cluster.orderers.OrderedStore``)
    def ordered_topics(self) -> set[str]: ...
    def order_here(self, topic: str) -> None: ...
    def order_elsewhere(self, topic: str, orderer: str | None) -> None: ...
    def msg_timeout_of(self, topic: str) -> float: ...


class ZkCall(Protocol):
    """``ClusterNode._zk``: run ``fn(*args)`` on kazoo's side of the bridge, failing at
    once while disconnected and after ``timeout`` seconds (-1: the default; None: never)."""

    def __call__(self, fn: Callable[..., object], *args: object, timeout: float | None = -1.0) -> defer.Deferred: ...


class Takeover:
    def __init__(
        self,
        zk_call: ZkCall,
        client: KazooClient,
        worker: StepRunner,
        store: ClusterStore,
        node_id: str,
        batch_size: int,
        can_claim: Callable[[], bool],
        cluster: str = "main",
    ):
        self._zk = zk_call  # ClusterNode._zk: bridge call, fails fast while disconnected
        self._client = client
        self._worker = worker
        self._store = store  # the reliable store: its channels re-read what was claimed
        self.node_id = node_id
        self.batch_size = batch_size
        self._can_claim = can_claim
        self.cluster = cluster  # the PostgreSQL cluster of ``worker`` and ``store``
        self._running: defer.Deferred | None = None
        self._again: dict[str, int] | None = None
        self.claimed = 0
        self.claims: dict[str, int] = {}

    def check(self, live: dict[str, int]) -> None:
        """Claim the copies of incarnations that no registration in ``live`` (node id ->
        the incarnation it registered) names; this node counts as live."""
        if self._running is not None:
            self._again = dict(live)
            return
        self._running = self._run(dict(live))

        def finished(_: object) -> None:
            self._running = None
            again, self._again = self._again, None
            if again is not None:
                self.check(again)

        self._running.addErrback(lambda f: log.warn("takeover check failed: {why}", why=f.getErrorMessage()))
        self._running.addBoth(finished)

    def idle(self) -> defer.Deferred:
        """Fires when no run is in progress (for a clean shutdown)."""
        self._again = None
        if self._running is None:
            return defer.succeed(None)
        waiter: defer.Deferred = defer.Deferred()

        def done(result: object) -> object:
            waiter.callback(None)
            return result

        self._running.addBoth(done)
        return waiter

    @defer.inlineCallbacks
    def _run(self, live: dict[str, int]) -> Generator[defer.Deferred, Any, None]:
        if not self._can_claim():
            return
        candidates = yield self._worker.run_steps(takeover_candidates_steps)
        for node, incarnations in sorted(candidates.items()):
            if not self._can_claim():
                break
            if node in live and set(incarnations) <= {live[node]}:
                continue  # a live node whose every incarnation storing is the one it runs
            if node == self.node_id and set(incarnations) <= {self._store.incarnation}:
                continue
            yield self._take(node, incarnations, set(live) | {self.node_id})

    @defer.inlineCallbacks
    def _take(self, dead: str, incarnations: list[int], live: set[str]) -> Generator[defer.Deferred, Any, int]:
        from registry.takeover_lock import TakeoverLock

        lock = TakeoverLock(self._client, dead, f"takeover by {self.node_id}", self.cluster)
        if incarnations:
            owners = yield self._zk(lock.try_acquire_for, incarnations)
            if not owners:
                return 0
        else:  # cursors the departed node held, and no incarnation of its own left
            got = yield self._zk(lock.try_acquire_absent)
            if not got:
                return 0
            owners = []
        total = 0
        try:
            valid = yield self._zk(lock.still_valid, owners)
            if valid and self._can_claim():
                holders = sorted(live - {dead})
                rows = yield self._worker.run_steps(claim_owners_steps, dead, owners, self.node_id, holders)
                total = sum(n for _, _, n in rows)
                self._store.retire(owners)
                self._store.rescan({(topic, channel) for topic, channel, _ in rows})
        finally:
            yield self._zk(lock.release)
        if total or owners:
            self.claimed += total
            self.claims[dead] = self.claims.get(dead, 0) + total
            log.info(
                "took over {n} cursors of departed node {dead} on cluster {cluster} (incarnations {owners} retired)",
                n=total, dead=dead, owners=owners, cluster=self.cluster,
            )
        return total

    def stats(self) -> dict[str, object]:
        return {"claimed": self.claimed, "by_departed_node": dict(self.claims)}
