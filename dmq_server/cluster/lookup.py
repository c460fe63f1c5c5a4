"""nsqlookupd's answers for a whole dmq cluster, from the ZooKeeper registry.

Which nodes carry a topic:

* a **reliable** topic (registered in the cluster registry) is served by every live
  node: producers may send to any of them, and each delivers the copies it stored,
  so a consumer must connect to all (as NSQ consumers connect to every nsqd that has
  a topic);
* a **fast** (NSQ) topic lives in one node's memory and disk queue: the nodes that
  announced it in their registration (``fast_topics``, updated within a second of a
  change) carry it.

Pure functions over the live nodes (``registry.model.NodeInfo``) and this node's own
view; ``lookupd.LookupdApi`` uses them when the server runs with ``--zk``.
"""

from __future__ import annotations

from typing import Any, Iterable

__all__ = ["peer_of", "ClusterView"]


def peer_of(node: Any, version: str) -> dict[str, Any]:
    """nsqlookupd's producer entry for a registered node."""
    return {
        "remote_address": f"{node.host}:{node.tcp_port}",
        "hostname": node.hostname or node.host,
        "broadcast_address": node.host,
        "tcp_port": node.tcp_port,
        "http_port": node.http_port,
        "version": version,
        "topology_zone": "",
        "topology_region": "",
    }


class ClusterView:
    """One lookup's picture: live nodes, reliable topics, every node's fast topics.

    ``me`` is this node's id; its own fast topics are taken from ``local_fast`` (the
    store itself, fresher than its registration) and its producer entry is
    ``local_peer``.
    """

    def __init__(
        self,
        nodes: Iterable[Any],
        me: str,
        local_peer: dict[str, Any],
        local_fast: dict[str, tuple[str, ...]],
        reliable: dict[str, tuple[str, ...]],
        version: str,
    ):
        self.me = me
        self.reliable = reliable
        self.entries: list[tuple[str, dict[str, Any], dict[str, tuple[str, ...]]]] = []
        seen_me = False
        for node in sorted(nodes, key=lambda n: n.node_id):
            if node.node_id == me:
                seen_me = True
                self.entries.append((me, local_peer, local_fast))
            else:
                self.entries.append((node.node_id, peer_of(node, version), dict(node.fast_topics)))
        if not seen_me:  # not registered this moment (starting, re-registering): still here
            self.entries.insert(0, (me, local_peer, local_fast))

    def carriers(self, topic: str) -> list[tuple[str, dict[str, Any]]]:
        """(node id, producer entry) of every node carrying ``topic``."""
        if topic in self.reliable:
            return [(node_id, peer) for node_id, peer, _ in self.entries]
        return [(node_id, peer) for node_id, peer, fast in self.entries if topic in fast]

    def carriers_all(self) -> list[tuple[str, dict[str, Any]]]:
        """(node id, producer entry) of every live node."""
        return [(node_id, peer) for node_id, peer, _ in self.entries]

    def channels(self, topic: str) -> list[str] | None:
        """The topic's channels across the cluster, or None if no node has it."""
        if topic in self.reliable:
            return sorted(self.reliable[topic])
        found: set[str] | None = None
        for _, _, fast in self.entries:
            if topic in fast:
                found = (found or set()) | set(fast[topic])
        return None if found is None else sorted(found)

    def topics(self) -> list[str]:
        names = set(self.reliable)
        for _, _, fast in self.entries:
            names.update(fast)
        return sorted(names)

    def node_topics(self, node_id: str) -> list[str]:
        for nid, _, fast in self.entries:
            if nid == node_id:
                return sorted(set(self.reliable) | set(fast))
        return []
