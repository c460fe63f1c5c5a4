"""One registry interface, two implementations.

``PgRegistry`` (``registry.pg``) keeps topics and channels in PostgreSQL tables: the
single-node default, where the node list is just this node. ``ZkRegistry``
(``registry.zk``) keeps them in ZooKeeper under the layout of ``registry.paths``,
with live nodes as ephemeral znodes: what a cluster uses.

Every method blocks (a database or ZooKeeper round trip): the CLI calls them
directly, the server only from a thread (``dmq_server.cluster.bridge``). Refusals (unknown
name, duplicate, invalid name) raise ``RegistryError`` with an operator-readable
message.
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

from dmq_client.wire import valid_name

from .model import STORES, NodeInfo, RegistryError

__all__ = ["Registry", "check_name", "check_settings", "ORDERED_FAST", "RETENTION_FAST", "MIN_RETENTION_MS"]


def check_name(kind: str, name: str) -> None:
    if not valid_name(name):
        raise RegistryError(
            f"invalid {kind} name {name!r}: use 1-64 characters from [.a-zA-Z0-9_-], "
            "optionally ending in #ephemeral"
        )


def check_settings(store: str, msg_timeout_ms: int, ordered: bool = False, retention_ms: int | None = None) -> None:
    if store not in STORES:
        raise RegistryError(f"invalid store {store!r}: use reliable or fast")
    if msg_timeout_ms <= 0:
        raise RegistryError("message timeout must be positive")
    if ordered and store != "reliable":
        raise RegistryError(ORDERED_FAST)
    if retention_ms is not None:
        if store != "reliable":
            raise RegistryError(RETENTION_FAST)
        if retention_ms < MIN_RETENTION_MS:
            raise RegistryError(f"retention must be at least {MIN_RETENTION_MS // 1000}s, not {retention_ms}ms")


#: why a fast topic keeps no retention (nsqd's: a message goes once every channel has it)
RETENTION_FAST = "only a reliable topic keeps its messages for a retention: a fast topic keeps none, as nsqd"
#: the shortest retention a topic may have (the sweep runs every --sweep-interval)
MIN_RETENTION_MS = 1000

#: why a fast topic cannot be ordered (its channels deliver as nsqd's do, keys unknown)
ORDERED_FAST = "only a reliable topic can be ordered: a fast topic delivers as nsqd does, without keys"


class Registry(abc.ABC):
    """Topics, their channels (subscriptions) and the live nodes."""

    @abc.abstractmethod
    def topics(self) -> Sequence[Any]:
        """Every topic, name order, each with ``name``, ``store``, ``msg_timeout_ms``,
        ``rate_limit``, ``ttl_ms``, ``max_attempts``, ``ordered`` and ``channels`` (sorted)."""

    def get_topic(self, name: str) -> Any:
        for row in self.topics():
            if row.name == name:
                return row
        raise RegistryError(f"no such topic {name!r}")

    @abc.abstractmethod
    def create_topic(
        self,
        name: str,
        *,
        store: str = "reliable",
        msg_timeout_ms: int = 60000,
        rate_limit: int | None = None,
        ttl_ms: int | None = None,
        max_attempts: int | None = None,
        ordered: bool = False,
        retention_ms: int | None = None,
    ) -> None:
        """Register a topic; RegistryError if it exists. ``ordered``: each channel has at
        most one copy of a message key in flight at a time. ``retention_ms``: how long a
        message every channel is done with is kept (None: the server's)."""

    @abc.abstractmethod
    def delete_topic(self, name: str) -> None:
        """Remove a topic and its channels; RegistryError if there is none."""

    @abc.abstractmethod
    def add_channel(self, topic: str, name: str) -> None:
        """Register a channel on an existing topic; RegistryError if it exists."""

    @abc.abstractmethod
    def remove_channel(self, topic: str, name: str) -> None:
        """Unregister a channel; RegistryError if there is none."""

    @abc.abstractmethod
    def nodes(self) -> list[NodeInfo]:
        """The live nodes (node id order)."""

    def close(self) -> None:
        """Release the connection, if the registry owns one."""
