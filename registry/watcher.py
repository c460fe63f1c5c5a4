"""Recipe: read the registry and be told when it changes.

``RegistryWatcher.read_topics()`` and ``read_nodes()`` read everything and leave a
one-shot watch on every znode read: ``/dmq/topic`` (children), each topic (data and
children), ``/dmq/node`` (children) and each node (data). The first change after a
read calls ``on_change("topics")`` or ``on_change("nodes")`` once; the caller then
reads again, which arms the watches again. kazoo clears its watches when the
connection drops (and calls them with a NONE event), so callers also read again
after every reconnection; a periodic full read is the safety net.

``on_change`` runs on kazoo's event thread: the server passes a function wrapped by
``dmq_server.cluster.bridge`` so that it reaches the reactor thread only.
"""

from __future__ import annotations

from typing import Any, Callable

from kazoo.client import KazooClient

from . import paths
from .model import NodeInfo, TopicSpec
from .zk import ZkRegistry

__all__ = ["RegistryWatcher"]


class RegistryWatcher:
    def __init__(self, client: KazooClient, on_change: Callable[[str], None]):
        self.client = client
        self._on_change = on_change
        self._registry = ZkRegistry(client)

    # bound methods: kazoo keeps one watcher per (path, function), so re-arming a path
    # that is still armed does not stack calls
    def _topics_changed(self, event: Any) -> None:
        self._on_change("topics")

    def _nodes_changed(self, event: Any) -> None:
        self._on_change("nodes")

    def read_topics(self) -> list[TopicSpec]:
        return self.client.retry(self._read_topics)

    def _read_topics(self) -> list[TopicSpec]:
        watch = self._topics_changed
        parent = self.client.exists(paths.TOPICS, watch=watch)
        if parent is None:
            return []  # told when the first topic appears
        found = []
        for name in sorted(self.client.get_children(paths.TOPICS, watch=watch)):
            spec = self._registry._read_topic(name, watch=watch, epoch=parent.ctime)
            if spec is not None:
                found.append(spec)
        return found

    def read_nodes(self) -> list[NodeInfo]:
        return self.client.retry(self._registry._read_nodes, self._nodes_changed)
