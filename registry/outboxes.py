"""Recipe: the outboxes attached at run time, as ZooKeeper shows them to a cluster.

dmq's own database holds each attached outbox with its DSN (``dmq_outbox_attached``);
a DSN may hold a password, and ZooKeeper's znodes are often readable by anyone who
reaches it, so ``/dmq/outbox/<name>`` holds only the outbox's schema and database
(host and name). The znode is how a cluster's nodes learn at once that the table
changed (``read_names`` leaves a watch; the server reads the table again when it
fires) and how an operator sees the attached outboxes beside the relaying node
(``/dmq/outbox_relay/<name>``, a kazoo Lock: ``RelayLock``). The names follow ``core.outbox_rows``'
rule for an outbox name ([A-Za-z0-9_.-], never "." or ".." there: checked here).

Every function blocks (a ZooKeeper round trip), each idempotent under ``client.retry``.
"""

from __future__ import annotations

import json
from typing import Callable

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError, NodeExistsError
from kazoo.protocol.states import WatchedEvent
from kazoo.recipe.lock import Lock

from . import paths

__all__ = ["mirror_attached", "remove_attached", "read_names", "RelayLock"]


def mirror_attached(client: KazooClient, name: str, schema: str, database: str) -> None:
    """Show the outbox ``name`` as attached (created, or its data replaced)."""
    paths.check_znode_name("outbox", name)
    data = json.dumps({"schema": schema, "database": database}).encode()

    def inner() -> None:
        try:
            client.create(paths.outbox(name), data, makepath=True)
        except NodeExistsError:
            client.set(paths.outbox(name), data)

    client.retry(inner)


def remove_attached(client: KazooClient, name: str) -> None:
    """Show the outbox ``name`` as detached (gone already is not an error)."""
    paths.check_znode_name("outbox", name)

    def inner() -> None:
        try:
            client.delete(paths.outbox(name))
        except NoNodeError:
            pass

    client.retry(inner)


def read_names(client: KazooClient, watch: Callable[[WatchedEvent], None] | None = None) -> list[str]:
    """The attached outboxes' names; ``watch`` is called once at the next change of the
    list (an entry's data never changes: a name is detached before it is attached again)."""

    def inner() -> list[str]:
        client.ensure_path(paths.OUTBOXES)
        return sorted(client.get_children(paths.OUTBOXES, watch=watch))

    return client.retry(inner)


class RelayLock:
    """Which node relays the outbox ``name`` (any outbox, ``--outbox`` or attached): kazoo's
    Lock at ``/dmq/outbox_relay/<name>``, its contender's data the node id, so ZooKeeper
    shows the relaying node. Tried without waiting (``hold``, once a second by each
    relay): a node that does not hold it leaves no znode behind. Held until ``release``
    or the end of the session that took it (the znode is ephemeral); ``hold`` finds out
    that the session ended (the znode gone) and contends again. Placement, not a fence:
    the relay's advisory lock in the application's database stays the fence (see
    ``dmq_server.protocols.outbox_relay``)."""

    def __init__(self, client: KazooClient, name: str, node_id: str):
        paths.check_znode_name("outbox", name)
        self._client = client
        self._path = paths.outbox_relay(name)
        self._node_id = node_id
        self._lock: Lock | None = None

    def hold(self) -> bool:
        """True if this node holds the lock (taken now, or still held: one ``exists``)."""
        lock = self._lock
        if lock is not None:
            if lock.node is not None and self._client.exists(f"{self._path}/{lock.node}") is not None:
                return True
            self._lock = None  # its session ended, and the znode with it
        lock = self._client.Lock(self._path, self._node_id)
        if not lock.acquire(blocking=False):
            return False
        self._lock = lock
        return True

    def release(self) -> None:
        """Let the lock go (another node's next ``hold`` takes it); not held is no error."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release()

    def holder(self) -> str | None:
        """The node id of the holder, None when no node holds it."""
        contenders = self._client.Lock(self._path).contenders()
        return contenders[0] if contenders else None
