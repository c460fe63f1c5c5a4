"""Confirmation when consumed: a send's second result, once every channel is done with it.

``MqClient.send(message, confirm="consumed", confirm_timeout=30)`` returns a
``ConfirmFuture``: its own result is the send's ``SendResult`` as always, and its
``consumed`` future resolves later with a ``Consumed``: every channel of the topic
acknowledged the message (``CONSUMED``), some dead-lettered it (``DEAD_LETTERED``,
``dead`` names them), or ``confirm_timeout`` passed first (``DEADLINE``, ``waiting``
names the channels not done). The server that stored the message watches it and says
so with ``SEND_CONSUMED_ACK`` (docs/protocol.md §4.14); a server that does not list
``CONFIRM`` in its features is not asked: the send is refused instead of being
sent without the confirmation the caller counts on.

What the server watches lives with the connection: when it is lost (the server
restarted, the network failed) the confirmation is reported ``LOST``; the message is
stored and delivered all the same, only its consumption is no longer reported. A
confirmation the server never answers (a server that ignored the request after a
failover to it) is reported ``LOST`` too, ``GRACE`` seconds after its deadline, so the
table below holds each entry for a bounded time.

Only sends that ask pay for any of this: they are ``ConfirmingSend``s with their own
slots; every other send is a ``PendingSend`` whose ``confirm_ms`` is the class's 0.
"""

from __future__ import annotations

import enum
import threading
from dataclasses import dataclass
from typing import Callable, Generic, Protocol, TypeVar

from .future import SendFuture
from .message import Message, SendResult
from .pending import PendingSend, SendCallback
from .wire import CONFIRM_MAX_MS, ConsumedReport
from .wire.confirm import CONSUMED, DEAD_LETTERED, DEADLINE

__all__ = ["CONFIRM_TIMEOUT", "confirm_deadline_ms", "ConfirmFuture", "ConfirmingSend", "Consumed", "ConsumedNote", "ConsumeStatus", "GRACE", "Keyed", "Watching"]

#: Seconds after its deadline that a confirmation the server has not answered is given up.
GRACE = 10.0
#: ``MqClient.send``'s default ``confirm_timeout``, seconds.
CONFIRM_TIMEOUT = 60.0


def confirm_deadline_ms(confirm: str, timeout: float) -> int:
    """The frame's ``credit`` for ``send(confirm=..., confirm_timeout=...)``; a caller's
    mistake raises ``ValueError`` at once (nothing is sent)."""
    if confirm != "consumed":
        raise ValueError(f'confirm must be "consumed" or None, not {confirm!r}')
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= CONFIRM_MAX_MS / 1000:
        raise ValueError(f"confirm_timeout must be seconds in (0, {CONFIRM_MAX_MS // 1000}], not {timeout!r}")
    return max(1, round(timeout * 1000))


class ConsumeStatus(str, enum.Enum):
    """What became of a message whose consumption was to be confirmed."""

    CONSUMED = "consumed"
    """Every channel of the topic acknowledged it."""
    DEAD_LETTERED = "dead_lettered"
    """Every channel is done with it, and the ones in ``dead`` dead-lettered it."""
    DEADLINE = "deadline"
    """``confirm_timeout`` passed with the channels in ``waiting`` not done."""
    NOT_SENT = "not_sent"
    """The send itself did not succeed (its ``SendResult`` says why): nothing to confirm."""
    UNSUPPORTED = "unsupported"
    """The server cannot confirm this message (a delayed message, a fast topic)."""
    REFUSED = "refused"
    """The server refused to watch it (``E_INVALID``, ``E_LIMIT``: ``description``)."""
    LOST = "lost"
    """The connection to the server watching it was lost first, or the server never
    answered: it is stored and delivered, but whether it was consumed is not known."""
    CLIENT_CLOSED = "client_closed"
    """The client closed before the outcome came."""


_CODES = {CONSUMED: ConsumeStatus.CONSUMED, DEAD_LETTERED: ConsumeStatus.DEAD_LETTERED,
          DEADLINE: ConsumeStatus.DEADLINE, "E_UNSUPPORTED": ConsumeStatus.UNSUPPORTED}


@dataclass(frozen=True, slots=True)
class Consumed:
    """The consumption outcome of one send (``ConfirmFuture.consumed``)."""

    status: ConsumeStatus
    topic: str
    session_id: int
    message_id: int | None = None
    acked: tuple[str, ...] = ()
    dead: tuple[str, ...] = ()
    waiting: tuple[str, ...] = ()
    description: str = ""

    @property
    def ok(self) -> bool:
        return self.status is ConsumeStatus.CONSUMED

    @classmethod
    def from_report(cls, report: ConsumedReport, topic: str, session_id: int, message_id: int) -> "Consumed":
        status = _CODES.get(report.code, ConsumeStatus.REFUSED)
        description = report.description if status is not ConsumeStatus.REFUSED else f"{report.code} {report.description}"
        return cls(status, topic, session_id, message_id, report.acked, report.dead, report.waiting, description)


class ConfirmFuture(SendFuture[SendResult]):
    """A send's future (its ``SendResult``) with the second one, ``consumed``."""

    __slots__ = ("consumed",)

    def __init__(self) -> None:
        super().__init__()
        self.consumed: SendFuture[Consumed] = SendFuture()


class ConfirmingSend(PendingSend):
    """A send that asked for confirmation: its deadline (ms, the frame's ``credit``), its
    second future and callback."""

    __slots__ = ("confirm_ms", "on_consumed", "consumed")

    def __init__(self, message: Message, session_id: int, producer: str, timestamp_ms: int,
                 callback: SendCallback | None,
                 *, resend: bool, confirm_ms: int, on_consumed: Callable[[Consumed], object] | None) -> None:
        future = ConfirmFuture()
        super().__init__(message, session_id, producer, timestamp_ms, callback, future, resend)
        self.confirm_ms = confirm_ms
        self.on_consumed = on_consumed
        self.consumed = future.consumed

    def outcome(self, status: ConsumeStatus, description: str = "") -> "ConsumedNote":
        """A note of an outcome the client decided (not the server's answer)."""
        result = self.result
        message_id = result.message_id if result is not None else None
        return ConsumedNote(self, Consumed(status, self.message.topic, self.session_id, message_id,
                                           description=description))


class ConsumedNote:
    """A ``Consumed`` on its way through the notify runner (after the send's own result)."""

    __slots__ = ("callback", "result", "future")

    def __init__(self, item: ConfirmingSend, result: Consumed):
        self.callback = item.on_consumed
        self.result = result
        self.future = item.consumed


class Keyed(Protocol):
    """What ``Watching`` holds: a send known by ``(producer, session_id)``."""

    @property
    def key(self) -> tuple[str, int]: ...


W = TypeVar("W", bound=Keyed)


class Watching(Generic[W]):
    """The sends answered SUCCESS whose ``SEND_CONSUMED_ACK`` is awaited, by
    ``(producer, session_id)``, with the server that watches them and when to give up.
    ``MqClient`` keeps its ``ConfirmingSend``s here, the asyncio client its own watches
    (``dmq_client.aio.confirms``): the table and its bounds are the same."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._items: dict[tuple[str, int], list[tuple[W, str, float]]] = {}

    def __len__(self) -> int:
        return len(self._items)

    def add(self, item: W, server: str, give_up_at: float) -> None:
        with self._lock:
            self._items.setdefault(item.key, []).append((item, server, give_up_at))

    def pop(self, key: tuple[str, int]) -> list[W]:
        with self._lock:
            return [item for item, _, _ in self._items.pop(key, ())]

    def _take(self, keep: Callable[[str, float], bool]) -> list[W]:
        taken: list[W] = []
        with self._lock:
            for key in list(self._items):
                entries = self._items[key]
                kept = [e for e in entries if keep(e[1], e[2])]
                taken += [e[0] for e in entries if not keep(e[1], e[2])]
                if kept:
                    self._items[key] = kept
                else:
                    del self._items[key]
        return taken

    def on_server(self, server: str) -> list[W]:
        """Remove and return those ``server`` watches (its connection was lost)."""
        return self._take(lambda name, _: name != server)

    def expired(self, now: float) -> list[W]:
        """Remove and return those not answered by ``GRACE`` after their deadline."""
        return self._take(lambda _, give_up_at: give_up_at > now)

    def drain(self) -> list[W]:
        return self._take(lambda _, __: False)
