"""nsqlookupd's HTTP API for this node (``nsqlookupd/http.go``): ``/lookup``, ``/topics``,
``/channels``, ``/nodes``, ``/topic/tombstone``.

A single dmq node answers for itself: ``/lookup`` lists this node as the producer of
every topic it has (fast or reliable), so a consumer configured with this HTTP port as
its lookupd finds the node. Replies follow nsqlookupd's shapes; ``/lookup`` of an
unknown topic is ``404 TOPIC_NOT_FOUND`` after one registry refresh.
"""

from __future__ import annotations

import time
from typing import Any

from .http_v1 import HttpError, get_param, params_of

__all__ = ["LookupdApi", "TOMBSTONE_LIFETIME"]

TOMBSTONE_LIFETIME = 45.0


class LookupdApi:
    """Mixed into the HTTP handlers; needs ``store``, ``broker``, ``peer_info()`` and
    ``tombstones``."""

    store: Any
    broker: Any
    tombstones: dict[str, float]

    def peer_info(self) -> dict[str, Any]:  # provided by the class it is mixed into
        raise NotImplementedError

    def _channels_of(self, topic: str) -> list[str] | None:
        """This node's channels of ``topic``, or None if it has no such topic."""
        if self._reliable(topic):
            return sorted(self.broker.topics[topic].channels)
        t = self.store.topics.get(topic)
        return None if t is None else sorted(t.channels)

    def _all_topics(self) -> list[str]:
        names = set(self.store.topics)
        if self.broker is not None:
            names.update(self.broker.topics)
        return sorted(names)

    def _tombstoned(self, topic: str) -> bool:
        until = self.tombstones.get(topic)
        if until is None:
            return False
        if time.time() >= until:
            del self.tombstones[topic]
            return False
        return True

    def lookup(self, request: Any) -> Any:
        topic = get_param(params_of(request), "topic")
        if topic is None:
            raise HttpError(400, "MISSING_ARG_TOPIC")

        def answer(_: Any = None) -> Any:
            channels = self._channels_of(topic)
            if channels is None:
                return HttpError(404, "TOPIC_NOT_FOUND")
            producers = [] if self._tombstoned(topic) else [self.peer_info()]
            return {"channels": channels, "producers": producers}

        if self._channels_of(topic) is None and self.broker is not None:
            # maybe registered a moment ago: look again after one registry refresh
            return self.broker.refresh_registry().addBoth(answer)
        result = answer()
        if isinstance(result, HttpError):
            raise result
        return result

    def topics(self, request: Any) -> dict:
        return {"topics": self._all_topics()}

    def channels(self, request: Any) -> dict:
        topic = get_param(params_of(request), "topic")
        if topic is None:
            raise HttpError(400, "MISSING_ARG_TOPIC")
        return {"channels": self._channels_of(topic) or []}

    def nodes(self, request: Any) -> dict:
        topics = self._all_topics()
        node = dict(self.peer_info(), tombstones=[self._tombstoned(t) for t in topics], topics=topics)
        return {"producers": [node]}

    def tombstone(self, request: Any) -> None:
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
        return None
