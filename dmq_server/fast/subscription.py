"""A SUB on a fast channel, as the broker hands it to a wire protocol.

``FastStore.subscribe`` makes the client (an NSQ connection, nsqd's client interface:
``ready_count``, ``in_flight_count``, ``msg_timeout``, its pushes) a client of the
channel and returns this; the connection then drives the channel through it with the
operations every subscription offers (``broker.interfaces.Subscription``), whichever store
the topic is on. Message ids are the fast store's 16 hex bytes.
"""

from __future__ import annotations

from dmq_server.fast.fast_channel import FastChannel
from dmq_server.fast.message import FastClient

__all__ = ["FastSubscription"]


class FastSubscription:
    """The client is the channel's own: the channel pushes to it and checks its ids."""

    def __init__(self, channel: FastChannel):
        self.channel = channel

    def pump(self) -> None:
        self.channel.pump()

    def finish(self, conn: FastClient, message_id: bytes, pump: bool = True) -> str | None:
        return self.channel.finish(conn, message_id, pump)

    def finish_many(self, conn: FastClient, message_ids: list[bytes]) -> list[tuple[bytes, str]]:
        """A read's FINs, without a pump; the ids refused, each with its reason."""
        return self.channel.finish_many(conn, message_ids)

    def requeue(self, conn: FastClient, message_id: bytes, timeout: float) -> str | None:
        return self.channel.requeue(conn, message_id, timeout)

    def touch(self, conn: FastClient, message_id: bytes) -> str | None:
        return self.channel.touch(conn, message_id, conn.msg_timeout)

    def in_flight(self, conn: FastClient) -> int:
        return conn.in_flight_count

    def detach(self, conn: FastClient) -> None:
        self.channel.remove_client(conn)
