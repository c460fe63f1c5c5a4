"""A fast topic, with nsqd's semantics (``nsqd/topic.go``).

Every message published to a topic is copied to each of its channels (same id,
body and timestamp; attempts start at 0 per channel). While the topic has no
channel, or is paused, messages wait in the topic itself: a memory queue bounded in
messages (``--mem-queue-size``) and in bytes (a channel window of the server's
``--max-client-memory``, ``core.client_memory.ClientMemory``) that overflows to the topic's
disk queue (``<topic>``), so the first channel created gets everything published
before it. A drain reads at most a channel window's bytes from the disk queue at once. Deferred messages (DPUB) wait in
memory, never on disk, so they keep their delay.

Where nsqd runs a pump goroutine per topic, this topic copies a message straight
to the channels when nothing is waiting, and otherwise drains what waits in
batches on the reactor (``_drain``), so a large backlog never blocks it for long.
"""

from __future__ import annotations

from collections import deque

from twisted.logger import Logger

from dmq_server.core.clock import Timer
from dmq_server.core.errors import Exiting
from dmq_server.core.client_memory import FAST_WINDOW, WindowBytes
from dmq_server.fast.fast_channel import FastChannel
from dmq_server.fast.message import FastMessage
from dmq_server.fast.services import StoreServices

__all__ = ["FastTopic"]

log = Logger()

#: Messages moved from a topic's backlog to its channels per reactor turn.
DRAIN_BATCH = 2000
#: Records a drain asks the disk queue for before it knows their size.
DRAIN_PROBE = 16


class FastTopic:
    def __init__(self, name: str, store: StoreServices[FastChannel]):
        self.name = name
        self.store = store
        self.ephemeral = name.endswith("#ephemeral")
        self.mem_queue_size = store.mem_queue_size
        self.memory: deque[FastMessage] = deque()
        self.window = WindowBytes(store.client_memory, FAST_WINDOW)  # the bodies in ``memory``
        self.backend = store.make_backend(name, self.ephemeral)
        self._backend_has_data = self.backend.depth() > 0
        self.channels: dict[str, FastChannel] = {}
        self.paused = False
        self.exiting = False
        self.message_count = 0
        self.message_bytes = 0
        self._drain_call: Timer | None = None

    # -- publishing ---------------------------------------------------------------------
    def put(self, msg: FastMessage) -> None:
        self.put_many((msg,))

    def put_many(self, msgs: list[FastMessage] | tuple[FastMessage, ...]) -> None:
        """Publish; raises Exiting, or the disk queue's error if the topic's own disk
        write fails (nsqd's E_PUB_FAILED)."""
        if self.exiting:
            raise Exiting()
        # Nothing waits before them: straight to the channels, all of them (copying one
        # cannot make anything wait); else each waits in turn, behind what waits already.
        if self.channels and not self.paused and not self.memory and not self._backend_has_data:
            self._fan_out(list(msgs))
        else:
            for msg in msgs:
                self._queue(msg)
        self.message_count += len(msgs)
        self.message_bytes += sum(len(msg.body) for msg in msgs)

    def deferred_fits(self, size: int) -> bool:
        """Whether deferred messages of ``size`` bytes in all may be taken: each channel
        holds a copy until it is due (counted once per channel, though the copies share
        the body: an overestimate that errs on the bounded side), or the topic holds one
        while it has no channel."""
        memory = self.window.memory
        return memory is None or memory.deferred_room(size * max(1, len(self.channels)))

    def _queue(self, msg: FastMessage) -> None:
        size = len(msg.body)
        if msg.deferred or (len(self.memory) < self.mem_queue_size and self.window.fits(size)):
            self.memory.append(msg)
            self.window.add(size)
        elif not self.ephemeral:  # ephemeral overflow is dropped (nsqd's dummy backend)
            self.backend.put(msg.encode())
            self._backend_has_data = True
            if self.store.health_error is not None:
                self.store.set_health(None)

    def _fan_out(self, msgs: list[FastMessage]) -> None:
        """Copy messages to every channel; each channel takes them in one call, so what
        overflows its memory goes to its disk queue in one write. A channel whose disk
        write fails is logged and the store turns unhealthy; the others still get them."""
        first = True
        for channel in list(self.channels.values()):
            copies = msgs if first else [msg.copy() for msg in msgs]
            first = False
            try:
                channel.receive_many(copies)
            except Exiting:
                pass
            except Exception as exc:  # a channel's disk write failed
                what = f"msg {msgs[0].id!r}" if len(msgs) == 1 else f"{len(msgs)} msgs"
                log.error("TOPIC({topic}): failed to put {what} to channel({channel}) - {why}",
                          topic=self.name, what=what, channel=channel.name, why=exc)
                self.store.set_health(exc)

    def _memory_cleared(self) -> None:
        self.memory.clear()
        self.window.clear()

    def depth(self) -> int:
        return len(self.memory) + self.backend.depth()

    # -- draining what waited -------------------------------------------------------------
    def _can_drain(self) -> bool:
        return bool(self.channels) and not self.paused and not self.exiting

    def drain(self) -> None:
        """Move waiting messages to the channels: one batch now, the rest on later turns."""
        if self._drain_call is not None and self._drain_call.active():
            self._drain_call.cancel()
        self._drain_call = None
        if not self._can_drain():
            return
        memory = self.memory
        batch = [memory.popleft() for _ in range(min(len(memory), DRAIN_BATCH))]
        if batch:
            self.window.add(-sum(len(msg.body) for msg in batch))
        moved = len(batch)
        # at most a channel window's bytes from disk at once: records may be a megabyte each
        room = self.window.memory.channel_limit if self.window.memory is not None else None
        step = DRAIN_PROBE if room is not None else DRAIN_BATCH
        while self._backend_has_data and moved < DRAIN_BATCH and (room is None or room > 0):
            records = self.backend.read_many(min(DRAIN_BATCH - moved, step))
            if not records:
                self._backend_has_data = False
                break
            moved += len(records)
            if room is not None:
                size = sum(map(len, records))
                room -= size
                step = max(1, room // max(1, size // len(records)))
            for data in records:
                try:
                    batch.append(FastMessage.decode(data))
                except ValueError as exc:
                    log.error("TOPIC({topic}): failed to decode message - {why}", topic=self.name, why=exc)
        if batch:
            self._fan_out(batch)
        if self.memory or self._backend_has_data:
            self._drain_call = self.store.clock.callLater(0, self.drain)

    # -- channels -----------------------------------------------------------------------
    def get_channel(self, name: str) -> FastChannel:
        """The channel, created (and announced to the store) if it is new."""
        channel = self.channels.get(name)
        if channel is None:
            channel = FastChannel(self.name, name, self.store)
            self.channels[name] = channel
            self.store.changed(channel)
            if len(self.channels) == 1:
                self.drain()
        return channel

    def delete_channel(self, name: str) -> bool:
        channel = self.channels.pop(name, None)
        if channel is None:
            return False
        channel.delete()
        self.store.disarm(channel)
        self.store.changed(channel)
        if not self.channels and self.ephemeral and not self.exiting:
            self.store.delete_topic(self.name)
        return True

    # -- admin --------------------------------------------------------------------------
    def pause(self) -> None:
        self.paused = True

    def unpause(self) -> None:
        self.paused = False
        self.drain()

    def empty(self) -> None:
        self._memory_cleared()
        self.backend.empty()
        self._backend_has_data = False

    def delete(self) -> None:
        """Delete every channel (closing their clients), drop messages and disk files."""
        self.exiting = True
        if self._drain_call is not None and self._drain_call.active():
            self._drain_call.cancel()
        for name in list(self.channels):
            channel = self.channels.pop(name)
            channel.delete()
            self.store.disarm(channel)
        self._memory_cleared()
        self.backend.destroy()

    def close(self) -> None:
        """Shutdown: channels flush to their disk queues, then the topic's memory goes to its own."""
        self.exiting = True
        if self._drain_call is not None and self._drain_call.active():
            self._drain_call.cancel()
        for channel in self.channels.values():
            try:
                channel.close()
            except Exception as exc:
                log.error("CHANNEL({topic}:{channel}): close failed - {why}", topic=self.name, channel=channel.name, why=exc)
        if self.memory and not self.ephemeral:
            log.info("TOPIC({topic}): flushing {n} memory messages to backend", topic=self.name, n=len(self.memory))
        for msg in self.memory:
            self.backend.put(msg.encode())
        self._memory_cleared()
        self.backend.close()

    def stats(self, channel: str | None = None, include_clients: bool = True) -> dict[str, object]:
        """nsqd's TopicStats shape, channels sorted by name."""
        names = sorted(self.channels) if channel is None else [n for n in (channel,) if n in self.channels]
        return {
            "topic_name": self.name,
            "channels": [self.channels[n].stats(include_clients) for n in names],
            "depth": self.depth(),
            "backend_depth": self.backend.depth(),
            "message_count": self.message_count,
            "message_bytes": self.message_bytes,
            "paused": self.paused,
            "e2e_processing_latency": {"count": 0, "percentiles": None},
        }
