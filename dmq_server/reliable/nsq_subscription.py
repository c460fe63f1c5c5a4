"""An NSQ SUB on a registered channel of a reliable topic, as the broker hands it over.

The connection drives it with the operations every subscription offers
(``broker.interfaces.Subscription``), whichever store the topic is on. Here the wire id is
the 16-hex-char form of the int64 message id, ``FIN`` is an ack made durable in a batch,
and the consumer is what the channel pushes to (the connection's side of the broker's
consumer interface: ``credit``, ``in_flight``, ``push_many``). Acks go through the
broker (``Acks``), which knows the cluster that drew each id.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from dmq_server.core.ids import parse_hex_id
from dmq_server.reliable.channel import Receiver

__all__ = ["Acks", "ReliableSubscription", "SubscribedChannel", "Counts"]


class SubscribedChannel(Protocol):
    """The channel a subscription is attached to: a ``ReliableChannel``, or the broker's
    ``ChannelGroup`` of one channel over several clusters."""

    topic: str
    name: str

    def pump(self) -> None: ...
    def requeue(self, message_id: int, consumer: Receiver, delay: float = 0.0) -> str | None: ...
    def touch(self, message_id: int, consumer: Receiver) -> str | None: ...


class Counts(Protocol):
    """The connection's counters of what its client finished and gave back (nsqd's)."""

    finish_count: int
    requeue_count: int


class Acks(Protocol):
    """What a reliable subscription asks of the broker."""

    def ack(self, topic: str, channel: str, message_id: int, consumer: Receiver) -> str | None: ...
    def ack_each(self, topic: str, channel: str, message_ids: Sequence[int], consumer: Receiver) -> list[str | None]: ...
    def unsubscribe(self, channel: SubscribedChannel, consumer: Receiver) -> None: ...


class ReliableSubscription:
    """``consumer`` attached to ``channel`` (a reliable channel, or the broker's group of
    one over several clusters)."""

    def __init__(self, acks: Acks, channel: SubscribedChannel, consumer: Receiver):
        self.acks = acks
        self.channel = channel
        self.consumer = consumer

    def pump(self) -> None:
        self.channel.pump()

    def finish(self, conn: Counts, message_id: bytes, pump: bool = True) -> str | None:
        """An ack; ``pump`` is ignored: the reliable channel pushes as acks free credit."""
        mid = parse_hex_id(message_id)
        if mid is None:
            return "ID not in flight"
        error = self.acks.ack(self.channel.topic, self.channel.name, mid, self.consumer)
        if error is not None:
            return error
        conn.finish_count += 1
        return None

    def finish_many(self, conn: Counts, message_ids: list[bytes]) -> list[tuple[bytes, str]]:
        """Each FIN an ack, answered as ``finish`` answers it alone; the ids refused, each
        with its reason. The read's FINs are acknowledged in one ``Broker.ack_each``: one
        durable-ack run and one pump for the credit they free, not one each."""
        parsed = [parse_hex_id(message_id) for message_id in message_ids]
        valid = [mid for mid in parsed if mid is not None]
        errors = iter(self.acks.ack_each(self.channel.topic, self.channel.name, valid, self.consumer)
                      if valid else ())
        failed = []
        for message_id, mid in zip(message_ids, parsed):
            error = "ID not in flight" if mid is None else next(errors)
            if error is None:
                conn.finish_count += 1
            else:
                failed.append((message_id, error))
        return failed

    def requeue(self, conn: Counts, message_id: bytes, timeout: float) -> str | None:
        mid = parse_hex_id(message_id)
        if mid is None:
            return "ID not in flight"
        error = self.channel.requeue(mid, self.consumer, timeout)
        if error is None:
            conn.requeue_count += 1
        return error

    def touch(self, conn: Counts, message_id: bytes) -> str | None:
        mid = parse_hex_id(message_id)
        if mid is None:
            return "ID not in flight"
        return self.channel.touch(mid, self.consumer)

    def in_flight(self, conn: Counts) -> int:
        return self.consumer.in_flight

    def detach(self, conn: Counts) -> None:
        self.acks.unsubscribe(self.channel, self.consumer)
