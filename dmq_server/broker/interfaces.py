"""What the adapters may ask of the broker: the one seam between them and the stores.

The protocol, HTTP and admin adapters (``dmq_server.protocols``, ``dmq_server.http``,
``dmq_server.admin``) hold the broker as a ``BrokerPort`` and the subscriptions it
hands out as ``Subscription``s. Nothing here says which store serves a topic or on
which PostgreSQL cluster: the broker decides that for each call, so an adapter written
against these interfaces cannot branch on it. ``tests/unit/test_layers.py`` checks that
no adapter module imports or names a store, or reaches past the broker into its stores.

These are ``typing.Protocol``s: the broker satisfies them by shape, and the tests'
stand-ins do too.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol, Sequence

from twisted.internet.defer import Deferred

from dmq_server.broker.snapshot import BrokerSnapshot
from dmq_server.core.options import Options
from dmq_server.core.publish import PublishRequest
from dmq_server.fast.message import FastClient
from dmq_server.reliable.channel import Receiver, ReliableChannel
from dmq_server.reliable.confirm import ConfirmListener
from dmq_server.reliable.nsq_subscription import Counts
from dmq_server.reliable.store import Outcome

if TYPE_CHECKING:  # the placement imports nothing of this module; named for the type checker
    from dmq_server.broker.placement import ChannelGroup
from registry.model import TopicSpec

__all__ = ["BrokerPort", "ChannelRef", "Pushed", "PushedMessage", "Store", "Subscription", "TopicAdminPort"]


class Store(Protocol):
    """What the broker asks of each of its stores, whichever kind it is (a
    ``ReliableStore`` per PostgreSQL cluster, the ``FastStore``): the topics it holds,
    and a subscription to one of a topic's channels for a consumer. The rest differs by
    kind (the reliable store's group commit and durable acks, the fast store's bodies
    taken at once) and the broker holds each store by its own class for that; none of
    it reaches an adapter. ``broker.broker`` checks that both stores satisfy this."""

    @property
    def topics(self) -> Mapping[str, object]:
        """The topics the store holds now, by name."""

    def subscribe(self, topic: str, channel: str, consumer: Receiver, /) -> object:
        """Attach ``consumer`` to the channel; what it gets back is the store's own."""


class NsqConn(FastClient, Counts, Protocol):
    """The NSQ connection a subscription serves: nsqd's client interface to a fast
    channel (``fast.message.FastClient``), its counts to a reliable one
    (``reliable.nsq_subscription.Counts``)."""


class Subscription(Protocol):
    """A SUB of a wire protocol that may meet either store (NSQ's): what the connection
    does with the channel it is attached to. The store serving the topic made it
    (``Broker.attach``); message ids are the wire's (NSQ's 16 bytes), errors nsqd's
    texts ("ID not in flight", "client does not own message")."""

    def pump(self) -> None:
        """Push what the client's credit allows now."""

    def finish(self, conn: NsqConn, message_id: bytes, pump: bool = True) -> str | None:
        """FIN: None, or why not."""

    def finish_many(self, conn: NsqConn, message_ids: list[bytes]) -> list[tuple[bytes, str]]:
        """A read's FINs, without a pump; the ids refused, each with its reason."""

    def requeue(self, conn: NsqConn, message_id: bytes, timeout: float) -> str | None:
        """REQ: None, or why not."""

    def touch(self, conn: NsqConn, message_id: bytes) -> str | None:
        """TOUCH: None, or why not."""

    def in_flight(self, conn: NsqConn) -> int:
        """How many of the channel's messages the client holds."""

    def detach(self, conn: NsqConn) -> None:
        """The client leaves the channel (its held messages go back)."""


class PushedMessage(Protocol):
    """A message as a consumer's connection writes it (``reliable.channel.ReliableMessage``)."""

    @property
    def message_id(self) -> int: ...
    @property
    def session_id(self) -> int: ...
    @property
    def producer(self) -> str: ...
    @property
    def topic(self) -> str: ...
    @property
    def published_ms(self) -> int: ...
    @property
    def body(self) -> bytes: ...
    @property
    def status(self) -> str: ...  # its properties' wire text, "" for none


class Pushed(Protocol):
    """One copy a channel pushes to a consumer (``reliable.channel.Delivery``)."""

    @property
    def message(self) -> PushedMessage: ...
    @property
    def attempts(self) -> int: ...


class ChannelRef(Protocol):
    """The channel a consumer is attached to, as the consumer names it."""

    @property
    def topic(self) -> str: ...
    @property
    def name(self) -> str: ...


class TopicAdminPort(Protocol):
    """nsqd's topic and channel actions and nsqlookupd's listings, on whichever store
    holds the topic (``broker.topic_admin``). Each action's Deferred fails with a
    ``DmqError``: ``NoTopic``/``NoChannel`` for what is not there, ``RegistryOnly`` for
    what only the registry changes (creating or deleting a registered topic)."""

    def create_topic(self, topic: str) -> Deferred: ...
    def delete_topic(self, topic: str) -> Deferred: ...
    def empty_topic(self, topic: str) -> Deferred: ...
    def pause_topic(self, topic: str, paused: bool) -> Deferred: ...
    def create_channel(self, topic: str, channel: str) -> Deferred: ...
    def delete_channel(self, topic: str, channel: str) -> Deferred: ...
    def empty_channel(self, topic: str, channel: str) -> Deferred: ...
    def pause_channel(self, topic: str, channel: str, paused: bool) -> Deferred: ...

    def channels_of(self, topic: str) -> list[str] | None:
        """This node's channels of ``topic``, sorted; None if it has no such topic."""

    def topic_names(self) -> list[str]:
        """Every topic this node serves, sorted."""

    def announced(self) -> tuple[dict[str, tuple[str, ...]], dict[str, tuple[str, ...]]]:
        """(the topics this node alone serves, the topics every node serves), each
        with its channels: what a cluster's lookup answers (``cluster.lookup``)."""

    def node_stats(self, channel: str | None, include_clients: bool) -> list[dict[str, Any]]:
        """nsqd's TopicStats of the topics held on this node's queues (each with its
        ``store``); the registry's topics are ``BrokerPort.topics``."""

    def queue_health(self) -> str | None:
        """Why this node's queues fail (nsqd's health text), or None."""


class BrokerPort(Protocol):
    """What an adapter may ask of the broker (``broker.broker.Broker``)."""

    options: Options
    healthy: bool
    health_detail: str
    health_listeners: list[Callable[[bool], None]]

    @property
    def acks_refused(self) -> int: ...

    def count_refused_acks(self, n: int) -> None: ...

    @property
    def topic_admin(self) -> TopicAdminPort:
        """nsqd's topic and channel actions (read-only: the broker's own)."""

    @property
    def topics(self) -> Mapping[str, TopicSpec]:
        """The registered topics that wait in PostgreSQL, by name."""

    @property
    def channels(self) -> Mapping[tuple[str, str], ReliableChannel | ChannelGroup]:
        """Their channels in memory, by (topic, channel)."""

    # publishing: core.publish
    def publish(self, request: PublishRequest, done: Callable[[Outcome], None]) -> None: ...
    def publish_each(self, request: PublishRequest, answer: Callable[[int, list], None]) -> None: ...

    # subscribing and acknowledging
    def subscribe(self, topic: str, channel: str, consumer: Receiver) -> Deferred: ...
    def attach(self, topic: str, channel: str, client: FastClient, consumer: Receiver) -> Deferred: ...
    def unsubscribe(self, channel: Any, consumer: Receiver) -> None: ...
    def ack(self, topic: str, channel: str, message_id: int, consumer: Receiver) -> str | None: ...
    def ack_many(self, topic: str, channel: str, message_ids: Sequence[int], consumer: Receiver) -> int: ...
    def requeue(self, topic: str, channel: str, message_id: int, consumer: Receiver, delay: float) -> str | None: ...
    def may_push(self) -> bool: ...
    def confirm_consumed(self, topic: str, message_id: int, session_id: int, producer: str, deadline_ms: int,
                         listener: ConfirmListener) -> str: ...

    # operators
    def cluster_of_id(self, any_id: int) -> str | None: ...
    def pause_channel(self, topic: str, name: str, paused: bool = True) -> Deferred: ...
    def empty_channel(self, topic: str, name: str) -> Deferred: ...
    def read_channel_state(self) -> Deferred: ...
    def refresh_registry(self, fresh: bool = False) -> Deferred: ...
    def stats(self) -> dict[str, Any]: ...
    def retained(self, topic: str) -> dict[str, int | None]:
        """What a reliable topic keeps in PostgreSQL: ``retained_messages``,
        ``retained_bytes``, ``retained_as_of`` (``db.retained.retained_stats``)."""
        ...
    def snapshot(self) -> BrokerSnapshot:
        """What /metrics, /stats and the consoles show of the stores, copied now."""
