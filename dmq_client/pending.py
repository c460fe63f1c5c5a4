"""``PendingSend``: the client's record of one accepted send, from ``send()`` to its result.

One object travels the whole way (send queue, resend map, notify queue), like
DMQ's ``WinData``: it holds the message, the session id, where and when it was
last written, how many writes it has had, and the callback and future that
receive its single ``SendResult``.
"""

from __future__ import annotations

import threading
from typing import Callable, Protocol, TypeAlias

from .future import SendFuture
from .message import Message, SendResult

__all__ = ["PendingSend", "ResultHandler", "SendCallback"]


class ResultHandler(Protocol):
    """A send callback object: ``on_result(result)`` gets the send's ``SendResult``."""

    def on_result(self, result: SendResult) -> object: ...


#: What ``MqClient.send(message, callback)`` calls with the send's result (on the notify
#: thread): an object with ``on_result(result)``, or a callable.
SendCallback: TypeAlias = Callable[[SendResult], object] | ResultHandler


class PendingSend:
    # a send that asked to hear when it is consumed is a ``confirm.ConfirmingSend``, whose
    # slot holds its deadline (ms); every other send reads this 0 and carries nothing more
    confirm_ms = 0

    __slots__ = (
        "message",
        "session_id",
        "producer",
        "timestamp_ms",
        "callback",
        "future",
        "attempts",
        "resends",
        "last_attempt",
        "server",
        "result",
        "resend",
        "key",
        "followers",
        "failures",
        "failing_since",
        "given_up",
        "_settled",
    )

    def __init__(
        self,
        message: Message,
        session_id: int,
        producer: str,
        timestamp_ms: int,
        callback: SendCallback | None = None,
        future: "SendFuture[SendResult] | None" = None,
        resend: bool = False,
    ):
        self.message = message
        self.session_id = session_id
        self.producer = producer
        # what identifies the message to the server: a send with a stored key is a resend
        self.key = (producer, session_id)
        self.timestamp_ms = timestamp_ms
        self.callback = callback
        self.future: SendFuture[SendResult] = future if future is not None else SendFuture()
        self.attempts = 0  # writes made: first send, resends and failover writes
        self.resends = 0  # resends by the resend runner: the budget is resend_tries
        self.last_attempt = 0.0  # clock() of the last write (or failed try)
        self.server: str | None = None  # where it was last written
        self.result: SendResult | None = None
        self.resend = resend  # a caller's retry of an earlier send: written as UP_PRODUCER_RESEND
        # resends of this very (producer, session id) that arrived while it was in flight:
        # they share its answer (see Producer._send_batch)
        self.followers: list[PendingSend] | None = None
        self.failures = 0  # journal retries so far (transient failures of a journaled send)
        self.failing_since = 0.0  # clock() of its first transient failure
        self.given_up = False  # the producer stopped retrying it: the journal may forget it
        self._settled = False

    def settle(self) -> bool:
        """True exactly once: the caller that gets True delivers the result.

        Several paths can end a send (a reply, the resend runner giving up,
        close); this makes "exactly one callback" a property of the object, not
        of careful ordering between threads.
        """
        with _settle_lock:
            if self._settled:
                return False
            self._settled = True
            return True

    def __repr__(self) -> str:
        return (
            f"PendingSend(topic={self.message.topic!r}, session_id={self.session_id}, "
            f"attempts={self.attempts}, server={self.server!r})"
        )


# One lock for all sends: settling holds it for two instructions, and a lock
# per send would cost ~100 bytes and an allocation on the hot path.
_settle_lock = threading.Lock()
