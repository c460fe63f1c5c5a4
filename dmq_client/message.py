"""What a producer sends, what it hears back, and what a consumer receives.

``Message`` is the caller's value; ``SendResult`` is the single answer every
send gets (through its callback and its future), with a ``Status`` for each
outcome DMQ's Java client distinguishes. ``ReceivedMessage`` is a push handed
to a handler, with ``ack()`` for consumers that acknowledge by hand.

Keeping one result type with a status (rather than an exception per outcome)
is DMQ's shape: callbacks run on the notify thread, where raising would help
nobody, and a web handler can branch on ``result.status`` in one place.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Callable

from .wire import MessageType
from .wire.properties import NO_PROPERTIES, Properties, PropertiesError, decode_properties, encode_properties

__all__ = [
    "FINAL",
    "TRANSIENT",
    "Message",
    "MessageType",
    "ReceivedMessage",
    "SendError",
    "SendResult",
    "Status",
]


class Status(str, enum.Enum):
    """The outcome of one send. Exactly one reaches the callback of every send.

    ``SOCKET_ERROR`` and ``OUT_OF_RETRY`` differ in what the caller may assume:
    a SOCKET_ERROR message was never written to any server, so it is certainly
    not stored and may be sent again as a new message; an OUT_OF_RETRY message
    was written at least once without a reply, so it may or may not be stored
    (resending it with the same session id is safe: the server deduplicates).
    """

    SUCCESS = "success"
    """Stored durably by the server; ``message_id`` is set."""
    NO_TOPIC = "no_topic"
    """The topic is not registered or has no channel (SEND_NO_TOPIC_ACK)."""
    SERVER_ERROR = "server_error"
    """The server failed to store it, e.g. PostgreSQL down (SEND_SERVER_ERROR)."""
    RATE_LIMIT_EXCEEDED = "rate_limit_exceeded"
    """The topic's rate limit refused it (SEND_EXCEED_LIMIT_ACK)."""
    SOCKET_ERROR = "socket_error"
    """No server connection could take it within ``route_wait``; never written."""
    OUT_OF_RETRY = "out_of_retry"
    """Written, but no reply after ``resend_tries`` resends; outcome unknown."""
    INVALID_MESSAGE = "invalid_message"
    """Refused by the client's checks or the server's (SEND_INVALID_ACK)."""
    QUEUE_FULL = "queue_full"
    """The bounded send queue had no room; refused at once, never written."""
    CLIENT_CLOSED = "client_closed"
    """The client was closing or closed before the message got an answer."""
    CANCELLED = "cancelled"
    """The asyncio client's caller cancelled the send before it was written; never written,
    so certainly not stored (``dmq_client.aio``: reported to ``on_cancelled``)."""

    @property
    def ok(self) -> bool:
        return self is Status.SUCCESS


#: Results that settle a message's fate: stored, or refused for something the same message
#: would be refused for again (the application's to handle). A producer journal forgets a
#: message once one of these has been delivered.
FINAL = frozenset({Status.SUCCESS, Status.NO_TOPIC, Status.INVALID_MESSAGE})
#: Results that say nothing about the message itself: no server reachable, the server could
#: not store it now, a rate limit, no answer. With the producer journal such a send is tried
#: again (as a resend, under the same producer and session id) instead of being reported.
TRANSIENT = frozenset({Status.SOCKET_ERROR, Status.SERVER_ERROR, Status.RATE_LIMIT_EXCEEDED, Status.OUT_OF_RETRY})


class SendError(Exception):
    """Raised by ``SendResult.raise_for_status`` for any status but SUCCESS."""

    def __init__(self, result: "SendResult"):
        super().__init__(f"{result.status.value}: {result.description}" if result.description else result.status.value)
        self.result = result
        self.status = result.status


@dataclass(slots=True, eq=False)
class Message:
    """A message to send. ``body`` is bytes (a ``str`` is encoded as UTF-8).

    ``session_id`` identifies the message for this producer; leave it ``None``
    to have the client generate one (monotonic, see ``dmq_client.session``), or
    set your own (for example a database key) to make a send idempotent across
    producer restarts: the server answers a resend of a stored
    ``(producer, session_id)`` with the original message id.

    A DELAY message carries ``due_ms`` (epoch milliseconds); build one with
    ``Message.delayed``.

    ``key``, ``priority`` and ``headers`` are the message's properties
    (``dmq_client.wire.properties`` has their rules: a key of at most 255 bytes,
    priority 0-9, at most 32 headers of lowercase names); a message with any of them is
    sent only to a server that lists the feature ``PROPS``.
    """

    topic: str
    body: bytes = field(repr=False)
    session_id: int | None = None
    msg_type: MessageType = MessageType.RELIABLE
    due_ms: int = 0
    key: str | None = None
    priority: int = 0
    headers: dict[str, str] | None = None

    def __post_init__(self) -> None:
        if isinstance(self.body, str):
            self.body = self.body.encode("utf-8")
        elif isinstance(self.body, (bytearray, memoryview)):
            self.body = bytes(self.body)

    @property
    def properties(self) -> Properties:
        """The key, priority and headers as one value (``NO_PROPERTIES`` for none)."""
        if self.key is None and not self.priority and not self.headers:
            return NO_PROPERTIES
        return Properties(self.key, self.priority, self.headers or {})

    def status(self) -> str:
        """The properties as a send's status carries them ('' for none); raises
        ``PropertiesError`` for properties that break a rule."""
        if self.key is None and not self.priority and not self.headers:
            return ""
        return encode_properties(self.properties)

    @classmethod
    def delayed(
        cls,
        topic: str,
        body: bytes | str,
        *,
        delay: float | None = None,
        due: datetime | float | None = None,
        session_id: int | None = None,
        wall_clock: Callable[[], float] = time.time,
        key: str | None = None,
        priority: int = 0,
        headers: dict[str, str] | None = None,
    ) -> "Message":
        """A DELAY message due ``delay`` seconds from now, or at ``due`` (an aware
        ``datetime`` or epoch seconds). Exactly one of the two must be given."""
        if (delay is None) == (due is None):
            raise ValueError("give exactly one of delay= or due=")
        if delay is not None:
            due_s = wall_clock() + delay
        elif isinstance(due, datetime):
            due_s = due.timestamp()
        else:
            assert due is not None  # exactly one of the two, checked above
            due_s = float(due)
        data = body.encode("utf-8") if isinstance(body, str) else body
        return cls(topic, data, session_id=session_id, msg_type=MessageType.DELAY, due_ms=int(due_s * 1000),
                   key=key, priority=priority, headers=headers)


@dataclass(slots=True, eq=False)
class SendResult:
    """The one answer to one send.

    ``description`` explains any status but SUCCESS (the server's own text when
    the server answered). ``duplicate`` is true when the server recognised a
    resend of a message it had already stored (same ``message_id``).
    ``attempts`` counts the writes made (first send plus resends).
    ``producer`` is the producer id the message was sent under (a message
    recovered from a producer journal keeps the id it was first sent with);
    ``client.resend(result)`` resends under it.
    """

    status: Status
    message: Message
    session_id: int | None = None
    message_id: int | None = None
    description: str = ""
    server: str | None = None
    duplicate: bool = False
    attempts: int = 0
    producer: str = ""

    @property
    def ok(self) -> bool:
        return self.status is Status.SUCCESS

    def raise_for_status(self) -> "SendResult":
        """Return self if SUCCESS, else raise ``SendError``."""
        if self.status is not Status.SUCCESS:
            raise SendError(self)
        return self


class ReceivedMessage:
    """A pushed message, handed to a handler's ``on_message``.

    ``ack()`` acknowledges it to the server that pushed it. With
    ``auto_ack=True`` (the default) the client acks after ``on_message``
    returns, and calling ``ack()`` yourself is harmless. With auto-ack off the
    handler (or any thread, later) must call ``ack()``; until then the message
    counts against the subscription's credit, and the server delivers it again
    after the topic's message timeout.
    """

    __slots__ = (
        "topic",
        "channel",
        "message_id",
        "session_id",
        "producer",
        "body",
        "timestamp_ms",
        "attempts",
        "server",
        "key",
        "priority",
        "headers",
        "_acker",
        "_acked",
        "_requeuer",
    )

    def __init__(
        self,
        *,
        topic: str,
        channel: str,
        message_id: int,
        session_id: int,
        producer: str,
        body: bytes,
        timestamp_ms: int,
        attempts: int,
        server: str,
        acker: Callable[["ReceivedMessage"], object],
        properties: Properties = NO_PROPERTIES,
        requeuer: Callable[["ReceivedMessage", int], object] | None = None,
    ):
        self.topic = topic
        self.channel = channel
        self.message_id = message_id
        self.session_id = session_id
        self.producer = producer
        self.body = body
        self.timestamp_ms = timestamp_ms
        self.attempts = attempts
        self.server = server
        self.key = properties.key
        self.priority = properties.priority
        self.headers = dict(properties.headers)
        self._acker = acker
        self._acked = False
        self._requeuer = requeuer

    @property
    def acked(self) -> bool:
        return self._acked

    def ack(self) -> None:
        """Acknowledge this message (idempotent; thread-safe; a no-op after close)."""
        if not self._acked:
            self._acked = True
            self._acker(self)

    def requeue(self, delay: float = 0.0) -> None:
        """Give the message back to its channel, to be delivered again (``attempts`` + 1, to
        any consumer) ``delay`` seconds from now (docs/protocol.md §4.16), instead of
        acknowledging it; ``acked`` is then true, so auto-ack leaves it alone. The frame is
        written and not waited for: a server's refusal (the copy timed out meanwhile, a delay
        above its ``--max-req-timeout``) is logged, and the copy then comes back after its
        timeout as any unacknowledged one (the asyncio client's ``requeue`` waits for the
        answer and raises). ``ValueError`` for a negative delay or one past the frame's
        field; ``RuntimeError`` where the server does not list ``REQUEUE``."""
        delay_ms = round(delay * 1000)
        if not 0 <= delay_ms <= 0xFFFFFFFF:
            raise ValueError(f"delay must be 0..{0xFFFFFFFF / 1000} seconds, not {delay!r}")
        if self._requeuer is None:
            raise RuntimeError("this message cannot be requeued")
        if not self._acked:
            self._requeuer(self, delay_ms)
            self._acked = True

    def text(self, encoding: str = "utf-8") -> str:
        return self.body.decode(encoding)

    @staticmethod
    def properties_of(status: str) -> Properties:
        """The properties a push's status carries, read leniently (fields a newer server
        adds are skipped); a status that is not valid properties reads as none, so one
        odd push never stops a consumer."""
        if not status:
            return NO_PROPERTIES
        try:
            return decode_properties(status, strict=False)
        except PropertiesError:
            return NO_PROPERTIES

    def __repr__(self) -> str:
        return (
            f"ReceivedMessage(topic={self.topic!r}, channel={self.channel!r}, "
            f"message_id={self.message_id}, session_id={self.session_id}, "
            f"producer={self.producer!r}, attempts={self.attempts}, len={len(self.body)})"
        )
