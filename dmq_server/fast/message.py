"""A message of the fast store, as nsqd's ``Message`` (``nsqd/message.go``).

The same fields make the wire message (``wire.message_frame``, built by the NSQ
connection) and the disk-queue record (``wire.encode_message``): 8-byte timestamp,
2-byte attempts, 16-byte hex id, body. While in flight or deferred it also carries its owner, its deadline
(``pri``, seconds on the store's clock) and its index in the priority queue. The owner is a
``FastClient``, nsqd's client interface, stated here beside the message it holds (the
channel, the store and the subscription import this module, not one another for it).
"""

from __future__ import annotations

from typing import Protocol, Sequence

from dmq_server.core.nsq_wire import decode_message, encode_message

__all__ = ["FastClient", "FastMessage"]


class FastClient(Protocol):
    """A subscriber of a fast channel (an NSQ connection), nsqd's client interface: its
    RDY window, the messages it holds and has had (the channel counts them), its
    settings, and the push of a run of messages."""

    in_flight_count: int
    message_count: int
    finish_count: int
    requeue_count: int

    @property
    def ready_count(self) -> int: ...
    @property
    def sample_rate(self) -> int: ...
    @property
    def msg_timeout(self) -> float: ...

    def send_messages(self, channel: object, msgs: Sequence[FastMessage]) -> None: ...

    def stats(self) -> dict[str, object]: ...


class FastMessage:
    __slots__ = ("id", "body", "timestamp", "attempts", "deferred", "client", "delivery_ts")

    def __init__(
        self, id: bytes, body: bytes, timestamp: int, attempts: int = 0, deferred: float = 0.0
    ):
        self.id = id
        self.body = body
        self.timestamp = timestamp  # UnixNano at publish, shared by every channel's copy
        self.attempts = attempts
        self.deferred = deferred  # DPUB delay in seconds, applied when a channel gets it
        self.client: FastClient | None = None  # the consumer holding it in flight
        self.delivery_ts = 0.0

    def copy(self) -> "FastMessage":
        """A channel's copy: same id, body, timestamp and deferral; attempts start at 0."""
        return FastMessage(self.id, self.body, self.timestamp, 0, self.deferred)

    def encode(self) -> bytes:
        return encode_message(self.timestamp, self.attempts, self.id, self.body)

    @classmethod
    def decode(cls, data: bytes) -> "FastMessage":
        timestamp, attempts, message_id, body = decode_message(data)
        return cls(message_id, body, timestamp, attempts)

    def __repr__(self) -> str:
        return f"<FastMessage {self.id.decode('latin-1')} attempts={self.attempts} {len(self.body)}B>"
