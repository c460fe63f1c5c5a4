"""A channel of a fast topic, with nsqd's semantics (``nsqd/channel.go``).

Each message a topic copies to this channel goes to exactly one of its clients.
Waiting messages sit in a bounded memory queue (``--mem-queue-size`` messages, and in
bytes what the server's ``--max-client-memory`` grants a channel window:
``core.client_memory.ClientMemory.window_room``) and overflow to the channel's disk queue
(``<topic>:<channel>``; ephemeral channels drop the overflow). Records read ahead from
the disk queue are bounded in bytes too (a quarter of a channel window). A delivered message is *in flight* until FIN, REQ or its deadline;
a deferred one (DPUB, REQ with a delay) waits for its due time. Both sit in a map
by id plus their deadlines (``core.deadlines``), which the store's single queue
scanner drains (``process_in_flight`` / ``process_deferred``); no timer per message.

A client is any object with ``ready_count``, ``in_flight_count``, ``sample_rate``,
``msg_timeout`` and ``send_messages(channel, messages)`` (plus counters for /stats
and ``close()``); the channel keeps ``in_flight_count`` up to date and delivers
while ``in_flight_count < ready_count`` (RDY is a window, never decremented).

Why one long module: it is nsqd's ``channel.go``, whose state (the memory queue, the disk
queue and what was read ahead from it, in flight, deferred, the clients' windows) every
operation touches and must leave consistent; split, each part would reach into the others.
"""

from __future__ import annotations

import random
from collections import deque

from twisted.logger import Logger

from dmq_server.core.errors import Exiting
from dmq_server.core.client_memory import FAST_WINDOW, WindowBytes
from dmq_server.fast.message import FastClient, FastMessage
from dmq_server.fast.services import StoreServices
from dmq_server.core.deadlines import Deadlines

__all__ = ["FastChannel"]

log = Logger()

#: Records a channel takes from its disk queue in one read (one lock, one look at the
#: clock), at most ``--mem-queue-size``: they wait in memory until delivered, so a crash
#: can lose them as it loses the memory queue; a shutdown writes them back to disk.
READ_AHEAD = 64


class FastChannel:
    def __init__(self, topic_name: str, name: str, store: StoreServices[FastChannel]):
        self.topic_name = topic_name
        self.name = name
        self.store = store
        self.clock = store.clock
        self.ephemeral = name.endswith("#ephemeral")
        self.mem_queue_size = store.mem_queue_size
        self.memory: deque[FastMessage] = deque()
        self.window = WindowBytes(store.client_memory, FAST_WINDOW)  # the bodies in ``memory``
        self.backend = store.make_backend(f"{topic_name}:{name}", self.ephemeral)
        self._backend_has_data = self.backend.depth() > 0
        # records taken from the disk queue in one read and not yet delivered: still
        # waiting, counted in the backend's depth (``backend_depth``)
        self._ahead: deque[bytes] = deque()
        self._read_ahead = max(1, min(READ_AHEAD, self.mem_queue_size))
        self.in_flight: dict[bytes, FastMessage] = {}
        self.deferred: dict[bytes, FastMessage] = {}
        # the bodies in ``deferred``: they have nowhere else to wait (a DPUB is refused
        # when they do not fit: ``FastStore.publish``), so they count apart from ``window``
        self.deferred_bytes = WindowBytes(store.client_memory, FAST_WINDOW)
        # when each in-flight message times out, each deferred one is due (the
        # reliable channel's tracker too: core.deadlines)
        self.in_flight_due: Deadlines[bytes] = Deadlines()
        self.deferred_due: Deadlines[bytes] = Deadlines()
        self.clients: dict[int, FastClient] = {}
        self._rotation: deque[FastClient] = deque()
        self.paused = False
        self.exiting = False
        self.message_count = 0
        self.requeue_count = 0
        self.timeout_count = 0
        self.finish_count = 0
        self._disk_turn = False
        self._pumping = False
        self._again = False

    # -- arrivals -----------------------------------------------------------------------
    def receive(self, msg: FastMessage) -> None:
        """A copy from the topic: counted, then queued now or deferred."""
        self.message_count += 1
        if msg.deferred:
            self.start_deferred(msg, msg.deferred)
        else:
            self.put(msg)

    def receive_many(self, msgs: list[FastMessage]) -> None:
        """``receive`` for the topic's messages of one publish (or one batch of its
        backlog): what overflows memory goes to the disk queue in one call, and the
        clients are served once, after it."""
        if self.exiting:
            raise Exiting()
        if self.ephemeral:  # its overflow depends on the clients' room, message by message
            for msg in msgs:
                self.receive(msg)
            return
        self.message_count += len(msgs)
        memory = self.memory
        room = self.mem_queue_size - len(memory)
        overflow: list[bytes] = []
        bytes_left = self.window.bytes_left()  # asked once: the batch's messages count against it
        kept = 0
        for msg in msgs:
            if msg.deferred:
                self.start_deferred(msg, msg.deferred)
            elif room > 0 and not overflow and kept + len(msg.body) <= bytes_left:
                memory.append(msg)
                kept += len(msg.body)
                room -= 1
            else:
                overflow.append(msg.encode())
        if kept:
            self.window.add(kept)
        if overflow:
            self._backend_has_data = True
            self.backend.put_many(overflow)
            if self.store.health_error is not None:
                self.store.set_health(None)
        self.pump()

    def put(self, msg: FastMessage) -> None:
        """Queue for delivery: memory while it has room, else the disk queue."""
        if self.exiting:
            raise Exiting()
        size = len(msg.body)
        if (len(self.memory) < self.mem_queue_size and self.window.fits(size)) or (
                self.ephemeral and self._has_ready_client()):
            self.memory.append(msg)
            self.window.add(size)
        else:
            self.backend.put(msg.encode())
            self._backend_has_data = not self.ephemeral
            if self.store.health_error is not None:
                self.store.set_health(None)
        self.pump()

    def _memory_cleared(self) -> None:
        self.memory.clear()
        self.window.clear()

    def depth(self) -> int:
        """Waiting messages (memory + disk); not in flight, not deferred."""
        return len(self.memory) + len(self._ahead) + self.backend.depth()

    # -- clients ------------------------------------------------------------------------
    def add_client(self, client: FastClient) -> str | None:
        """Attach a subscriber; an error text if the channel is full or going away."""
        if self.exiting:
            return "exiting"
        if id(client) in self.clients:
            return None
        limit = self.store.max_channel_consumers
        if limit and len(self.clients) >= limit:
            return f"consumers for {self.topic_name}:{self.name} exceeds limit of {limit}"
        self.clients[id(client)] = client
        self._rotation.append(client)
        return None

    def remove_client(self, client: FastClient) -> None:
        """Detach a subscriber. Its in-flight messages stay until they time out (nsqd).
        An ephemeral channel goes away with its last client."""
        if self.clients.pop(id(client), None) is None:
            return
        try:
            self._rotation.remove(client)
        except ValueError:
            pass
        if not self.clients and self.ephemeral and not self.exiting:
            topic = self.store.topics.get(self.topic_name)
            if topic is not None and topic.channels.get(self.name) is self:
                topic.delete_channel(self.name)

    def _has_ready_client(self) -> bool:
        return any(c.in_flight_count < c.ready_count for c in self._rotation)

    # -- delivery -----------------------------------------------------------------------
    def pump(self) -> None:
        """Give waiting messages to clients with room in their RDY window, round robin."""
        if self._pumping:
            self._again = True
            return
        if self.paused or not self._rotation or not (self.memory or self._backend_has_data):
            return  # the last: a FIN with nothing waiting, as under a steady flow
        self._pumping = True
        try:
            self._again = True
            while self._again:
                self._again = False
                self._pump()
        finally:
            self._pumping = False

    def _pump(self) -> None:
        rotation = self._rotation
        if len(rotation) == 1 and not rotation[0].sample_rate:
            self._fill(rotation[0])
            return
        while rotation and not self.paused:
            for _ in range(len(rotation)):
                client = rotation[0]
                if client.in_flight_count < client.ready_count:
                    break
                rotation.rotate(-1)
            else:
                return  # nobody is ready
            msg = self._next_message()
            if msg is None:
                return
            rotation.rotate(-1)  # the next message starts with the next client
            rate = client.sample_rate
            if rate and random.randrange(100) > rate:
                continue  # sampled out: consumed, never delivered (nsqd)
            self._deliver([msg], client)

    def _fill(self, client: FastClient) -> None:
        """The round robin of one client without sampling: as many messages as its RDY
        window has room for, taken in the order the round robin would take them and
        delivered in one call (one look at the clock, one write for the lot)."""
        room = client.ready_count - client.in_flight_count
        if room <= 0 or self.paused:
            return
        msgs: list[FastMessage] = []
        memory = self.memory
        if not self._backend_has_data:  # all in memory: popped here, their bytes counted out once
            popleft = memory.popleft
            size = 0
            while room and memory:
                waiting = popleft()
                msgs.append(waiting)
                size += len(waiting.body)
                room -= 1
            self._disk_turn = True  # as _next_message leaves it
            if msgs:
                self.window.add(-size)
                self._deliver(msgs, client)
            return
        if not memory:  # all on disk: decoded in one loop (what _next_message would give)
            self._take_from_disk(room, msgs)
        else:
            take = self._next_message
            while room:
                msg = take()
                if msg is None:
                    break
                msgs.append(msg)
                room -= 1
        if msgs:
            self._deliver(msgs, client)

    def _take_from_disk(self, room: int, msgs: list[FastMessage]) -> None:
        """Up to ``room`` messages from the disk queue, appended to ``msgs``: the loop of
        ``_next_message`` while the memory queue is empty (nothing arrives in it
        meanwhile), without a call and its tests a message."""
        ahead, decode = self._ahead, FastMessage.decode
        taken = False
        while room:
            if not ahead:
                ahead.extend(self.backend.read_many(self._read_ahead))
                if not ahead:
                    self._backend_has_data = False
                    self._disk_turn = True
                    return
                self._size_read_ahead(ahead)
            data = ahead.popleft()
            try:
                msgs.append(decode(data))
            except ValueError as exc:
                log.error("CHANNEL({topic}:{channel}): failed to decode message - {why}",
                          topic=self.topic_name, channel=self.name, why=exc)
                continue
            taken = True
            room -= 1
        if taken:
            self._disk_turn = False

    def _next_message(self) -> FastMessage | None:
        memory = self.memory
        if self._backend_has_data and (self._disk_turn or not memory):
            self._disk_turn = False
            ahead = self._ahead
            while True:
                if not ahead:
                    ahead.extend(self.backend.read_many(self._read_ahead))
                    if not ahead:
                        self._backend_has_data = False
                        break
                    self._size_read_ahead(ahead)
                data = ahead.popleft()
                try:
                    return FastMessage.decode(data)
                except ValueError as exc:
                    log.error(
                        "CHANNEL({topic}:{channel}): failed to decode message - {why}",
                        topic=self.topic_name, channel=self.name, why=exc,
                    )
        self._disk_turn = True  # memory and disk take turns, so neither starves
        if memory:
            msg = memory.popleft()
            self.window.add(-len(msg.body))
            return msg
        return None

    def _size_read_ahead(self, records: deque[bytes]) -> None:
        """The next read from the disk queue takes as many records as a quarter of a
        channel window holds, at the size of these (at most ``READ_AHEAD``)."""
        budget = self.window.memory
        if budget is None:
            return
        average = max(1, sum(map(len, records)) // len(records))
        self._read_ahead = max(1, min(READ_AHEAD, self.mem_queue_size, budget.channel_limit // 4 // average))

    def _deliver(self, msgs: list[FastMessage], client: FastClient) -> None:
        """In flight to ``client`` until FIN, REQ or the client's message timeout."""
        now = self.clock.seconds()
        deadline = now + client.msg_timeout
        in_flight = self.in_flight
        for msg in msgs:
            if msg.attempts < 0xFFFF:
                msg.attempts += 1
            msg.client = client
            msg.delivery_ts = now
            in_flight[msg.id] = msg
        self.in_flight_due.set_many([msg.id for msg in msgs], deadline)
        self.store.arm(self)
        client.in_flight_count += len(msgs)
        client.message_count += len(msgs)
        client.send_messages(self, msgs)

    # -- FIN / REQ / TOUCH --------------------------------------------------------------
    def _pop_in_flight(self, client: FastClient, message_id: bytes) -> FastMessage | str:
        msg = self.in_flight.get(message_id)
        if msg is None:
            return "ID not in flight"
        if msg.client is not client:
            return "client does not own message"
        del self.in_flight[message_id]
        self.in_flight_due.discard(message_id)
        msg.client = None
        return msg

    def finish(self, client: FastClient, message_id: bytes, pump: bool = True) -> str | None:
        """FIN. ``pump`` False: the caller pumps once after a run of them (a read's FINs)."""
        failed = self.finish_many(client, [message_id])
        if pump:
            self.pump()
        return failed[0][1] if failed else None

    def finish_many(self, client: FastClient, message_ids: list[bytes]) -> list[tuple[bytes, str]]:
        """FIN of each id, in order, without a pump (the caller pumps once after them);
        returns the ids refused, each with nsqd's reason. One refused fails no other."""
        in_flight = self.in_flight
        failed: list[tuple[bytes, str]] = []
        finished: list[bytes] = []
        for message_id in message_ids:
            msg = in_flight.get(message_id)
            if msg is None:
                failed.append((message_id, "ID not in flight"))
            elif msg.client is not client:
                failed.append((message_id, "client does not own message"))
            else:
                del in_flight[message_id]
                msg.client = None
                finished.append(message_id)
        self.in_flight_due.discard_many(finished)
        done = len(finished)
        client.in_flight_count -= done
        client.finish_count += done
        self.finish_count += done
        return failed

    def requeue(self, client: FastClient, message_id: bytes, timeout: float) -> str | None:
        """Back to the queue now (``timeout`` 0) or after ``timeout`` seconds."""
        msg = self._pop_in_flight(client, message_id)
        if isinstance(msg, str):
            return msg
        self.requeue_count += 1
        client.in_flight_count -= 1
        client.requeue_count += 1
        try:
            if timeout <= 0:
                self.put(msg)
            else:
                self.start_deferred(msg, timeout)
        except Exiting:
            return "exiting"
        except Exception as exc:  # disk queue failure
            self.store.set_health(exc)
            return str(exc)
        self.pump()
        return None

    def touch(self, client: FastClient, message_id: bytes, client_timeout: float) -> str | None:
        """Push the deadline to now + the client's timeout, capped at delivery + max."""
        msg = self._pop_in_flight(client, message_id)
        if isinstance(msg, str):
            return msg
        deadline = self.clock.seconds() + client_timeout
        max_timeout = self.store.max_msg_timeout
        if deadline - msg.delivery_ts >= max_timeout:
            deadline = msg.delivery_ts + max_timeout
        msg.client = client
        self.in_flight[msg.id] = msg
        self.in_flight_due.set(msg.id, deadline)
        return None

    def start_deferred(self, msg: FastMessage, delay: float) -> None:
        if self.exiting:
            raise Exiting()
        if msg.id in self.deferred:
            return
        self.deferred[msg.id] = msg
        self.deferred_bytes.add(len(msg.body))
        self.deferred_due.set(msg.id, self.clock.seconds() + delay)
        self.store.arm(self)

    # -- the queue scanner's work -------------------------------------------------------
    def process_in_flight(self, now: float) -> bool:
        """Requeue messages whose deadline passed; True if any did."""
        dirty = False
        for message_id in self.in_flight_due.pop_due(now):
            msg = self.in_flight.pop(message_id, None)
            if msg is None:
                continue
            dirty = True
            self.timeout_count += 1
            client, msg.client = msg.client, None
            if client is not None and id(client) in self.clients:
                client.in_flight_count -= 1
            self._put_quietly(msg)
        if dirty:
            self.pump()
        return dirty

    def process_deferred(self, now: float) -> bool:
        """Queue deferred messages that are due; True if any were."""
        dirty = False
        for message_id in self.deferred_due.pop_due(now):
            msg = self.deferred.pop(message_id, None)
            if msg is None:
                continue
            dirty = True
            self.deferred_bytes.add(-len(msg.body))
            self._put_quietly(msg)
        return dirty

    def _put_quietly(self, msg: FastMessage) -> None:
        try:
            self.put(msg)
        except Exiting:
            pass
        except Exception as exc:
            log.error("CHANNEL({topic}:{channel}): put failed - {why}", topic=self.topic_name, channel=self.name, why=exc)
            self.store.set_health(exc)

    @property
    def armed(self) -> bool:
        return bool(self.in_flight_due) or bool(self.deferred_due)

    # -- admin --------------------------------------------------------------------------
    def pause(self) -> None:
        self.paused = True

    def unpause(self) -> None:
        self.paused = False
        self.pump()

    def empty(self) -> None:
        """Drop everything: in flight, deferred, memory and disk (nsqd ``Empty``)."""
        for msg in self.in_flight.values():
            msg.client = None
        self.in_flight.clear()
        self.in_flight_due.clear()
        self.deferred.clear()
        self.deferred_bytes.clear()
        self.deferred_due.clear()
        for client in self._rotation:
            client.in_flight_count = 0
        self._memory_cleared()
        self._ahead.clear()
        self.backend.empty()
        self._backend_has_data = False
        self.pump()

    def delete(self) -> None:
        """Close the clients, drop every message and the disk files."""
        self.exiting = True
        self._close_clients()
        self.empty_quietly()
        self.backend.destroy()

    def empty_quietly(self) -> None:
        try:
            self.empty()
        except Exception as exc:
            log.error("CHANNEL({topic}:{channel}): empty failed - {why}", topic=self.topic_name, channel=self.name, why=exc)

    def close(self) -> None:
        """Shutdown: close clients, then memory, in-flight and deferred go to disk."""
        self.exiting = True
        self._close_clients()
        self.flush()
        self.backend.close()

    def flush(self) -> None:
        """Write memory, in-flight and deferred messages to the disk queue (deferral and
        in-flight state are lost, as in nsqd; attempts are kept), and the records read
        ahead from it (behind the ones still there: the order changes, as in nsqd)."""
        backend = self.backend
        pending = len(self.memory) + len(self.in_flight) + len(self.deferred) + len(self._ahead)
        if pending and not self.ephemeral:
            log.info(
                "CHANNEL({topic}:{channel}): flushing {n} memory/in-flight/deferred/read-ahead messages to backend",
                topic=self.topic_name, channel=self.name, n=pending,
            )
        if self._ahead:
            backend.put_many(list(self._ahead))
            self._ahead.clear()
        for msg in self.memory:
            backend.put(msg.encode())
        for msg in self.in_flight.values():
            backend.put(msg.encode())
        for msg in self.deferred.values():
            backend.put(msg.encode())
        self._memory_cleared()
        self.in_flight.clear()
        self.in_flight_due.clear()
        self.deferred.clear()
        self.deferred_bytes.clear()
        self.deferred_due.clear()

    def _close_clients(self) -> None:
        clients = list(self._rotation)
        self.clients.clear()
        self._rotation.clear()
        for client in clients:
            closer = getattr(client, "channel_closed", None)
            if closer is not None:
                closer(self)

    # -- introspection ------------------------------------------------------------------
    def stats(self, include_clients: bool = True) -> dict[str, object]:
        """nsqd's ChannelStats shape."""
        clients = [c.stats() for c in self._rotation] if include_clients else None
        return {
            "channel_name": self.name,
            "depth": self.depth(),
            "backend_depth": len(self._ahead) + self.backend.depth(),
            "in_flight_count": len(self.in_flight),
            "deferred_count": len(self.deferred),
            "message_count": self.message_count,
            "requeue_count": self.requeue_count,
            "timeout_count": self.timeout_count,
            "finish_count": self.finish_count,
            "client_count": len(self.clients),
            "clients": clients,
            "paused": self.paused,
            "e2e_processing_latency": {"count": 0, "percentiles": None},
        }
