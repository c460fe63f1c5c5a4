"""nsqd's topic and channel actions and nsqlookupd's listings, on whichever store holds
the topic: what the HTTP adapter (``http.nsqd``, ``http.lookupd``) asks, so that it
never chooses a store itself (``broker.interfaces.TopicAdminPort``).

A registered topic waiting in PostgreSQL: channel pause, unpause and empty work as on
nsqd (the broker stores the pause in PostgreSQL, on every cluster holding the topic's
copies); a topic pause applies to each of its channels; a topic empty has nothing to
drop (copies go straight to the channels); creating and deleting such topics and
channels changes the registry (``dmq topic``, ``dmq channel``), so it is refused with
``RegistryOnly``. Any other topic is the fast store's, as nsqd's: made on first use,
paused and emptied in memory and on disk, its pauses written to ``nsqd.dat``.

Every action answers with a Deferred (a registered topic's actions wait for
PostgreSQL; the fast store's have answered before it returns), failing with a
``DmqError``: ``NoTopic`` or ``NoChannel`` for what is not there.
"""

from __future__ import annotations

from typing import Any

from twisted.internet.defer import Deferred, DeferredList, fail, succeed

from dmq_server.broker.interfaces import BrokerPort
from dmq_server.core.errors import NoChannel, NoTopic, Refused
from dmq_server.fast.fast_channel import FastChannel
from dmq_server.fast.fast_store import FastStore
from dmq_server.fast.topic import FastTopic

__all__ = ["RegistryOnly", "TopicAdmin"]


class RegistryOnly(Refused):
    """What only the registry changes: creating or deleting a registered topic or channel."""

    code = "E_REGISTRY_ONLY"

    def __init__(self) -> None:
        super().__init__(
            "reliable topics and their channels are created and deleted with `dmq topic` and "
            "`dmq channel` (pause, unpause and empty work here)"
        )


class TopicAdmin:
    """Over the broker (``registered``: its registered topics by name;
    ``pause_channel``/``empty_channel``: a registered channel's, on every cluster) and
    the fast store (None: a node without one)."""

    def __init__(self, broker: BrokerPort, fast: FastStore | None):
        self.broker = broker
        self.fast = fast

    def _registered(self, topic: str) -> Any:
        return self.broker.topics.get(topic)

    def _persist_fast(self) -> None:
        if self.fast is not None:  # always: a fast topic was found first
            self.fast.persist_metadata()

    def _fast_topic(self, topic: str) -> FastTopic:
        """The fast store's topic; NoTopic when there is none (RegistryOnly for a
        registered one: it has no queue to act on here)."""
        found = self.fast.topics.get(topic) if self.fast is not None else None
        if found is None:
            raise RegistryOnly() if self._registered(topic) is not None else NoTopic("TOPIC_NOT_FOUND")
        return found

    def _fast_channel(self, topic: str, channel: str) -> FastChannel:
        found = self._fast_topic(topic).channels.get(channel)
        if found is None:
            raise NoChannel("CHANNEL_NOT_FOUND")
        return found

    # -- topics -------------------------------------------------------------------------
    def create_topic(self, topic: str) -> Deferred:
        """A fast topic, as nsqd makes one; a registered one exists already."""
        if self._registered(topic) is None and self.fast is not None:
            self.fast.get_topic(topic)
        return succeed(None)

    def delete_topic(self, topic: str) -> Deferred:
        if self._registered(topic) is not None:
            return fail(RegistryOnly())
        if self.fast is not None and topic in self.fast.topics:
            self.fast.delete_topic(topic)
        return succeed(None)

    def empty_topic(self, topic: str) -> Deferred:
        if self._registered(topic) is not None:
            return succeed(None)
        return _at_once(lambda: self._fast_topic(topic).empty())

    def pause_topic(self, topic: str, paused: bool) -> Deferred:
        spec = self._registered(topic)
        if spec is not None:
            pauses = [self.broker.pause_channel(topic, name, paused) for name in spec.channels]
            return DeferredList(pauses, fireOnOneErrback=True, consumeErrors=True).addCallback(lambda _: None)

        def pause() -> None:
            found = self._fast_topic(topic)
            found.pause() if paused else found.unpause()
            self._persist_fast()

        return _at_once(pause)

    # -- channels -----------------------------------------------------------------------
    def create_channel(self, topic: str, channel: str) -> Deferred:
        return _at_once(lambda: self._fast_topic(topic).get_channel(channel) and None)

    def delete_channel(self, topic: str, channel: str) -> Deferred:
        if self._registered(topic) is not None:
            return fail(RegistryOnly())
        found = self.fast.topics.get(topic) if self.fast is not None else None
        if found is not None and channel in found.channels:
            found.delete_channel(channel)
        return succeed(None)

    def empty_channel(self, topic: str, channel: str) -> Deferred:
        if self._registered(topic) is not None:
            return self.broker.empty_channel(topic, channel)
        return _at_once(lambda: self._fast_channel(topic, channel).empty())

    def pause_channel(self, topic: str, channel: str, paused: bool) -> Deferred:
        if self._registered(topic) is not None:
            return self.broker.pause_channel(topic, channel, paused)

        def pause() -> None:
            found = self._fast_channel(topic, channel)
            found.pause() if paused else found.unpause()
            self._persist_fast()

        return _at_once(pause)

    # -- listings -----------------------------------------------------------------------
    def channels_of(self, topic: str) -> list[str] | None:
        spec = self._registered(topic)
        if spec is not None:
            return sorted(spec.channels)
        found = self.fast.topics.get(topic) if self.fast is not None else None
        return None if found is None else sorted(found.channels)

    def topic_names(self) -> list[str]:
        names = set(self.broker.topics)
        if self.fast is not None:
            names.update(self.fast.topics)
        return sorted(names)

    def announced(self) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
        here = {} if self.fast is None else {name: tuple(sorted(t.channels)) for name, t in self.fast.topics.items()}
        everywhere = {name: tuple(spec.channels) for name, spec in self.broker.topics.items()}
        return here, everywhere

    def node_stats(self, channel: str | None, include_clients: bool) -> list[dict[str, Any]]:
        if self.fast is None:
            return []
        return [dict(t, store="fast") for t in self.fast.stats(None, channel, include_clients) or []]

    def queue_health(self) -> str | None:
        return None if self.fast is None else self.fast.health_error


def _at_once(action: Any) -> Deferred:
    """A fast store's action, answered before this returns: its DmqError a failure,
    as any other exception (a disk queue failing)."""
    try:
        action()
    except Exception as error:  # the Deferred carries it to the adapter's answer
        return fail(error)
    return succeed(None)
