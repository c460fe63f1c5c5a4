"""What a SUB attaches a V2 connection to: a fast channel, or a reliable channel of the broker.

Both offer the same five operations to the connection (``pump``, ``finish``,
``requeue``, ``touch``, ``detach``) and answer errors with nsqd's texts
("ID not in flight", "client does not own message"). On a reliable channel the
wire id is the 16-hex-char form of the int64 message id, ``FIN`` is
``Broker.ack`` (made durable in a batch), and the connection is wrapped in a
``ReliableConsumer`` that offers the broker's consumer interface.
"""

from __future__ import annotations

from typing import Any, Sequence

from dmq_server.core.ids import hex_id, parse_hex_id
from dmq_server.core.nsq_wire import message_frame

__all__ = ["FastSub", "ReliableConsumer", "ReliableSub"]


class FastSub:
    """SUB on a fast channel: the connection itself is the channel's client."""

    def __init__(self, channel: Any):
        self.channel = channel

    def pump(self) -> None:
        self.channel.pump()

    def finish(self, conn: Any, message_id: bytes, pump: bool = True) -> str | None:
        return self.channel.finish(conn, message_id, pump)

    def finish_many(self, conn: Any, message_ids: list[bytes]) -> list[tuple[bytes, str]]:
        """A read's FINs, without a pump; the ids refused, each with its reason."""
        return self.channel.finish_many(conn, message_ids)

    def requeue(self, conn: Any, message_id: bytes, timeout: float) -> str | None:
        return self.channel.requeue(conn, message_id, timeout)

    def touch(self, conn: Any, message_id: bytes) -> str | None:
        return self.channel.touch(conn, message_id, conn.msg_timeout)

    def in_flight(self, conn: Any) -> int:
        return conn.in_flight_count

    def detach(self, conn: Any) -> None:
        self.channel.remove_client(conn)


class ReliableConsumer:
    """The broker's consumer interface (``credit``, ``in_flight``, ``push``) for an NSQ
    connection on a reliable channel."""

    def __init__(self, conn: Any):
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

    def push_many(self, channel: Any, deliveries: Sequence[Any]) -> None:
        """Each copy as an NSQ message frame, written when this reactor turn ends with the
        rest of the turn's (a RDY window's worth in one write, as a fast channel's)."""
        conn = self.conn
        if conn.closed:
            return
        conn.message_count += len(deliveries)
        conn.queue_writes([
            message_frame(d.message.published_ms * 1_000_000, d.attempts, hex_id(d.message.message_id), d.message.body)
            for d in deliveries
        ])

    def channel_closed(self, channel: Any) -> None:
        self.conn.channel_closed(channel)


class ReliableSub:
    """SUB on a registered channel of a reliable topic."""

    def __init__(self, broker: Any, channel: Any, consumer: ReliableConsumer):
        self.broker = broker
        self.channel = channel
        self.consumer = consumer

    def pump(self) -> None:
        self.channel.pump()

    def finish(self, conn: Any, message_id: bytes, pump: bool = True) -> str | None:
        """An ack; ``pump`` is ignored: the reliable channel pushes as acks free credit."""
        mid = parse_hex_id(message_id)
        if mid is None:
            return "ID not in flight"
        error = self.broker.ack(self.channel.topic, self.channel.name, mid, self.consumer)
        if error is not None:
            return error
        conn.finish_count += 1
        return None

    def finish_many(self, conn: Any, message_ids: list[bytes]) -> list[tuple[bytes, str]]:
        """Each FIN an ack, answered as ``finish`` answers it alone; the ids refused, each
        with its reason. The read's FINs are acknowledged in one ``Broker.ack_each``: one
        durable-ack run and one pump for the credit they free, not one each."""
        parsed = [parse_hex_id(message_id) for message_id in message_ids]
        valid = [mid for mid in parsed if mid is not None]
        errors = iter(self.broker.ack_each(self.channel.topic, self.channel.name, valid, self.consumer)
                      if valid else ())
        failed = []
        for message_id, mid in zip(message_ids, parsed):
            error = "ID not in flight" if mid is None else next(errors)
            if error is None:
                conn.finish_count += 1
            else:
                failed.append((message_id, error))
        return failed

    def requeue(self, conn: Any, message_id: bytes, timeout: float) -> str | None:
        mid = parse_hex_id(message_id)
        if mid is None:
            return "ID not in flight"
        error = self.channel.requeue(mid, self.consumer, timeout)
        if error is None:
            conn.requeue_count += 1
        return error

    def touch(self, conn: Any, message_id: bytes) -> str | None:
        mid = parse_hex_id(message_id)
        if mid is None:
            return "ID not in flight"
        return self.channel.touch(mid, self.consumer)

    def in_flight(self, conn: Any) -> int:
        return self.consumer.in_flight

    def detach(self, conn: Any) -> None:
        self.broker.unsubscribe(self.channel, self.consumer)
