"""``MqClient``: the one object a service embeds to send and consume.

It owns the pieces and wires them together; each piece is its own module:

=================  ==========================================================
``connection``     one thread per server: connect, greet, read, heartbeats
``routing``        which server a topic is written to; failover
``producer``       send queue, send runner, resend runner, replies
``notify``         the thread that calls send callbacks
``consumer``       subscriptions, dedup, receive queue, handler threads
=================  ==========================================================

Threads, all daemons: one reader per server, the send runner, the resend
runner, the notify runner and ``handler_threads`` handler threads. Every
public method is thread-safe. Nothing here imports Twisted or psycopg, so a
service embeds the client without the server's dependencies.
"""

from __future__ import annotations

import dataclasses

import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

from .config import MqConfig
from .connection import ConnState, ServerConnection
from .confirm import CONFIRM_TIMEOUT, Consumed, confirm_deadline_ms
from .consumer import Consumer, Handler, Subscription
from .future import SendFuture
from . import otel
from .message import Message, SendResult
from .pending import SendCallback
from .producer import Producer
from .routing import ServerPool
from .send_queue import SendQueue
from .wire import SEND_REPLIES, SUBSCRIBE_REPLIES, Command, Frame

if TYPE_CHECKING:
    from .discovery import ZkDiscovery  # at run time imported only with config.zk (below)

__all__ = ["MqClient"]

log = logging.getLogger(__name__)


class MqClient:
    """A dmq client: ``send`` messages, ``subscribe`` handlers, ``close`` cleanly.

    ``clock`` (monotonic seconds) drives the resend schedule and the ages of
    the dedup window; ``wall_clock`` (epoch seconds) stamps messages and
    seeds session ids. Both are injectable, so tests move time instead of
    waiting for it. Connections (heartbeats, silence, connect timeouts) keep
    real time: they are about the real network. ``send_queue`` replaces the
    in-memory send queue (see ``dmq_client.send_queue``).

    The constructor starts the threads and waits, at most
    ``config.connect_timeout``, until each server's first connection attempt
    has succeeded or failed; it never raises because a server is down
    (sends then fail with SOCKET_ERROR after ``route_wait``, and the client
    keeps reconnecting).
    """

    def __init__(
        self,
        config: MqConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        send_queue: SendQueue | None = None,
    ):
        self.config = config if config is not None else MqConfig()
        self.clock = clock
        self.pool = ServerPool()
        self._producer = Producer(
            self.config, self.pool, clock=clock, wall_clock=wall_clock, send_queue=send_queue
        )
        self._consumer = Consumer(self.config, self.pool, clock)
        self._close_lock = threading.Lock()
        self._closed = False
        listener = _Dispatch(self._producer, self._consumer, self.pool)
        self._listener = listener
        addresses = self.config.addresses
        self.discovery: ZkDiscovery | None = None  # with config.zk
        if self.config.zk:
            from .discovery import ZkDiscovery  # imports kazoo: only when configured

            self.discovery = ZkDiscovery(
                self.config.zk,
                self._servers_changed,
                session_timeout=self.config.zk_session_timeout,
                refresh_interval=self.config.zk_refresh_interval,
            )
            addresses = self.discovery.start(self.config.connect_timeout)
        for address in addresses:
            self.pool.add(ServerConnection(address, self.config, listener))
        self._producer.start()
        self._consumer.start()
        for conn in self.pool:
            conn.start()
        deadline = time.monotonic() + self.config.connect_timeout
        for conn in self.pool:
            conn.first_attempt.wait(max(0.0, deadline - time.monotonic()))
        if self.discovery is not None:
            self.discovery.watch()

    # -- producing ----------------------------------------------------------------
    @property
    def producer_id(self) -> str:
        return self._producer.producer_id

    def send(
        self,
        message: Message,
        callback: SendCallback | None = None,
        *,
        confirm: str | None = None,
        confirm_timeout: float = CONFIRM_TIMEOUT,
        on_consumed: Callable[[Consumed], object] | None = None,
    ) -> "SendFuture[SendResult]":
        """Queue ``message``; never blocks. Returns a future of its ``SendResult``.

        ``callback`` (an object with ``on_result(result)``, or a callable) gets
        the same result first, on the notify thread. Every send gets exactly
        one result, whatever happens: see ``Status``.

        ``confirm="consumed"`` asks the server to tell when every channel of the topic
        is done with the message, within ``confirm_timeout`` seconds (up to a day): the
        future is then a ``ConfirmFuture`` whose ``consumed`` future resolves with a
        ``Consumed`` (``on_consumed`` gets it first, on the notify thread, after the
        send's own result). See ``dmq_client.confirm``.
        """
        if self.discovery is not None:
            self.discovery.use_topic(message.topic)
        confirm_ms = 0 if confirm is None else confirm_deadline_ms(confirm, confirm_timeout)
        if isinstance(message, Message) and otel.sending(self.config.tracer_provider):  # its span, in its headers
            message, span = otel.start_send(message, self.config.tracer_provider)
            future = self._producer.send(message, callback, confirm_ms=confirm_ms, on_consumed=on_consumed)
            future.add_done_callback(lambda f: otel.end_send(span, f.result()))
            return future
        return self._producer.send(message, callback, confirm_ms=confirm_ms, on_consumed=on_consumed)

    def resend(
        self,
        result: SendResult,
        callback: SendCallback | None = None,
        *,
        confirm: str | None = None,
        confirm_timeout: float = CONFIRM_TIMEOUT,
        on_consumed: Callable[[Consumed], object] | None = None,
    ) -> "SendFuture[SendResult]":
        """Send a failed message again, idempotently.

        The retry reuses the first send's session id and goes out as
        UP_PRODUCER_RESEND under the producer id it was sent with
        (``result.producer``: a message recovered from the journal keeps its
        original id), so the server stores the message at most once whether or
        not the first attempt reached it (within the server's retention
        window). This is the safe way to retry any status, OUT_OF_RETRY
        included. With the producer journal, transient failures are retried by
        the client itself and never need this.

        ``confirm="consumed"`` asks again to be told of its consumption, as ``send``'s: after
        a ``LOST`` confirmation (the server watching it went), a resend through any server
        is answered as a duplicate and watched there (docs/protocol.md §4.14).
        """
        # the same message (its properties too) under the first send's session id
        retry = dataclasses.replace(result.message, session_id=result.session_id)
        confirm_ms = 0 if confirm is None else confirm_deadline_ms(confirm, confirm_timeout)
        if otel.sending(self.config.tracer_provider):  # a span of its own; the message keeps its trace context
            retry, span = otel.start_send(retry, self.config.tracer_provider)
            future = self._producer.send(retry, callback, resend=True, producer=result.producer or None,
                                         confirm_ms=confirm_ms, on_consumed=on_consumed)
            future.add_done_callback(lambda f: otel.end_send(span, f.result()))
            return future
        return self._producer.send(retry, callback, resend=True, producer=result.producer or None,
                                   confirm_ms=confirm_ms, on_consumed=on_consumed)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every send so far has had its result delivered."""
        return self._producer.wait_idle(timeout)

    # -- consuming ----------------------------------------------------------------
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
        """Consume ``channel`` of ``topic`` with ``handler``.

        ``handler`` is an object with ``on_message(message)`` or a callable;
        it runs on a handler thread. With ``auto_ack`` the message is acked
        when the handler returns; if it raises, the message is not acked and
        comes back after the topic's message timeout. With ``auto_ack=False``
        call ``message.ack()`` yourself. ``credit`` (default
        ``config.default_credit``) caps unacknowledged messages per server.

        Waits up to ``timeout`` (default ``config.subscribe_timeout``) for the
        connected servers' answers and raises ``SubscribeError`` if one refuses
        (unknown topic, unregistered channel). The subscription is renewed
        on every reconnect.
        """
        if self.discovery is not None:
            self.discovery.use_topic(topic)
        return self._consumer.subscribe(
            topic, channel, handler, auto_ack=auto_ack, credit=credit, timeout=timeout
        )

    def _servers_changed(self, addresses: list[tuple[str, int]]) -> None:
        """Discovery's thread: connect to servers that joined, close those that left
        (their unanswered sends fail over). An empty list changes nothing: a registry
        momentarily without nodes must not cut every connection."""
        if not addresses:
            return
        wanted = {f"{host}:{port}": (host, port) for host, port in addresses}
        with self._close_lock:
            if self._closed:
                return
            for name, address in wanted.items():
                if self.pool.get(name) is None:
                    conn = ServerConnection(address, self.config, self._listener)
                    self.pool.add(conn)
                    conn.start()
            gone = [conn for conn in self.pool if conn.name not in wanted]
            for conn in gone:
                self.pool.remove(conn.name)
        for conn in gone:
            log.info("dmq server %s left the cluster; disconnecting", conn.name)
            conn.close(5.0)

    # -- state ----------------------------------------------------------------------
    def wait_connected(self, timeout: float) -> bool:
        """True once at least one server connection is ready for sends."""
        return self.pool.wait_connected(timeout)

    @property
    def closed(self) -> bool:
        return self._closed

    def stats(self) -> dict[str, Any]:
        """Queue depths and connection states, for metrics and debugging."""
        producer = self._producer
        return {
            "producer_id": producer.producer_id,
            "send_queue": len(producer.queue),
            "in_flight": len(producer.resends),
            "notify_queue": len(producer.notify),
            "outstanding": producer.outstanding,
            "retrying": producer.retrying,
            "retried": producer.retried,
            "dedup_entries": len(self._consumer.dedup),
            "duplicates_suppressed": self._consumer.dedup.suppressed,
            "servers": {c.name: c.state.value for c in self.pool},
            # what each server said it accepts beyond v1's first commands (docs/protocol.md §4.1)
            "features": {c.name: sorted(c.features) for c in self.pool},
            "subscriptions": [
                {"topic": s.topic, "channel": s.channel, "received": s.received, "suppressed": s.suppressed}
                for s in list(self._consumer.subscriptions.values())
            ],
            "discovery": self.discovery.stats() if self.discovery is not None else None,
        }

    # -- closing ----------------------------------------------------------------------
    def close(self, timeout: float | None = None) -> None:
        """Close cleanly; idempotent.

        New sends get CLIENT_CLOSED. Queued and unanswered sends get up to
        ``timeout`` (default ``config.close_timeout``) to be written and
        answered; whatever is left is reported CLIENT_CLOSED through its
        callback. Every callback has run when ``close`` returns (unless one
        blocks for longer than the timeout). Received messages not yet handed
        to a handler are left unacknowledged, so the server delivers them
        again; handlers already running may finish and ack.
        """
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        timeout = self.config.close_timeout if timeout is None else timeout
        if self.discovery is not None:
            self.discovery.close()
        self._producer.close(timeout)
        self._consumer.close(max(timeout, 1.0))
        for conn in self.pool:
            conn.close(5.0)
        self._producer.stop_notify(max(timeout, 1.0))
        self._producer.release_queue()

    def __enter__(self) -> "MqClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        servers = ", ".join(f"{c.name}={c.state.value}" for c in self.pool)
        return f"MqClient({self.producer_id}, {servers}{', closed' if self._closed else ''})"


class _Dispatch:
    """Routes what the connections report to the producer, consumer and pool."""

    def __init__(self, producer: Producer, consumer: Consumer, pool: ServerPool):
        self.producer = producer
        self.consumer = consumer
        self.pool = pool

    def connection_ready(self, conn: ServerConnection) -> None:
        self.pool.changed()
        self.consumer.connection_ready(conn)

    def frames_received(self, conn: ServerConnection, frames: list[Frame]) -> None:
        replies: list[Frame] = []
        pushes: list[Frame] = []
        subs: list[Frame] = []
        consumed: list[Frame] = []
        requeues: list[Frame] = []
        for frame in frames:
            command = frame.command
            if command in SEND_REPLIES:
                replies.append(frame)
            elif command == Command.CONSUMER_PUSH:
                pushes.append(frame)
            elif command in SUBSCRIBE_REPLIES:
                subs.append(frame)
            elif command == Command.SEND_CONSUMED_ACK:
                consumed.append(frame)
            elif command == Command.REQUEUE_ACK:
                requeues.append(frame)
            else:
                log.warning("unexpected %s from %s; ignored", command.name, conn.name)
        if replies:
            self.producer.replies(conn, replies)
        if consumed:  # after the replies: a send's SUCCESS registers what these answer
            self.producer.consumed(consumed)
        if subs:
            self.consumer.subscribe_replies(conn, subs)
        if pushes:
            self.consumer.pushes(conn, pushes)
        if requeues:
            self.consumer.requeue_replies(conn, requeues)

    def connection_lost(self, conn: ServerConnection, reason: str) -> None:
        self.pool.changed()
        self.producer.connection_lost(conn)
        self.consumer.connection_lost(conn)

    def state_changed(self, conn: ServerConnection) -> None:
        self.pool.changed()
        if conn.state is ConnState.READY:
            log.debug("dmq server %s ready", conn.name)
