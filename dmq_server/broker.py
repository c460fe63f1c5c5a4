"""The broker core: topics, channels, publishing and subscribing, protocol-agnostic.

Wire adapters call ``publish``/``subscribe``/``ack``; the broker validates,
hands sends to the group-commit writer, fans committed messages out to their
channels and keeps the registry cache fresh. It does not know which protocol a
consumer speaks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

from twisted.internet.defer import Deferred, fail, succeed
from twisted.internet.task import LoopingCall
from twisted.logger import Logger
from twisted.python.failure import Failure

from dmq_client.wire import valid_name

from .channel import Channel, Delivery, Message
from .options import Options
from .store import (
    AckRow,
    DbWorker,
    NewMessage,
    StorageError,
    StoredMessage,
    TopicRow,
    list_topics,
    load_backlog,
    sweep_messages,
)
from .writer import AckBatcher, GroupCommitWriter

__all__ = ["Broker", "PublishRejected", "SubscribeRejected"]

log = Logger()


class PublishRejected(Exception):
    """A send the broker refuses before storing; ``reason`` names the reply."""

    def __init__(self, reason: str, description: str):
        super().__init__(description)
        self.reason = reason  # "invalid" | "no_topic"
        self.description = description


class SubscribeRejected(Exception):
    def __init__(self, reason: str, description: str):
        super().__init__(description)
        self.reason = reason  # "invalid" | "no_topic" | "no_channel" | "server_error"
        self.description = description


@dataclass(slots=True)
class Published:
    message_id: int
    duplicate: bool


class Broker:
    def __init__(self, options: Options, clock: Any, workers: dict[str, DbWorker], node_id: str):
        self.options = options
        self.clock = clock
        self.node_id = node_id
        self._workers = workers
        self.topics: dict[str, TopicRow] = {}
        self.channels: dict[tuple[str, str], Channel] = {}
        self.healthy = True
        self.health_detail = ""
        self.health_listeners: list[Callable[[bool], None]] = []
        writers = [w for role, w in sorted(workers.items()) if role.startswith("writer")]
        self.writer = GroupCommitWriter(writers, node_id, options.commit_batch_size, self._set_health)
        self.acker = AckBatcher(
            workers["acker"],
            clock,
            options.ack_batch_size,
            options.ack_flush_interval,
            self._acks_done,
        )
        self._refresh_waiters: list[Deferred] | None = None
        self._loops: list[LoopingCall] = []
        self.started_at = time.time()
        self.publish_count = 0

    # -- lifecycle --------------------------------------------------------
    def start(self) -> Deferred:
        d = self.refresh_registry()

        def begin(_: Any) -> None:
            for fn, interval in (
                (self._scan, self.options.scan_interval),
                (self._refresh_quietly, self.options.registry_refresh),
                (self._sweep, self.options.sweep_interval),
            ):
                loop = LoopingCall(fn)
                loop.clock = self.clock
                loop.start(interval, now=False)
                self._loops.append(loop)

        return d.addCallback(begin)

    def stop(self) -> Deferred:
        """Stop taking sends, commit and answer what is queued, make acks durable."""
        for loop in self._loops:
            if loop.running:
                loop.stop()
        d = self.writer.close()
        d.addCallback(lambda _: self.acker.drain())
        return d

    def _set_health(self, ok: bool, why: str) -> None:
        changed = ok != self.healthy
        self.healthy = ok
        self.health_detail = why
        if changed:
            if ok:
                log.info("storage healthy again")
            else:
                log.error("storage failing: {why}", why=why)
            for listener in list(self.health_listeners):
                listener(ok)

    # -- registry cache ---------------------------------------------------
    def refresh_registry(self) -> Deferred:
        """Re-read topics and channels; fails with StorageError if PostgreSQL does.

        Concurrent callers share one query: each gets its own Deferred with the
        shared outcome.
        """
        waiter: Deferred = Deferred()
        if self._refresh_waiters is not None:
            self._refresh_waiters.append(waiter)
            return waiter
        self._refresh_waiters = [waiter]
        d = self._workers["admin"].run(list_topics)

        def finish(outcome: Any) -> None:
            waiters, self._refresh_waiters = self._refresh_waiters or [], None
            if isinstance(outcome, Failure):
                self._set_health(False, str(outcome.value))
            else:
                self._apply_registry(outcome)
            for w in waiters:
                if isinstance(outcome, Failure):
                    w.errback(outcome)
                else:
                    w.callback(None)

        d.addBoth(finish)
        return waiter

    def _refresh_quietly(self) -> None:
        self.refresh_registry().addErrback(lambda f: f.trap(StorageError))

    def _apply_registry(self, rows: list[TopicRow]) -> None:
        self.topics = {row.name: row for row in rows if row.store == "reliable"}
        wanted = {(t.name, c) for t in self.topics.values() for c in t.channels}
        for key in list(self.channels):
            if key not in wanted:
                channel = self.channels.pop(key)
                log.info("channel {t}/{c} unregistered", t=key[0], c=key[1])
                for consumer in channel.close():
                    closer = getattr(consumer, "channel_closed", None)
                    if closer is not None:
                        closer(channel)
        for key in wanted:
            if key not in self.channels:
                self._channel(*key)
            else:
                self.channels[key].msg_timeout = self.topics[key[0]].msg_timeout_ms / 1000.0

    def _channel(self, topic: str, name: str) -> Channel:
        channel = self.channels.get((topic, name))
        if channel is None:
            row = self.topics.get(topic)
            timeout = row.msg_timeout_ms / 1000.0 if row else self.options.msg_timeout
            channel = Channel(
                topic,
                name,
                clock=self.clock,
                msg_timeout=timeout,
                mem_queue_size=self.options.mem_queue_size,
                load=self._load,
                on_ack=self._on_ack,
            )
            self.channels[(topic, name)] = channel
        return channel

    def _with_fresh_registry(self, check: Callable[[], bool]) -> Deferred:
        """True at once if ``check`` passes on the cache, else after one refresh."""
        if check():
            return succeed(True)
        return self.refresh_registry().addCallback(lambda _: check())

    # -- publishing -------------------------------------------------------
    def check_publish(self, topic: str, producer: str, session_id: int, body: bytes) -> None:
        """Raise PublishRejected("invalid") for a send that breaks a rule."""
        if topic not in self.topics and not valid_name(topic):  # registered names are valid
            raise PublishRejected("invalid", f"E_BAD_TOPIC topic name {topic!r} is not valid")
        if not producer or len(producer) > 64:
            raise PublishRejected("invalid", "E_INVALID producer id must be 1..64 characters")
        if session_id < 0:
            raise PublishRejected("invalid", f"E_INVALID session id {session_id} is negative")
        if len(body) > self.options.max_msg_size:
            raise PublishRejected(
                "invalid",
                f"E_BAD_BODY message too big {len(body)} > {self.options.max_msg_size}",
            )

    def publish(
        self, topic: str, producer: str, session_id: int, body: bytes, produced_ms: int = 0
    ) -> Deferred:
        """Deferred firing with Published after commit; PublishRejected or StorageError."""
        d: Deferred = Deferred()

        def done(outcome: Any) -> None:
            if isinstance(outcome, BaseException):
                d.errback(outcome)
            else:
                d.callback(outcome)

        self.publish_cb(topic, producer, session_id, body, produced_ms, done)
        return d

    def publish_cb(
        self,
        topic: str,
        producer: str,
        session_id: int,
        body: bytes,
        produced_ms: int,
        done: Callable[[Any], None],
    ) -> None:
        """The send path without Deferreds: ``done`` gets Published, or the exception
        (PublishRejected, StorageError, ShuttingDown). Called once per message, so the
        common case (topic cached) is a few dict lookups and one queue append."""
        try:
            self.check_publish(topic, producer, session_id, body)
        except PublishRejected as exc:
            done(exc)
            return
        row = self.topics.get(topic)
        if row is not None and row.channels:
            self._stage(topic, producer, session_id, body, produced_ms, done)
            return

        def refreshed(_: Any) -> None:
            row = self.topics.get(topic)
            if row is None or not row.channels:
                done(
                    PublishRejected(
                        "no_topic", f"E_NO_TOPIC topic {topic!r} is not registered or has no channel"
                    )
                )
            else:
                self._stage(topic, producer, session_id, body, produced_ms, done)

        self.refresh_registry().addCallbacks(refreshed, lambda failure: done(failure.value))

    def _stage(
        self,
        topic: str,
        producer: str,
        session_id: int,
        body: bytes,
        produced_ms: int,
        done: Callable[[Any], None],
    ) -> None:
        def committed(stored: Any) -> None:
            if isinstance(stored, BaseException):
                done(stored)
                return
            if not stored.duplicate:
                self.publish_count += 1
                message = Message(
                    stored.message_id, topic, producer, session_id, stored.published_ms, body
                )
                channels = self.channels
                for name in stored.channels:
                    channel = channels.get((topic, name))
                    if channel is None:
                        channel = self._channel(topic, name)
                    channel.add(message)
            done(Published(stored.message_id, stored.duplicate))

        self.writer.submit_cb(NewMessage(topic, producer, session_id, produced_ms, body), committed)

    # -- subscribing ------------------------------------------------------
    def subscribe(self, topic: str, channel: str, consumer: Any) -> Deferred:
        """Deferred firing with the Channel once the consumer is attached."""
        for kind, name in (("topic", topic), ("channel", channel)):
            if not valid_name(name):
                code = "E_BAD_TOPIC" if kind == "topic" else "E_BAD_CHANNEL"
                return fail(SubscribeRejected("invalid", f"{code} {kind} name {name!r} is not valid"))

        def registered() -> bool:
            row = self.topics.get(topic)
            return row is not None and channel in row.channels

        def attach(ok: bool) -> Channel:
            row = self.topics.get(topic)
            if row is None:
                if not self.healthy:
                    raise SubscribeRejected("server_error", f"E_STORAGE {self.health_detail}")
                raise SubscribeRejected("no_topic", f"E_NO_TOPIC topic {topic!r} is not registered")
            if not ok:
                raise SubscribeRejected(
                    "no_channel",
                    f"E_NO_CHANNEL channel {channel!r} is not registered on topic {topic!r}",
                )
            ch = self._channel(topic, channel)
            ch.subscribe(consumer)
            return ch

        return self._with_fresh_registry(registered).addCallback(attach)

    def unsubscribe(self, channel: Channel, consumer: Any) -> None:
        channel.unsubscribe(consumer)

    def ack(self, topic: str, channel: str, message_id: int) -> bool:
        ch = self.channels.get((topic, channel))
        return ch.ack(message_id) if ch is not None else False

    def _on_ack(self, channel: Channel, delivery: Delivery, acked_ms: int) -> None:
        self.acker.add(
            AckRow(
                channel.topic,
                channel.name,
                delivery.message.message_id,
                delivery.first_delivered_ms,
                acked_ms,
                delivery.attempts,
            )
        )

    def _acks_done(self, rows: list[AckRow], ok: bool) -> None:
        by_channel: dict[tuple[str, str], list[int]] = {}
        for row in rows:
            by_channel.setdefault((row.topic, row.channel), []).append(row.message_id)
        for key, ids in by_channel.items():
            ch = self.channels.get(key)
            if ch is not None:
                ch.ack_durable(ids)

    # -- backlog ----------------------------------------------------------
    def _load(self, channel: Channel, after: int, limit: int) -> None:
        d = self._workers["loader"].run(load_backlog, channel.topic, channel.name, after, limit)

        def loaded(rows: list) -> None:
            if not channel.closed:
                channel.loaded(rows, limit)

        def failed(failure: Any) -> None:
            failure.trap(StorageError)
            log.warn("backlog load for {t}/{c} failed: {why}", t=channel.topic, c=channel.name, why=failure.value)
            self._set_health(False, str(failure.value))
            channel.load_failed()

        d.addCallbacks(loaded, failed)

    # -- periodic work ----------------------------------------------------
    def _scan(self) -> None:
        now = self.clock.seconds()
        for channel in list(self.channels.values()):
            if channel.in_flight:
                channel.scan(now)
            elif channel.backlog and not channel.loading and channel.consumers:
                channel.pump()  # retries a load that failed earlier

    def _sweep(self) -> Deferred:
        d = self._workers["admin"].run(sweep_messages, self.options.message_retention, 10000)
        d.addErrback(lambda f: f.trap(StorageError))
        return d

    # -- introspection ----------------------------------------------------
    def stats(self) -> dict[str, Any]:
        topics = []
        for name in sorted(self.topics):
            row = self.topics[name]
            channels = [
                self.channels[(name, c)].stats() for c in row.channels if (name, c) in self.channels
            ]
            topics.append(
                {
                    "topic_name": name,
                    "store": row.store,
                    "msg_timeout_ms": row.msg_timeout_ms,
                    "channels": channels,
                }
            )
        return {
            "node_id": self.node_id,
            "health": "OK" if self.healthy else "ERROR",
            "health_detail": self.health_detail,
            "start_time": int(self.started_at),
            "published": self.publish_count,
            "writer": {
                "pending": self.writer.pending,
                "batches": self.writer.batches,
                "messages": self.writer.messages,
            },
            "acks": {"pending": self.acker.pending, "durable": self.acker.acked},
            "topics": topics,
        }
