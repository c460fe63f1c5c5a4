"""Takeover: a live node claims the stored copies of nodes that are gone.

Every unacknowledged copy has an owner (``dmq_delivery.owner``): the node that stored
it, and the only one that loads and delivers it. When a node disappears from
``/dmq/node`` (crash, ``kill -9``, lost session, clean shutdown), its copies
(backlog and what was in flight on it) would wait forever, so a live node claims
them:

1. find owners of stored copies that are not live nodes (``delivery_owners``; this
   also finds nodes that died while no other node was running);
2. take ``/dmq/takeover/<dead>`` without waiting (someone else busy with it: skip)
   and, holding it, check that ``/dmq/node/<dead>`` is still absent;
3. move copies to this node in batches (``claim_deliveries``: ``owner = dead ->
   owner = me``, row by row exclusive), re-checking the lock and the node's absence
   before every batch;
4. make the channels that received copies scan from their first id again
   (``ReliableChannel.rescan``), since the claimed ids sit below their cursors.

Two nodes never claim the same copy (the UPDATE re-checks the owner), and a node
that returns with the same id registers under the same lock, so it starts loading
only after a takeover in progress has finished, and then finds only what it still
owns. Runs are serialised; a request while one runs makes one more run.
"""

from __future__ import annotations

from typing import Any, Callable

from twisted.internet import defer
from twisted.logger import Logger

from dmq_server.db.takeover import claim_deliveries, delivery_owners, owner_depths

__all__ = ["Takeover", "delivery_owners", "claim_deliveries", "owner_depths"]

log = Logger()


class Takeover:
    def __init__(
        self,
        zk_call: Any,
        client: Any,
        worker: Any,
        store: Any,
        node_id: str,
        batch_size: int,
        can_claim: Callable[[], bool],
    ):
        self._zk = zk_call  # ClusterNode._zk: bridge call, fails fast while disconnected
        self._client = client
        self._worker = worker
        self._store = store  # the reliable store: its channels re-read what was claimed
        self.node_id = node_id
        self.batch_size = batch_size
        self._can_claim = can_claim
        self._running: defer.Deferred | None = None
        self._again: set[str] | None = None
        self.claimed = 0
        self.claims: dict[str, int] = {}

    def check(self, live: set[str]) -> None:
        """Claim copies of owners not in ``live`` (this node counts as live)."""
        if self._running is not None:
            self._again = set(live)
            return
        self._running = self._run(set(live))

        def finished(_: Any) -> None:
            self._running = None
            again, self._again = self._again, None
            if again is not None:
                self.check(again)

        self._running.addErrback(
            lambda f: log.warn("takeover check failed: {why}", why=f.getErrorMessage())
        ).addBoth(finished)

    def idle(self) -> defer.Deferred:
        """Fires when no run is in progress (for a clean shutdown)."""
        self._again = None
        if self._running is None:
            return defer.succeed(None)
        waiter: defer.Deferred = defer.Deferred()
        self._running.addBoth(lambda result: waiter.callback(None) or result)
        return waiter

    @defer.inlineCallbacks
    def _run(self, live: set[str]) -> Any:
        if not self._can_claim():
            return
        owners = yield self._worker.run(delivery_owners)
        for dead in owners:
            if dead == self.node_id or dead in live or not self._can_claim():
                continue
            yield self._take(dead)

    @defer.inlineCallbacks
    def _take(self, dead: str) -> Any:
        from registry.takeover_lock import TakeoverLock

        lock = TakeoverLock(self._client, dead, f"takeover by {self.node_id}")
        got = yield self._zk(lock.try_acquire_absent)
        if not got:
            return 0
        total = 0
        try:
            while self._can_claim():
                valid = yield self._zk(lock.still_valid)
                if not valid or not self._can_claim():
                    break
                rows = yield self._worker.run(claim_deliveries, dead, self.node_id, self.batch_size)
                count = sum(n for _, _, n in rows)
                total += count
                self._rescan({(topic, channel) for topic, channel, _ in rows})
                if count < self.batch_size:
                    break
        finally:
            yield self._zk(lock.release)
        if total:
            self.claimed += total
            self.claims[dead] = self.claims.get(dead, 0) + total
            log.info("took over {n} stored messages of departed node {dead}", n=total, dead=dead)
        return total

    def _rescan(self, keys: set[tuple[str, str]]) -> None:
        for key in keys:
            channel = self._store.channels.get(key)
            if channel is not None:
                channel.rescan()

    def stats(self) -> dict[str, Any]:
        return {"claimed": self.claimed, "by_departed_node": dict(self.claims)}
