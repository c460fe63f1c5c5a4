"""nsqlookupd's HTTP API for this node (``nsqlookupd/http.go``): ``/lookup``, ``/topics``,
``/channels``, ``/nodes``, ``/topic/tombstone``.

A single dmq node answers for itself: ``/lookup`` lists this node as the producer of
every topic it has (the broker's listing, ``broker.topic_admin``), so a consumer
configured with this HTTP port as its lookupd finds the node. In a cluster (``--zk``)
every node answers for the whole cluster from the registry (``cluster_lookup``): a
topic every node serves (registered, waiting in PostgreSQL) lists every live node, a
topic of this node's own queues the nodes that announced it. Replies follow nsqlookupd's shapes;
``/lookup`` of an unknown topic is ``404 TOPIC_NOT_FOUND`` after one registry refresh.
"""

from __future__ import annotations

import time
from typing import Mapping, Protocol

from dmq_server.broker.interfaces import BrokerPort
from dmq_server.cluster.lookup import ClusterView
from dmq_server.core.nsq_identify import VERSION
from dmq_server.http.nsq_v1 import Answer, HttpError, get_param, params_of
from registry.model import NodeInfo
from twisted.web.server import Request

__all__ = ["LookupdApi", "Membership", "TOMBSTONE_LIFETIME"]

TOMBSTONE_LIFETIME = 45.0


class Membership(Protocol):
    """What the lookup answers read of this node's cluster (``cluster.node.ClusterNode``)."""

    @property
    def node_id(self) -> str: ...

    @property
    def registered(self) -> bool: ...

    def live_nodes(self) -> list[NodeInfo]: ...


class LookupdApi:
    """Mixed into the HTTP handlers; needs ``broker``, ``cluster``, ``peer_info()`` and
    ``tombstones`` (a topic's on this node, a (topic, node) pair's for another node)."""

    broker: BrokerPort
    cluster: Membership | None
    tombstones: dict[str | tuple[str, str], float]

    def peer_info(self) -> dict[str, object]:  # provided by the class it is mixed into
        raise NotImplementedError

    def _cluster_view(self) -> ClusterView | None:
        """The whole cluster's picture, when this node is part of one."""
        cluster = self.cluster
        if cluster is None:
            return None
        here, everywhere = self.broker.topic_admin.announced()
        return ClusterView(cluster.live_nodes(), cluster.node_id, self.peer_info(), here, everywhere, VERSION)

    def _peer_tombstoned(self, topic: str, peer: Mapping[str, object]) -> bool:
        me = self.peer_info()
        node = f"{peer['broadcast_address']}:{peer['http_port']}"
        if node == f"{me['broadcast_address']}:{me['http_port']}":
            return self._tombstoned(topic)
        until = self.tombstones.get((topic, node))
        if until is None:
            return False
        if time.time() >= until:
            del self.tombstones[(topic, node)]
            return False
        return True

    def _known_channels(self, topic: str) -> list[str] | None:
        view = self._cluster_view()
        return view.channels(topic) if view is not None else self.broker.topic_admin.channels_of(topic)

    def _tombstoned(self, topic: str) -> bool:
        until = self.tombstones.get(topic)
        if until is None:
            return False
        if time.time() >= until:
            del self.tombstones[topic]
            return False
        return True

    def lookup(self, request: Request) -> Answer:
        topic = get_param(params_of(request), "topic")
        if topic is None:
            raise HttpError(400, "MISSING_ARG_TOPIC")

        def answer(_: object = None) -> dict[str, object] | HttpError:
            view = self._cluster_view()
            if view is not None:
                channels = view.channels(topic)
                if channels is None:
                    return HttpError(404, "TOPIC_NOT_FOUND")
                producers = [p for _, p in view.carriers(topic) if not self._peer_tombstoned(topic, p)]
                return {"channels": channels, "producers": producers}
            channels = self.broker.topic_admin.channels_of(topic)
            if channels is None:
                return HttpError(404, "TOPIC_NOT_FOUND")
            producers = [] if self._tombstoned(topic) else [self.peer_info()]
            return {"channels": channels, "producers": producers}

        if self._known_channels(topic) is None:
            # maybe registered a moment ago: look again after one registry refresh
            return self.broker.refresh_registry().addBoth(answer)
        result = answer()
        if isinstance(result, HttpError):
            raise result
        return result

    def topics(self, request: Request) -> dict:
        view = self._cluster_view()
        return {"topics": view.topics() if view is not None else self.broker.topic_admin.topic_names()}

    def channels(self, request: Request) -> dict:
        topic = get_param(params_of(request), "topic")
        if topic is None:
            raise HttpError(400, "MISSING_ARG_TOPIC")
        return {"channels": self._known_channels(topic) or []}

    def nodes(self, request: Request) -> dict:
        view = self._cluster_view()
        if view is not None:
            producers = []
            for node_id, peer in view.carriers_all():
                topics = view.node_topics(node_id)
                marks = [self._peer_tombstoned(t, peer) for t in topics]
                producers.append(dict(peer, tombstones=marks, topics=topics))
            return {"producers": producers}
        topics = self.broker.topic_admin.topic_names()
        node = dict(self.peer_info(), tombstones=[self._tombstoned(t) for t in topics], topics=topics)
        return {"producers": [node]}

    def tombstone(self, request: Request) -> None:
        params = params_of(request)
        topic = get_param(params, "topic")
        if topic is None:
            raise HttpError(400, "MISSING_ARG_TOPIC")
        node = get_param(params, "node")
        if node is None:
            raise HttpError(400, "MISSING_ARG_NODE")
        me = self.peer_info()
        if node == f"{me['broadcast_address']}:{me['http_port']}":
            self.tombstones[topic] = time.time() + TOMBSTONE_LIFETIME
        else:
            view = self._cluster_view()
            peers = view.carriers_all() if view is not None else []
            if any(node == f"{p['broadcast_address']}:{p['http_port']}" for _, p in peers):
                self.tombstones[(topic, node)] = time.time() + TOMBSTONE_LIFETIME
        return None
