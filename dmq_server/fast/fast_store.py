"""The fast store: nsqd's topics and channels, one queue scanner, ``nsqd.dat``.

Topics are created on demand (PUB, SUB, /pub, /topic/create), as nsqd does. The
broker's one scanner (``Broker.timers`` "scan", every ``--scan-interval``, nsqd's
100 ms QueueScanInterval) calls ``scan``, which walks the channels that hold
in-flight or deferred messages and moves what is due; nothing runs on a timer per
message. Channels with nothing pending are not visited, so idle channels cost
nothing (nsqd samples 20 random channels instead; see docs/nsq.md). The store's own
timer ticks the disk queues so an idle queue still syncs within ``--sync-timeout``.

On start the store reads ``nsqd.dat`` and recreates its topics, channels and
pause flags; disk queues keep their messages. On a clean stop every channel
writes its memory, in-flight and deferred messages to its disk queue and every
topic its memory queue, then the metadata is written: nothing is lost, only the
deferral of deferred messages (as in nsqd).
"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from twisted.application.internet import TimerService
from twisted.application.service import MultiService
from twisted.logger import Logger

from dmq_server.core.client_memory import ClientMemory
from dmq_server.core.clock import Clock, Timer
from dmq_server.core.errors import DmqError, Exiting, OverBudget, QueueFailed, Refused
from dmq_server.core.options import Options
from dmq_server.core.publish import Published
from dmq_server.fast import metadata
from dmq_server.fast.fast_channel import FastChannel
from dmq_server.fast.services import Backend
from dmq_server.core.ids import GuidFactory, default_node_id, hex_id
from dmq_server.fast.message import FastMessage
from dmq_server.fast.subscription import FastSubscription
from dmq_server.fast.topic import FastTopic
from dmq_server.core.nsq_wire import MIN_VALID_MSG_LENGTH, valid_name_bytes

if TYPE_CHECKING:  # imported where a data directory needs one
    from dmq_client.diskqueue import DiskQueue

__all__ = ["FastStore", "DummyBackend"]

log = Logger()

#: Bytes a disk queue keeps before writing them: records put in one reactor turn
#: (the PUBs of one read, an MPUB) are written by one write() at its end, not one
#: each. Records of a fast topic are not durable until the next sync anyway, and a
#: kill -9 loses its memory queue; this adds at most one turn's overflow to that.
WRITE_BUFFER = 256 * 1024


class DummyBackend:
    """The backend of ephemeral topics and channels: what overflows is dropped."""

    def put(self, data: bytes) -> None:
        pass

    def put_many(self, records: list[bytes]) -> None:
        pass

    def read(self) -> bytes | None:
        return None

    def read_many(self, limit: int) -> list[bytes]:
        return []

    def depth(self) -> int:
        return 0

    def empty(self) -> None:
        pass

    def tick(self) -> None:
        pass

    def sync(self) -> None:
        pass

    def close(self) -> None:
        pass

    def destroy(self) -> None:
        pass


class FastStore:
    """All fast topics of this node. ``clock`` provides ``seconds()`` and ``callLater``."""

    def __init__(
        self,
        clock: Clock,
        data_dir: Path | None,
        *,
        mem_queue_size: int = 10000,
        max_msg_size: int = 1024 * 1024,
        msg_timeout: float = 60.0,
        max_msg_timeout: float = 900.0,
        max_req_timeout: float = 3600.0,
        max_channel_consumers: int = 0,
        sync_every: int = 2500,
        sync_timeout: float = 2.0,
        max_bytes_per_file: int = 100 * 1024 * 1024,
        node_id: int | None = None,
        backend_factory: Callable[[str], Backend] | None = None,
        client_memory: ClientMemory | None = None,
    ):
        self.clock = clock
        self.client_memory = client_memory  # core.client_memory.ClientMemory: the memory queues' bytes
        self.data_dir = Path(data_dir) if data_dir is not None else None
        self.mem_queue_size = mem_queue_size
        self.max_msg_size = max_msg_size
        self.msg_timeout = msg_timeout
        self.max_msg_timeout = max_msg_timeout
        self.max_req_timeout = max_req_timeout
        self.max_channel_consumers = max_channel_consumers
        self.sync_every = sync_every
        self.sync_timeout = sync_timeout
        self.max_bytes_per_file = max_bytes_per_file
        self._backend_factory = backend_factory
        self._unwritten: set[DiskQueue] = set()  # disk queues holding buffered records
        self._write_call: Timer | None = None
        if node_id is None:
            node_id = default_node_id(socket.gethostname())
        self.guid = GuidFactory(node_id, lambda: int(clock.seconds() * 1e9))
        self.topics: dict[str, FastTopic] = {}
        self._armed: set[FastChannel] = set()
        self._loading = False
        self._dirty = False
        self.publish_count = 0  # messages put by publish()
        self.timers = self._timers()
        self.health_error: str | None = None
        self.closed = False

    @classmethod
    def from_options(
        cls, options: Options, clock: Clock, data_dir: Path | None, client_memory: ClientMemory | None = None
    ) -> "FastStore":
        """Built from ``dmq_server.core.options.Options``."""
        return cls(
            clock,
            data_dir,
            mem_queue_size=options.mem_queue_size,
            max_msg_size=options.max_msg_size,
            msg_timeout=options.msg_timeout,
            max_msg_timeout=options.max_msg_timeout,
            max_req_timeout=options.max_req_timeout,
            max_channel_consumers=options.max_channel_consumers,
            sync_every=options.sync_every,
            sync_timeout=options.sync_timeout,
            max_bytes_per_file=options.max_bytes_per_file,
            client_memory=client_memory,
        )

    # -- backends -----------------------------------------------------------------------
    def make_backend(self, name: str, ephemeral: bool) -> Backend:
        """The disk queue for ``name`` (dummy for ephemeral names, or with no data dir)."""
        if ephemeral:
            return DummyBackend()
        if self._backend_factory is not None:
            return self._backend_factory(name)
        if self.data_dir is None:
            return DummyBackend()
        from dmq_client.diskqueue import DiskQueue

        self.data_dir.mkdir(parents=True, exist_ok=True)
        return DiskQueue(
            name,
            self.data_dir,
            max_bytes_per_file=self.max_bytes_per_file,
            min_msg_size=MIN_VALID_MSG_LENGTH,
            max_msg_size=self.max_msg_size + MIN_VALID_MSG_LENGTH,
            sync_every=self.sync_every,
            sync_timeout=self.sync_timeout,
            clock=self.clock.seconds,
            write_buffer=WRITE_BUFFER,
            on_buffered=self._buffered,
        )

    def _buffered(self, queue: DiskQueue) -> None:
        """A disk queue started buffering: write it out at the end of this turn."""
        self._unwritten.add(queue)
        if self._write_call is None:
            self._write_call = self.clock.callLater(0, self.write_buffered)

    def write_buffered(self) -> None:
        """Write every disk queue's buffered records. A failed write dropped them (the
        producers were answered OK): the store turns unhealthy, as for a failed put."""
        if self._write_call is not None and self._write_call.active():
            self._write_call.cancel()
        self._write_call = None
        queues, self._unwritten = self._unwritten, set()
        for queue in queues:
            try:
                queue.flush()
            except Exception as exc:
                log.error("NSQ: disk queue {name} lost its buffered records - {why}", name=queue.name, why=exc)
                self.set_health(exc)

    def set_health(self, error: BaseException | str | None) -> None:
        text = None if error is None else str(error)
        if text != self.health_error:
            if text is None:
                log.info("NSQ: disk queues healthy again")
            else:
                log.error("NSQ: disk queue failure - {why}", why=text)
        self.health_error = text

    # -- lifecycle ----------------------------------------------------------------------
    def _timers(self) -> MultiService:
        """The disk-queue sync ticker, a named ``TimerService`` on the injected clock;
        whoever owns the store (the service tree, a test) runs it. The scan of in-flight
        and deferred messages is the broker's one scanner for both stores (``scan``)."""
        timers = MultiService()
        timer = TimerService(self.sync_timeout, self.tick_backends)
        timer.clock = self.clock
        timer.setName("sync")
        timer.setServiceParent(timers)
        return timers

    def start(self) -> None:
        """Load ``nsqd.dat``: topics, channels and pause flags as they were."""
        self.load_metadata()

    def load_metadata(self) -> None:
        if self.data_dir is None:
            return
        topics = metadata.load(self.data_dir)
        self._loading = True
        try:
            for t in topics:
                if not valid_name_bytes(t.name.encode()) or t.name.endswith("#ephemeral"):
                    log.warn("NSQ: skipping creation of invalid topic {topic}", topic=t.name)
                    continue
                topic = self.get_topic(t.name)
                if t.paused:
                    topic.pause()
                for c in t.channels:
                    if not valid_name_bytes(c.name.encode()) or c.name.endswith("#ephemeral"):
                        log.warn("NSQ: skipping creation of invalid channel {channel}", channel=c.name)
                        continue
                    channel = topic.get_channel(c.name)
                    if c.paused:
                        channel.pause()
        finally:
            self._loading = False
        for topic in self.topics.values():
            topic.drain()

    def close(self) -> None:
        """Clean shutdown: persist metadata, flush every queue to disk, close the files."""
        if self.closed:
            return
        self.closed = True
        if self.timers.running:  # stopped by the service tree first; a test may not have
            self.timers.stopService()
        self.write_buffered()
        self.persist_metadata(force=False)
        for topic in list(self.topics.values()):
            try:
                topic.close()
            except Exception as exc:
                log.error("TOPIC({topic}): close failed - {why}", topic=topic.name, why=exc)
        self._armed.clear()

    # -- topics -------------------------------------------------------------------------
    def new_message(self, body: bytes, deferred: float = 0.0) -> FastMessage:
        return FastMessage(self.guid.new_hex(), body, int(self.clock.seconds() * 1e9), 0, deferred)

    def publish(self, topic: str, bodies: list[bytes], deferred: float = 0.0) -> Published | DmqError:
        """Put ``bodies`` on ``topic`` (made on first use): in memory, overflowing to its
        disk queue, as nsqd does; the answer is known before this returns."""
        try:
            now = int(self.clock.seconds() * 1e9)
            if len(bodies) == 1:  # a PUB: its id made as a number, not read back from hex
                first = self.guid.new() & 0xFFFF_FFFF_FFFF_FFFF  # as the hex form reads back
                messages = [FastMessage(hex_id(first), bodies[0], now, 0, deferred)]
            else:
                messages = [
                    FastMessage(message_id, body, now, 0, deferred)
                    for message_id, body in zip(self.guid.new_hex_many(len(bodies)), bodies)
                ]
                first = int(messages[0].id, 16) if messages else 0
            target = self.get_topic(topic)
            if deferred and not target.deferred_fits(sum(map(len, bodies))):
                return OverBudget()
            target.put_many(messages)
        except Exiting as exc:
            return exc
        except Exception as exc:  # the topic's disk queue failed
            self.set_health(exc)
            return QueueFailed(str(exc))
        self.publish_count += len(messages)
        return Published(first, False, len(messages))

    # ``client`` is left untyped while broker.interfaces.Store names a subscriber a
    # reliable.channel.Receiver: a fast channel needs a FastClient (an NSQ connection is both)
    def subscribe(self, topic: str, channel: str, client: Any) -> FastSubscription:
        """``client`` on ``channel`` of ``topic`` (both made on first use, as nsqd's SUB
        makes them); refused with the channel's reason (closing, or over
        ``--max-channel-consumers``) as ``Refused`` with code ``E_SUB_FAILED``."""
        ch = self.get_topic(topic).get_channel(channel)
        error = ch.add_client(client)
        if error is not None:
            raise Refused(error, code="E_SUB_FAILED")
        return FastSubscription(ch)

    def get_topic(self, name: str) -> FastTopic:
        topic = self.topics.get(name)
        if topic is None:
            topic = FastTopic(name, self)
            self.topics[name] = topic
            log.info("TOPIC({topic}): created", topic=name)
            self.changed(topic)
        return topic

    def delete_topic(self, name: str) -> bool:
        topic = self.topics.pop(name, None)
        if topic is None:
            return False
        log.info("TOPIC({topic}): deleting", topic=name)
        topic.delete()
        self.changed(topic)
        return True

    def changed(self, thing: object) -> None:
        """A topic or channel was created, deleted, paused or unpaused."""
        if self._loading or getattr(thing, "ephemeral", False):
            return
        self._dirty = True
        self.persist_metadata()

    def persist_metadata(self, force: bool = True) -> None:
        """Write ``nsqd.dat`` (non-ephemeral topics and channels, pause flags)."""
        if self.data_dir is None:
            return
        if not force and not self._dirty and not (self.data_dir / metadata.METADATA_FILE).exists():
            return
        topics = []
        for name in sorted(self.topics):
            topic = self.topics[name]
            if topic.ephemeral:
                continue
            channels = [
                metadata.ChannelMeta(c.name, c.paused)
                for c in sorted(topic.channels.values(), key=lambda c: c.name)
                if not c.ephemeral
            ]
            topics.append(metadata.TopicMeta(name, topic.paused, channels))
        try:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            metadata.save(self.data_dir, topics)
        except OSError as exc:
            log.error("NSQ: failed to persist metadata - {why}", why=exc)

    # -- the queue scanner --------------------------------------------------------------
    def arm(self, channel: FastChannel) -> None:
        self._armed.add(channel)

    def disarm(self, channel: FastChannel) -> None:
        self._armed.discard(channel)

    def scan(self) -> int:
        """Requeue timed-out in-flight messages and queue due deferred ones; returns how
        many channels had work (nsqd's "dirty" channels)."""
        now = self.clock.seconds()
        dirty = 0
        for channel in list(self._armed):
            if channel.exiting:
                self._armed.discard(channel)
                continue
            worked = channel.process_in_flight(now)
            worked = channel.process_deferred(now) or worked
            dirty += worked
            if not channel.armed:
                self._armed.discard(channel)
        return dirty

    def tick_backends(self) -> None:
        for topic in list(self.topics.values()):
            try:
                topic.backend.tick()
                for channel in list(topic.channels.values()):
                    channel.backend.tick()
            except Exception as exc:
                self.set_health(exc)

    # -- introspection ------------------------------------------------------------------
    def stats(
        self, topic: str | None = None, channel: str | None = None, include_clients: bool = True
    ) -> list[dict] | None:
        """nsqd's per-topic stats, sorted by name; None if ``topic`` names no topic."""
        if topic is not None:
            t = self.topics.get(topic)
            return None if t is None else [t.stats(channel, include_clients)]
        return [self.topics[n].stats(channel, include_clients) for n in sorted(self.topics)]
