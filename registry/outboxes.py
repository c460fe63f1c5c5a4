"""Recipe: the outboxes attached at run time, as ZooKeeper shows them to a cluster.

dmq's own database holds each attached outbox with its DSN (``dmq_outbox_attached``);
a DSN may hold a password, and ZooKeeper's znodes are often readable by anyone who
reaches it, so ``/dmq/outbox/<name>`` holds only the outbox's schema and database
(host and name). The znode is how a cluster's nodes learn at once that the table
changed (``read_names`` leaves a watch; the server reads the table again when it
fires) and how an operator sees the attached outboxes beside the relaying node
(``/dmq/outbox_relay/<name>``, a ``PlacementLock``: ``RelayLock``). The names follow ``core.outbox_rows``'
rule for an outbox name ([A-Za-z0-9_.-], never "." or ".." there: checked here).

Every function blocks (a ZooKeeper round trip), each idempotent under ``client.retry``.
"""

from __future__ import annotations

import json
from typing import Callable

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError, NodeExistsError
from kazoo.protocol.states import WatchedEvent

from . import paths
from .placement_lock import PlacementLock

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


class RelayLock(PlacementLock):
    """Which node relays the outbox ``name`` (any outbox, ``--outbox`` or attached): a
    ``PlacementLock`` at ``/dmq/outbox_relay/<name>``, so ZooKeeper shows the relaying node.
    Each relay tries it once a second; the relay's advisory lock in the application's
    database stays the fence (see ``dmq_server.protocols.outbox_relay``)."""

    def __init__(self, client: KazooClient, name: str, node_id: str):
        paths.check_znode_name("outbox", name)
        super().__init__(client, paths.outbox_relay(name), node_id)
