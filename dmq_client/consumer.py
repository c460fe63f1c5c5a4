"""The consumer side of the client: subscriptions, the receive queue, handler threads.

DMQ's consumer (seeds/003, section 4): pushes go into a receive queue, handler
threads take them off and call the subscription's handler, and the message
is acknowledged after the handler returns (auto-ack) or when the handler
calls ``ack()``. Until then the server counts it against the subscription's
credit and redelivers it after the topic's message timeout.

A subscription is made on every connected server (each server pushes the
messages sent through it and its share of the stored backlog) and made
again whenever a connection is re-established, so a consumer needs nothing
but ``subscribe`` once. Duplicates (redeliveries after a timeout, a
reconnect or a crash) are filtered by ``DedupWindow`` before they reach the
queue.

The receive queue needs no bound of its own: the server never has more than
``credit`` unacknowledged pushes out per subscription and server, so it
holds at most the sum of those.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from concurrent.futures import CancelledError, Future
from typing import Callable, Protocol, TypeAlias

from . import otel
from .acks import AckSender
from .config import MqConfig
from .connection import ConnectionUnavailable, ServerConnection
from .dedup import Admit, DedupWindow, Key
from .message import ReceivedMessage
from .routing import ServerPool
from .wire import FEATURE_REQUEUE, Command, Frame, encode, features, valid_name

__all__ = ["Consumer", "Handler", "MessageHandler", "SubscribeError", "Subscription"]

log = logging.getLogger(__name__)

#: the reason a ``SubscribeError`` names for each refusing reply (the asyncio client's too)
REFUSALS = {
    Command.SUBSCRIBE_NO_TOPIC_ACK: "no_topic",
    Command.SUBSCRIBE_NO_CLIENT_ID_ACK: "no_channel",
    Command.SUBSCRIBE_SERVER_ERROR: "server_error",
    Command.SUBSCRIBE_INVALID_ACK: "invalid",
}


class SubscribeError(Exception):
    """A server refused a subscription. ``reason`` is one of ``no_topic``,
    ``no_channel`` (the channel, DMQ's client id, is not registered on the
    topic), ``server_error`` or ``invalid``; ``description`` is the server's."""

    def __init__(self, topic: str, channel: str, reason: str, description: str, server: str):
        super().__init__(f"subscribe {topic}/{channel} refused by {server}: {reason}: {description}")
        self.topic = topic
        self.channel = channel
        self.reason = reason
        self.description = description
        self.server = server


class MessageHandler(Protocol):
    """A handler object: ``on_message(message)`` is called for each message, on a
    handler thread."""

    def on_message(self, message: ReceivedMessage) -> object: ...


#: What ``MqClient.subscribe`` takes: an object with ``on_message(message)``, or a callable.
Handler: TypeAlias = Callable[[ReceivedMessage], object] | MessageHandler


class Subscription:
    """One ``(topic, channel)`` this client consumes, with its handler."""

    def __init__(self, topic: str, channel: str, handler: Handler, auto_ack: bool, credit: int):
        on_message = getattr(handler, "on_message", None)
        if on_message is None:
            if not callable(handler):
                raise TypeError("handler must have an on_message(message) method or be callable")
            on_message = handler
        self.topic = topic
        self.channel = channel
        self.handler = handler
        self.auto_ack = auto_ack
        self.credit = credit
        self.deliver: Callable[[ReceivedMessage], object] = on_message
        self.error: SubscribeError | None = None  # the last refusal, e.g. after a resubscribe
        self.received = 0
        self.suppressed = 0

    def __repr__(self) -> str:
        return f"Subscription({self.topic}/{self.channel}, auto_ack={self.auto_ack}, credit={self.credit})"


class Consumer:
    def __init__(self, config: MqConfig, pool: ServerPool, clock: Callable[[], float] = time.monotonic):
        """``clock`` (monotonic seconds) ages the dedup window."""
        self.config = config
        self.pool = pool
        self.clock = clock
        self.dedup = DedupWindow(config.dedup_max_entries, config.dedup_max_age)
        self.subscriptions: dict[tuple[str, str], Subscription] = {}
        self._lock = threading.Lock()
        self._waiters: dict[int, tuple[str, Future[Frame]]] = {}
        self._ids = itertools.count(1)
        self._queue: queue.SimpleQueue[tuple[Subscription, ReceivedMessage, Key] | None] = queue.SimpleQueue()
        self.acks = AckSender(pool.get, clock, max_wait=config.ack_wait)
        self._in_handler = threading.local()
        self._closing = False
        self._threads = [
            threading.Thread(target=self._handle_loop, name=f"dmq-handler-{i}", daemon=True)
            for i in range(config.handler_threads)
        ]
        self._started = False

    def start(self) -> None:
        self._started = True
        self.acks.start()
        for thread in self._threads:
            thread.start()

    # -- subscribing ------------------------------------------------------------
    def subscribe(
        self,
        topic: str,
        channel: str,
        handler: Handler,
        *,
        auto_ack: bool = True,
        credit: int | None = None,
        timeout: float | None = None,
    ) -> Subscription:
        for what, name in (("topic", topic), ("channel", channel)):
            if not isinstance(name, str) or not valid_name(name):
                raise ValueError(f"{what} name {name!r} is not valid")
        credit = self.config.default_credit if credit is None else credit
        if not isinstance(credit, int) or credit < 1:
            raise ValueError(f"credit must be a positive integer, not {credit!r}")
        if self._closing:
            raise RuntimeError("the client is closed")
        sub = Subscription(topic, channel, handler, auto_ack, credit)
        with self._lock:
            if (topic, channel) in self.subscriptions:
                raise ValueError(f"already subscribed to {topic}/{channel}")
            self.subscriptions[(topic, channel)] = sub
        waits = [(conn, self._send_subscribe(conn, sub)) for conn in self.pool if conn.connected]
        deadline = time.monotonic() + (self.config.subscribe_timeout if timeout is None else timeout)
        refusal = None
        accepted = []
        for conn, future in waits:
            if future is None:
                continue
            try:
                reply = future.result(max(0.0, deadline - time.monotonic()))
            except (TimeoutError, CancelledError):  # CancelledError: the connection dropped
                log.warning("no answer from %s to subscribe %s/%s yet", conn.name, topic, channel)
                continue
            if reply.command == Command.SUBSCRIBE_ACK:
                accepted.append(conn)
            elif refusal is None:
                refusal = SubscribeError(topic, channel, REFUSALS[reply.command], reply.status, conn.name)
        if refusal is not None:
            with self._lock:
                self.subscriptions.pop((topic, channel), None)
            for conn in accepted:  # pause it where it was accepted: the protocol has no unsubscribe
                self._write(conn, Frame(Command.UP_CREDIT, topic=topic, channel=channel, credit=0))
            raise refusal
        return sub

    def _send_subscribe(self, conn: ServerConnection, sub: Subscription) -> Future[Frame] | None:
        sid = next(self._ids)
        future: Future[Frame] = Future()
        with self._lock:
            self._waiters[sid] = (conn.name, future)
        frame = Frame(Command.UP_SUBSCRIBE, session_id=sid, topic=sub.topic, channel=sub.channel, credit=sub.credit)
        if not self._write(conn, frame):
            with self._lock:
                self._waiters.pop(sid, None)
            return None
        return future

    def connection_ready(self, conn: ServerConnection) -> None:
        """(Re)subscribe everything on a fresh connection; answers are only logged."""
        for sub in list(self.subscriptions.values()):
            self._send_subscribe(conn, sub)

    def subscribe_replies(self, conn: ServerConnection, frames: list[Frame]) -> None:
        for frame in frames:
            with self._lock:
                waiter = self._waiters.pop(frame.session_id, None)
            if waiter is not None:
                waiter[1].set_result(frame)
            sub = self.subscriptions.get((frame.topic, frame.channel))
            if frame.command == Command.SUBSCRIBE_ACK:
                log.info("subscribed to %s/%s on %s", frame.topic, frame.channel, conn.name)
                conn.features = conn.features | features(frame.status)  # before its pushes: same reader thread
                if sub is not None:
                    sub.error = None
            else:
                error = SubscribeError(frame.topic, frame.channel, REFUSALS[frame.command], frame.status, conn.name)
                log.error("%s", error)
                if sub is not None:
                    sub.error = error

    def connection_lost(self, conn: ServerConnection) -> None:
        """Pending subscribe answers from ``conn`` will never come."""
        with self._lock:
            lost = [sid for sid, (name, _) in self._waiters.items() if name == conn.name]
            waiters = [self._waiters.pop(sid) for sid in lost]
        for _, future in waiters:
            future.cancel()

    # -- receiving --------------------------------------------------------------
    def pushes(self, conn: ServerConnection, frames: list[Frame]) -> None:
        """CONSUMER_PUSH frames read by ``conn``'s reader thread."""
        if self._closing:
            return  # not acked: the server delivers them again, to us or another consumer
        now = self.clock()
        dedup = self.dedup
        reacked = False
        for frame in frames:
            sub = self.subscriptions.get((frame.topic, frame.channel))
            if sub is None:
                log.warning("push for %s/%s without a subscription; ignored", frame.topic, frame.channel)
                continue
            key = dedup.key(frame.producer, frame.session_id, frame.channel)
            verdict = dedup.admit(key, now)
            if verdict is Admit.NEW:
                message = ReceivedMessage(
                    topic=frame.topic,
                    channel=frame.channel,
                    message_id=frame.message_id,
                    session_id=frame.session_id,
                    producer=frame.producer,
                    body=frame.body,
                    timestamp_ms=frame.timestamp_ms,
                    attempts=frame.attempts,
                    server=conn.name,
                    acker=self._ack,
                    properties=ReceivedMessage.properties_of(frame.status),
                    requeuer=self._requeue,
                )
                sub.received += 1
                self._queue.put((sub, message, key))
                continue
            sub.suppressed += 1
            log.debug("duplicate push %s/%s session %d from %s (%s)",
                      frame.topic, frame.channel, frame.session_id, conn.name, verdict.value)
            if verdict is Admit.DUPLICATE_ACKED:
                self.acks.add(conn.name, frame.topic, frame.channel, frame.message_id)
                reacked = True
        if reacked:
            self.acks.flush()

    def _handle_loop(self) -> None:
        """Acks made here wait in ``acks`` while more messages are queued, and go when
        the queue runs dry, when a batch is full, or from ``acks``'s thread."""
        get, get_nowait, acks = self._queue.get, self._queue.get_nowait, self.acks
        self._in_handler.active = True
        while True:
            try:
                entry = get_nowait()
            except queue.Empty:
                acks.flush()  # nothing more to handle now: what was acknowledged goes
                entry = get()
            if entry is None:
                acks.flush()
                return
            sub, message, key = entry
            provider = self.config.tracer_provider
            traced = otel.start_process(message, provider) if otel.processing_of(message, provider) else None
            try:
                sub.deliver(message)
            except Exception as exc:
                if traced is not None:
                    otel.end_process(*traced, exc)
                    traced = None
                log.exception("handler of %s/%s raised on %r; it will be redelivered", sub.topic, sub.channel, message)
                if not message.acked:
                    self.dedup.forget(key)
            else:
                if sub.auto_ack:
                    message.ack()
            if traced is not None:
                otel.end_process(*traced)
            if acks.full():
                acks.flush()

    def _ack(self, message: ReceivedMessage) -> None:
        """Held with the batch when made on a handler thread (flushed by its loop);
        written at once from any other thread, which may never ack again."""
        self.dedup.acked(self.dedup.key(message.producer, message.session_id, message.channel))
        self.acks.add(message.server, message.topic, message.channel, message.message_id)
        if not getattr(self._in_handler, "active", False) or not self.config.ack_wait:
            self.acks.flush()

    def _requeue(self, message: ReceivedMessage, delay_ms: int) -> None:
        """Write UP_CONSUMER_REQUEUE to the server that pushed the message, after the acks
        held for it (the order the server sees is the handler's). The copy's redelivery is
        forgotten by the duplicate suppression first: it is wanted, and the server may push
        it again before its answer."""
        conn = self.pool.get(message.server)
        if conn is None or FEATURE_REQUEUE not in conn.features:
            raise RuntimeError(f"server {message.server} does not accept requeues (no {FEATURE_REQUEUE} feature)")
        self.dedup.forget(self.dedup.key(message.producer, message.session_id, message.channel))
        self.acks.flush()
        if not self._write(conn, Frame(Command.UP_CONSUMER_REQUEUE, topic=message.topic, channel=message.channel,
                                       message_id=message.message_id, credit=delay_ms)):
            log.info("requeue of %r not written: connection lost (the server delivers it again)", message)

    def requeue_replies(self, conn: ServerConnection, frames: list[Frame]) -> None:
        """REQUEUE_ACK frames: a refusal is logged (``requeue`` does not wait for them)."""
        for frame in frames:
            if frame.status:
                log.warning("requeue of %s/%s message %d refused by %s: %s", frame.topic, frame.channel,
                            frame.message_id, conn.name, frame.status)

    def _write(self, conn: ServerConnection, frame: Frame) -> bool:
        try:
            conn.write(encode(frame))
            return True
        except ConnectionUnavailable:
            return False

    # -- closing ------------------------------------------------------------------
    def close(self, timeout: float) -> None:
        """Drop what is queued (unacked: redelivered), let running handlers finish."""
        self._closing = True
        dropped = 0
        while True:
            try:
                entry = self._queue.get_nowait()
            except queue.Empty:
                break
            if entry is not None:
                dropped += 1
        if dropped:
            log.info("closing: %d received messages left unhandled (the server will redeliver them)", dropped)
        if not self._started:
            return
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        me = threading.current_thread()
        for thread in self._threads:
            if thread is not me:
                thread.join(max(0.0, deadline - time.monotonic()))
        self.acks.stop()  # what the handlers acknowledged goes before the connections close


