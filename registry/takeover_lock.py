"""Recipe: the lock that guards who delivers a node's stored copies.

A node's stored messages belong to its incarnations (``dmq_owner`` in PostgreSQL: one
per process start), and a channel's progress over them is a cursor naming the node that
delivers them. They change hands in two ways: a live node takes over the incarnations of
a node that disappeared (or that restarted: its earlier incarnations), or the node
begins a new incarnation and registers with it. Both happen while holding
``/dmq/takeover/<node-id>`` (a kazoo Lock), and a claimer checks, holding the lock,
which of the node's incarnations the registration in ``/dmq/node/<node-id>`` names. So a
starting node either finds its new incarnation untouched, or waits until a takeover in
progress is finished; the incarnation a live registration names is never claimed.
"""

from __future__ import annotations

from typing import Iterable

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import KazooState
from kazoo.recipe.lock import Lock

from . import paths
from .model import NodeInfo

__all__ = ["TakeoverLock"]


class TakeoverLock:
    def __init__(self, client: KazooClient, node_id: str, holder: str, cluster: str = "main"):
        self.client = client
        self.node_id = node_id
        self.cluster = cluster  # whose incarnations are checked (one lock per node for all)
        self._lock = Lock(client, paths.takeover_lock(node_id), identifier=holder)

    def node_present(self) -> bool:
        return self.client.retry(self.client.exists, paths.node(self.node_id)) is not None

    def live_incarnation(self) -> int | None:
        """The incarnation the node's registration names; None while it is absent."""
        try:
            data, _ = self.client.retry(self.client.get, paths.node(self.node_id))
        except NoNodeError:
            return None
        info = NodeInfo.decode(self.node_id, data)
        return info.incarnation_on(self.cluster) if info is not None else 0

    def acquire(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the lock (registration)."""
        return bool(self._lock.acquire(blocking=True, timeout=timeout))

    def try_acquire_absent(self) -> bool:
        """Take the lock at once if free, and keep it only if the node is absent.
        False: someone else holds it, or the node is alive."""
        if not self._lock.acquire(blocking=False):
            return False
        if self.node_present():
            self.release()
            return False
        return True

    def try_acquire_for(self, incarnations: Iterable[int]) -> list[int]:
        """Take the lock at once if free; keep it if some of ``incarnations`` are not the
        one the node's registration names (the node is absent, or it started again).
        Returns those incarnations (claimable while the lock is held); [] and no lock
        when someone else holds it or every one of them is live."""
        wanted = sorted(set(incarnations))
        if not wanted or not self._lock.acquire(blocking=False):
            return []
        live = self.live_incarnation()
        claimable = [i for i in wanted if i != live]
        if not claimable:
            self.release()
        return claimable

    def still_valid(self, incarnations: Iterable[int] = ()) -> bool:
        """Still ours, and the node still absent or registered with an incarnation other
        than ``incarnations`` (all of it when none are given): safe to claim."""
        if self.client.state != KazooState.CONNECTED or not self._lock.is_acquired:
            return False
        live = self.live_incarnation()
        wanted = set(incarnations)
        return live is None if not wanted else live not in wanted

    def release(self) -> None:
        try:
            self._lock.release()
        except Exception:  # the session is gone: so is the lock
            pass
