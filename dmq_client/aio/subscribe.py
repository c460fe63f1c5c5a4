"""The consumer side of the asyncio client: subscriptions as async iterators, and the
message a consumer awaits ``ack()`` or ``requeue(delay=…)`` on.

A subscription subscribes on every connected server (and again on each reconnect) with
its ``credit``: each server pushes at most that many messages the consumer has not acked
or requeued, so the subscription's queue holds at most ``credit`` messages per server,
whatever the consumer's pace (the bound is the server's, by protocol, not a client
buffer that could drop). Duplicate pushes (a redelivery of a copy already handed out and
still unacked, or acked) are suppressed by ``(producer, session id, channel)`` as in
``MqClient`` (``dmq_client.dedup``).

Acks are batched as ``MqClient``'s (``dmq_client.acks``): ``await message.ack()`` holds the
id, and what was held in one turn of the event loop (or ``acks.MAX_IDS`` of them) goes to
each server as one ``UP_CONSUMER_ACKS`` frame per channel (an ``UP_CONSUMER_ACK`` per id to a
server that does not list ``ACKS``), in one write, at the end of that turn: a consumer
acking the messages it was handed together (``async for`` hands out what is queued without
waiting) makes one frame of them, not one each. A requeue first writes the acks held for its
server, so the server reads acks and requeues in the order they were made. An ack held for a
connection that closed before the turn ended is dropped, as an ack written to it would have
been: the server delivers that copy again, and the duplicate suppression acks it.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
from collections import deque
from typing import TYPE_CHECKING, ContextManager, Final, NoReturn, Protocol

from .. import otel
from ..acks import MAX_IDS, ack_frames
from ..consumer import REFUSALS, SubscribeError
from ..dedup import Admit, DedupWindow
from ..message import ReceivedMessage
from ..wire import FEATURE_ACKS, FEATURE_REQUEUE, REQUEUE_MAX_MS, SUBSCRIBE_REPLIES, Command, Frame, FrameError, encode
from ..wire.properties import NO_PROPERTIES, Properties

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from ..config import MqConfig
    from .link import ServerLink

__all__ = ["AioMessage", "RequeueError", "Subscription"]

log = logging.getLogger(__name__)


class _End(enum.Enum):
    """The queue's end marker: an enum member, so that ``item is _END`` tells the type
    checker the item is not a message or an error."""

    END = enum.auto()


_END: Final = _End.END
_correlation = itertools.count(1)


class RequeueError(Exception):
    """``requeue`` did not happen; ``code`` is the server's (``E_REQUEUE_FAILED``,
    ``E_INVALID``, docs/protocol.md §4.16) or the client's (``E_UNSUPPORTED``: the server
    does not list ``REQUEUE``; ``E_CONNECTION_LOST``: the connection the message came on is
    gone, so the server has already given the copy back to be delivered again now)."""

    def __init__(self, status: str):
        code, _, description = status.partition(" ")
        super().__init__(status)
        self.code = code
        self.description = description


class AioMessage(ReceivedMessage):
    """A pushed message, as ``async for`` hands it out: ``ReceivedMessage``'s fields, and
    ``await ack()`` / ``await requeue(delay=…)``. Until one of them, it counts against the
    subscription's credit, and the server delivers it again after the topic's message
    timeout."""

    __slots__ = ("_link", "_generation", "_subscription", "_settled")

    def __init__(self, subscription: "Subscription", link: "ServerLink", frame: Frame, properties: Properties):
        super().__init__(
            topic=frame.topic, channel=frame.channel, message_id=frame.message_id, session_id=frame.session_id,
            producer=frame.producer, body=frame.body, timestamp_ms=frame.timestamp_ms, attempts=frame.attempts,
            server=link.name, acker=_no_acker, properties=properties,
        )
        self._link = link
        self._generation = link.generation
        self._subscription = subscription
        self._settled = False

    async def ack(self) -> None:  # type: ignore[override]  # awaited here; MqClient's is a call
        """Acknowledge to the server that pushed it: written at the end of this turn of the
        event loop with the other acks made in it (see the module's docstring); it waits
        only while the server is not reading. Idempotent; a no-op once the connection it
        came on is gone: the server delivers the copy again, and the duplicate
        suppression of this client acks that copy by itself."""
        if self._settled:
            return
        self._settled = self._acked = True
        self._subscription.acked(self)
        if self._generation == self._link.generation:
            self._subscription.hold_ack(self._link, self._generation, self.message_id)
            await self._link.drain()

    def processing(self) -> ContextManager[Span | None]:
        """With the otel extra, the message's process span, current inside the ``with``
        block (the trace its producer's send began, continued; an error when the block
        raises): ``with message.processing(): ...``. Without it, an empty block."""
        return otel.processing(self, self._subscription.client.config.tracer_provider)

    async def requeue(self, delay: float = 0.0) -> None:  # type: ignore[override]  # awaited here
        """Give the message back, to be delivered again (to any consumer of the channel)
        ``delay`` seconds from now; returns once the server confirmed it, else raises
        ``RequeueError`` (the message then stays with this consumer: ack or requeue it
        again). ``ValueError`` for a delay below 0 or beyond what the frame holds; the
        server's bound is its ``--max-req-timeout`` (an hour by default)."""
        delay_ms = round(delay * 1000)
        if not 0 <= delay_ms <= REQUEUE_MAX_MS:
            raise ValueError(f"delay must be 0..{REQUEUE_MAX_MS / 1000} seconds, not {delay!r}")
        if self._settled:
            raise RequeueError("E_REQUEUE_FAILED the message was already acknowledged or requeued")
        link = self._link
        if self._generation != link.generation or not link.connected:
            raise RequeueError("E_CONNECTION_LOST the connection the message came on is gone; "
                               "the server delivers it again")
        if FEATURE_REQUEUE not in link.features:
            raise RequeueError(f"E_UNSUPPORTED server {link.name} does not list {FEATURE_REQUEUE}")
        self._subscription.flush_acks(link.name)  # the acks made before it go before it
        answer = self._subscription.await_requeue(link, self.message_id)
        # forgotten before the write: the server may push the copy again (a delay of 0)
        # before its REQUEUE_ACK, and that push must not be taken for a duplicate
        self._subscription.requeued(self)
        link.write(encode(Frame(Command.UP_CONSUMER_REQUEUE, topic=self.topic, channel=self.channel,
                                message_id=self.message_id, credit=delay_ms)))
        status = await answer
        if status:
            self._subscription.kept(self)
            raise RequeueError(status)
        self._settled = True


def _no_acker(message: ReceivedMessage) -> NoReturn:
    raise TypeError("await the asyncio message's ack()")


class _Owner(Protocol):
    """What a subscription needs of its client (``aio.Client``, which imports this
    module): its settings, and to forget the subscription when it closes."""

    config: MqConfig

    def _unsubscribe(self, sub: Subscription) -> None: ...


class Subscription:
    """``async for message in client.subscribe(topic, channel, credit=N)``. The iteration
    ends when the client closes or ``close()`` is called; a server's refusal
    (``SubscribeError``) is raised from it."""

    def __init__(self, client: _Owner, topic: str, channel: str, credit: int, dedup: DedupWindow):
        self.client = client
        self.topic = topic
        self.channel = channel
        self.credit = credit
        self.dedup = dedup
        self.queue: asyncio.Queue[AioMessage | SubscribeError | _End] = asyncio.Queue()
        self.closed = False
        self._subscribed: dict[str, int] = {}  # per link: the connection (generation) subscribed on
        # per link: requeues written, oldest first, awaiting REQUEUE_ACK (the server answers in order)
        self._requeues: dict[str, deque[tuple[int, asyncio.Future[str]]]] = {}
        # per link: the acks held until the end of this loop turn, with the connection they are for
        self._held: dict[str, tuple[ServerLink, int, list[int]]] = {}
        self._flushing: asyncio.Handle | None = None
        self.ack_frames_written = 0  # UP_CONSUMER_ACK(S) frames written, in all

    def __aiter__(self) -> "Subscription":
        return self

    async def __anext__(self) -> AioMessage:
        if self.closed and self.queue.empty():
            raise StopAsyncIteration
        item = await self.queue.get()
        if item is _END:
            self.queue.put_nowait(_END)  # every later __anext__ ends too
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            raise item
        return item

    async def close(self) -> None:
        """Stop this subscription's iteration. Messages not acked are delivered again by the
        servers after their timeout (or at once, when the connection closes)."""
        self.client._unsubscribe(self)
        self.end()

    def end(self) -> None:
        self.flush_acks()
        if not self.closed:
            self.closed = True
            self.queue.put_nowait(_END)
        for waiting in self._requeues.values():
            for _, future in waiting:
                if not future.done():
                    future.set_result("E_CONNECTION_LOST the subscription was closed")
        self._requeues.clear()

    # -- the link's side --------------------------------------------------------------
    def subscribe_on(self, link: "ServerLink") -> None:
        """Subscribe on the link's connection, once per connection (a server greeting again
        with SERVER_HEALTH after a storage failure keeps its subscriptions)."""
        if self._subscribed.get(link.name) == link.generation:
            return
        self._subscribed[link.name] = link.generation
        link.write(encode(Frame(Command.UP_SUBSCRIBE, topic=self.topic, channel=self.channel, credit=self.credit,
                                session_id=next(_correlation))))

    def answered(self, link: "ServerLink", frame: Frame) -> None:
        if frame.command == Command.SUBSCRIBE_ACK:
            return
        reason = REFUSALS.get(frame.command, "invalid")
        self.queue.put_nowait(SubscribeError(self.topic, self.channel, reason, frame.status, link.name))

    def pushed(self, link: "ServerLink", frame: Frame) -> None:
        properties = ReceivedMessage.properties_of(frame.status) if frame.status else NO_PROPERTIES
        message = AioMessage(self, link, frame, properties)
        admit = self.dedup.admit(self._key(message), time.monotonic())
        if admit is Admit.NEW:
            self.queue.put_nowait(message)
        elif admit is Admit.DUPLICATE_ACKED:  # the first copy was acked: ack this one too
            self.hold_ack(link, link.generation, frame.message_id)

    def requeue_answered(self, link: "ServerLink", frame: Frame) -> None:
        waiting = self._requeues.get(link.name)
        while waiting:
            message_id, future = waiting.popleft()
            if message_id == frame.message_id:
                if not future.done():
                    future.set_result(frame.status)
                return

    def link_lost(self, link: "ServerLink") -> None:
        self._held.pop(link.name, None)  # the server gives those copies back
        for _, future in self._requeues.pop(link.name, ()):
            if not future.done():
                future.set_result("E_CONNECTION_LOST the connection closed before the server answered the requeue")

    # -- acks ---------------------------------------------------------------------------
    def hold_ack(self, link: "ServerLink", generation: int, message_id: int) -> None:
        """Hold an ack for the connection ``generation`` of ``link``, to be written at the
        end of this loop turn (at once when ``MAX_IDS`` are held for it)."""
        held = self._held.get(link.name)
        if held is None or held[1] != generation:  # those of an older connection are void
            held = self._held[link.name] = (link, generation, [])
        held[2].append(message_id)
        if len(held[2]) >= MAX_IDS:
            self.flush_acks(link.name)
        elif self._flushing is None:
            self._flushing = asyncio.get_running_loop().call_soon(self.flush_acks)

    def flush_acks(self, name: str | None = None) -> None:
        """Write the acks held for the link ``name`` (for every link when None), one write
        per link; those for a connection since lost are dropped."""
        if name is None:
            if self._flushing is not None:
                self._flushing.cancel()
                self._flushing = None
            names = list(self._held)
        else:
            names = [name]
        for each in names:
            held = self._held.pop(each, None)
            if held is None:
                continue
            link, generation, ids = held
            if generation != link.generation:
                continue
            try:
                frames = ack_frames(self.topic, self.channel, ids, FEATURE_ACKS in link.features)
            except FrameError as exc:  # not from a decoded push; never raised into the loop
                log.error("acks for %s/%s on %s not sent: %s", self.topic, self.channel, link.name, exc)
                continue
            if link.write(b"".join(frames)):
                self.ack_frames_written += len(frames)

    # -- the message's side -------------------------------------------------------------
    def _key(self, message: ReceivedMessage) -> tuple[str, int, str]:
        return self.dedup.key(message.producer, message.session_id, message.channel)

    def acked(self, message: AioMessage) -> None:
        self.dedup.acked(self._key(message))

    def requeued(self, message: AioMessage) -> None:
        self.dedup.forget(self._key(message))  # its redelivery is wanted: let it through

    def kept(self, message: AioMessage) -> None:
        """A refused requeue: the consumer still holds the message; remember it again."""
        self.dedup.admit(self._key(message), time.monotonic())

    def await_requeue(self, link: "ServerLink", message_id: int) -> "asyncio.Future[str]":
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._requeues.setdefault(link.name, deque()).append((message_id, future))
        return future
