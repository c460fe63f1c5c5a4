"""What an NSQ connection offers a channel when it SUBs, whichever store the topic is on.

``Broker.attach`` gets both sides of the connection and returns the subscription of
the store serving the topic (``broker.interfaces.Subscription``): a fast channel pushes to
the connection itself (nsqd's client interface), a channel of a registered topic to
its ``NsqConsumer`` (the broker's consumer interface). The connection never learns
which.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from dmq_server.broker.interfaces import ChannelRef, Pushed
from dmq_server.core.ids import hex_id
from dmq_server.core.nsq_wire import message_frame

__all__ = ["NsqConsumer"]


class NsqClient(Protocol):
    """What the consumer uses of its connection (``nsq_v2.NsqConnection``, which imports
    this module): its RDY, its name, its message count and its writes."""

    message_count: int

    @property
    def ready_count(self) -> int: ...
    @property
    def client_id(self) -> str: ...
    @property
    def remote_address(self) -> str: ...
    @property
    def closed(self) -> bool: ...

    def queue_writes(self, frames: Sequence[bytes]) -> None: ...

    def channel_closed(self, channel: object) -> None: ...


class NsqConsumer:
    """The broker's consumer interface (``credit``, ``in_flight``, ``push_many``) for an
    NSQ connection."""

    def __init__(self, conn: NsqClient):
        self.conn = conn
        self.in_flight = 0

    @property
    def credit(self) -> int:
        return self.conn.ready_count

    @property
    def name(self) -> str:
        """How the message trace and the console name this consumer: NSQ's client id
        (from IDENTIFY) and its address."""
        conn = self.conn
        return f"nsq {conn.client_id}@{conn.remote_address}"

    def push_many(self, channel: ChannelRef, deliveries: Sequence[Pushed]) -> None:
        """Each copy as an NSQ message frame (its id the 16-hex-char form of the int64
        message id), written when this reactor turn ends with the rest of the turn's (a
        RDY window's worth in one write, as a fast channel's)."""
        conn = self.conn
        if conn.closed:
            return
        conn.message_count += len(deliveries)
        conn.queue_writes([
            message_frame(d.message.published_ms * 1_000_000, d.attempts, hex_id(d.message.message_id), d.message.body)
            for d in deliveries
        ])

    def channel_closed(self, channel: ChannelRef) -> None:
        self.conn.channel_closed(channel)
