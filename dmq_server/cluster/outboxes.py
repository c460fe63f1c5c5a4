"""The outbox relays' side of this node's ZooKeeper session (``--zk``).

``protocols.outbox_relay`` asks two things of ZooKeeper, stated there as protocols: a
gate per outbox (``registry.outboxes.RelayLock``: only the node holding the outbox's
ZooKeeper lock tries the application database's advisory lock, which stays the fence;
the relay's docstring says why both), and a call whenever ``/dmq/outbox`` changes (an
outbox attached or detached: the relays read dmq's table at once instead of at their next
``--registry-refresh``). kazoo's blocking calls run on the node's bridge (``ClusterNode._zk``:
failing at once while disconnected); its watch reaches the reactor through ``bridge.relay``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from twisted.internet.defer import Deferred
from twisted.logger import Logger

from registry.outboxes import RelayLock, read_names

if TYPE_CHECKING:
    from dmq_server.cluster.node import ClusterNode

__all__ = ["ClusterOutboxes", "OutboxGate"]

log = Logger()


class OutboxGate:
    """One outbox's ``RelayLock``, asked from the reactor."""

    def __init__(self, node: ClusterNode, lock: RelayLock):
        self._node = node
        self._lock = lock

    def hold(self) -> Deferred[bool]:
        return self._node._zk(self._lock.hold)

    def release(self) -> Deferred[None]:
        return self._node._zk(self._lock.release)


class ClusterOutboxes:
    """What ``OutboxRelays`` asks of the cluster node (``protocols.outbox_relay.ZkOutboxes``)."""

    def __init__(self, node: ClusterNode):
        self._node = node
        self._changed: Callable[[], None] | None = None
        # one function for every read: kazoo keeps one watcher per (path, function), so a
        # read while the watch is still armed does not stack calls
        self._fired = node.bridge.relay(self._on_change)

    def gate(self, name: str) -> OutboxGate:
        return OutboxGate(self._node, RelayLock(self._node.client, name, self._node.node_id))

    def watch(self, changed: Callable[[], None]) -> None:
        """``changed()`` on the reactor at each change of ``/dmq/outbox`` from now on (a
        read that fails is left to the relays' periodic read of dmq's table)."""
        self._changed = changed
        self._arm()

    def _arm(self) -> None:
        if self._node.stopping:
            return
        self._node._zk(read_names, self._node.client, self._fired).addErrback(
            lambda f: log.warn("cannot watch ZooKeeper's attached outboxes: {why}", why=f.getErrorMessage()))

    def _on_change(self, *event: object) -> None:
        if self._changed is not None and not self._node.stopping:
            self._changed()
            self._arm()
