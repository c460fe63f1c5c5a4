"""Mixed load that records everything the checker counts.

``Producer``: paced, pipelined sends (one in ten a DELAY due a second later) to one
node at a time; a send answered ``SEND_SERVER_ERROR``, refused as unknown topic (a
node that lost its registry for a moment), or not answered before its connection
broke or went quiet is resent with the same (producer, session id) as
``UP_PRODUCER_RESEND``, to the next node if the connection failed: what the client
library does, with shorter pauses. With ``priorities``, two sends in three carry a
priority, 1 to 9 from their session id (``priority_of``), in their properties; the rest
none (0). ``Consumer``: one connection of a consumer to one
node, subscribed to one channel; it records every push and acks it (after ``hold``
seconds, so a consumer killed mid-run has copies in flight; never while ``stalled``,
so it fills its credit and the node must keep what comes next) and connects again when
its connection fails. A consumer has one on every node, as NSQ's readers do: each
node delivers the copies it stored (and those it took over from nodes that died).
``Confirmer``: looks in the store (dmq_pending) for the acked copies; a copy no longer pending
means the ack is durable, and any later push of that send is a duplicate. ``Stalls``: the
consumers of one channel, with a small credit, stop acknowledging for a while, again and
again, so that channel's memory window on every node fills, and copies of a higher
priority arriving meanwhile take the places of lower ones (issue 45 §3).

Every thread stops by itself (an event, and deadlines on every wait); sockets go to
loopback addresses only.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from collections import deque
from typing import Callable

from dataclasses import dataclass

from dmq_client.blocking import BlockingClient, ClientError
from dmq_client.message import ReceivedMessage
from dmq_client.wire import Command, Frame
from dmq_client.wire.frames import MessageType
from dmq_client.wire.properties import Properties, encode_properties

from .checker import History

__all__ = ["SendPlan", "Producer", "Consumer", "Confirmer", "Load", "Stalls", "priority_of"]

Addresses = Callable[[], list[tuple[str, int]]]
RETRYABLE = (Command.SEND_SERVER_ERROR, Command.SEND_NO_TOPIC_ACK)


def priority_of(session_id: int) -> int:
    """The priority of a send of the chaos load: none (0) for one session id in three,
    else 1 to 9, each as often, mixed so that neighbours differ (1 -> 5, 2 -> 9, 4 -> 6,
    5 -> 1, 7 -> 7, 8 -> 2...)."""
    return 0 if session_id % 3 == 0 else 1 + (session_id // 3 + 4 * (session_id % 3)) % 9


class SendPlan:
    """What a producer of the load sends and counts, threaded (``Producer``) or asyncio
    (``aio_load.AioProducer``): its producer id, each send's body (its first word, the key
    the checker counts by, is ``<producer>/<session id>``), which sends are delayed and
    their priority; the times of its acknowledgements and its errors."""

    def _plan(self, name: str, topic: str, history: History, *, rate: float, window: int,
              delay_every: int, body_size: int, priorities: bool) -> None:
        self.producer = f"chaos-{name}-{time.monotonic_ns() % 10**9}"
        self.topic = topic
        self.history = history
        self.rate = rate
        self.window = window
        self.delay_every = delay_every
        self.priorities = priorities
        self.pad = b"." * max(0, body_size - 40)
        self.ack_times: list[float] = []
        self.errors: dict[str, int] = {}
        self.resends = 0
        self.failure: BaseException | None = None

    def key(self, session_id: int) -> bytes:
        return f"{self.producer}/{session_id}".encode()

    def body(self, session_id: int) -> bytes:
        return self.key(session_id) + b" " + self.pad

    def delayed(self, session_id: int) -> bool:
        """Sent as a delayed message: acknowledged with a dmq_delay id, stored in
        dmq_message under another id when it is due."""
        return bool(self.delay_every) and session_id % self.delay_every == 0

    def priority(self, session_id: int) -> int:
        """The priority its send carries (``priority_of``), 0 without ``priorities``."""
        return priority_of(session_id) if self.priorities else 0

    def _error(self, what: str) -> None:
        self.errors[what] = self.errors.get(what, 0) + 1


class Producer(SendPlan, threading.Thread):
    def __init__(self, name: str, addresses: Addresses, topic: str, history: History, *,
                 rate: float = 150.0, window: int = 16, delay_every: int = 10, body_size: int = 200,
                 priorities: bool = False):
        super().__init__(daemon=True, name=f"chaos-{name}")
        self._plan(name, topic, history, rate=rate, window=window, delay_every=delay_every, body_size=body_size,
                   priorities=priorities)
        self.addresses = addresses
        self.stopping = threading.Event()  # no new sends; finish what is outstanding
        self.halt = threading.Event()  # give up at once
        self._next = 0  # which address to try

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:  # reported by the scenario, never swallowed
            self.failure = exc

    def _frame(self, sid: int, resend: bool) -> Frame:
        delayed = self.delayed(sid)
        now_ms = int(time.time() * 1000)
        priority = self.priority(sid)
        return Frame(
            Command.UP_PRODUCER_RESEND if resend else Command.UP_PRODUCER_SEND,
            session_id=sid, topic=self.topic, producer=self.producer, timestamp_ms=now_ms,
            msg_type=MessageType.DELAY if delayed else MessageType.RELIABLE,
            due_ms=now_ms + 1000 if delayed else 0,
            status=encode_properties(Properties(priority=priority)) if priority else "",
            body=self.body(sid),
        )

    def _make(self, made: int, due: int, todo: deque[tuple[int, bool]]) -> int:
        """New sends, paced: session ids after ``made`` up to ``due``, no more than the
        window waiting in ``todo``; returns the last one made (``ordered.KeyedProducer``
        decides which of its keys may have one)."""
        while made < due and len(todo) < self.window:
            made += 1
            todo.append((made, False))
        return made

    def _acked(self, reply: Frame, now: float) -> None:
        """A send answered ``SEND_SUCCESS_ACK`` at ``now``."""
        self.history.ack(self.key(reply.session_id), reply.message_id, now)
        self.ack_times.append(now)

    def _run(self) -> None:
        todo: deque[tuple[int, bool]] = deque()  # (session id, resend)
        outstanding: set[int] = set()
        client: BlockingClient | None = None
        started = time.monotonic()
        made = 0
        while not self.halt.is_set():
            if self.stopping.is_set() and not todo and not outstanding:
                break
            try:
                if client is None:
                    addresses = self.addresses()
                    host, port = addresses[self._next % len(addresses)]
                    client = BlockingClient(host, port, producer=self.producer, timeout=3)
                if not self.stopping.is_set():
                    made = self._make(made, int((time.monotonic() - started) * self.rate), todo)
                frames = []
                while todo and len(outstanding) < self.window:
                    sid, resend = todo.popleft()
                    outstanding.add(sid)
                    if not resend:
                        self.history.attempt(self.key(sid), self.priority(sid))
                    frames.append(self._frame(sid, resend))
                if frames:
                    client.write(*frames)
                if not outstanding:
                    time.sleep(0.005)  # pacing: nothing to send or await yet
                    continue
                reply = client.next_send_reply(timeout=5)
            except (ClientError, OSError) as exc:
                self._error("connection" if "timed out" not in str(exc) else "no answer in 5s")
                if client is not None:
                    client.close()
                client = None
                self._next += 1  # the next node: what the client library's failover does
                self.resends += len(outstanding)
                todo.extendleft((sid, True) for sid in sorted(outstanding, reverse=True))
                outstanding.clear()
                self.halt.wait(0.1)
                continue
            if reply.session_id not in outstanding:
                continue  # the answer to a copy already answered
            outstanding.discard(reply.session_id)
            if reply.command == Command.SEND_SUCCESS_ACK:
                self._acked(reply, time.monotonic())
            elif reply.command in RETRYABLE:
                self._error(reply.command.name)
                self.resends += 1
                todo.append((reply.session_id, True))
                self.halt.wait(0.02)
            else:
                raise AssertionError(f"unexpected reply {reply.command.name}: {reply.status}")
        if client is not None:
            client.close()


class Consumer(threading.Thread):
    def __init__(self, name: str, addresses: Addresses, topic: str, channel: str, history: History, *,
                 credit: int = 200, hold: float = 0.0, node: int = 0, instance: int = 0):
        super().__init__(daemon=True, name=f"chaos-{name}")
        self.addresses = addresses
        self.topic = topic
        self.channel = channel
        self.history = history
        self.credit = credit
        self.hold = hold
        self.node = node
        self.instance = instance
        self.stop = threading.Event()
        self.killed = threading.Event()
        self.subscribed = threading.Event()
        # while set, pushes are taken and recorded but none is acknowledged: a consumer
        # slow to let go of its copies, whose node has no credit to push more
        self.stalled = threading.Event()
        self.in_flight: deque[tuple[float, Frame]] = deque()
        self.acks_sent = 0  # acks written to its connections
        self.errors: dict[str, int] = {}
        self.failure: BaseException | None = None
        self._client: BlockingClient | None = None

    def run(self) -> None:
        try:
            self._run()
        except BaseException as exc:
            self.failure = exc

    def kill(self) -> int:
        """Cut the connection with a RST, acking nothing more: the copies it holds are
        in flight at the server. Returns how many it held."""
        self.killed.set()
        held = len(self.in_flight)
        client = self._client
        if client is not None:
            sock = client._sock
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return held

    def held_ids(self) -> list[int]:
        """The message ids of the copies it holds, not acknowledged yet."""
        return [push.message_id for _, push in list(self.in_flight)]

    def _run(self) -> None:
        while not self.stop.is_set() and not self.killed.is_set():
            host, port = self.addresses()[self.node]
            try:
                client = self._client = BlockingClient(host, port, timeout=5)
                with client:
                    reply = client.subscribe(self.topic, self.channel, credit=self.credit)
                    if reply.command != Command.SUBSCRIBE_ACK:
                        raise ClientError(f"subscribe: {reply.command.name} {reply.status}")
                    self.subscribed.set()
                    self._consume(client)
            except (ClientError, OSError) as exc:
                if self.killed.is_set():
                    return
                what = str(exc).split(":")[0]
                self.errors[what] = self.errors.get(what, 0) + 1
                self.in_flight.clear()  # the server takes them back when the connection goes
                self.stop.wait(0.2)

    def _consume(self, client: BlockingClient) -> None:
        """Odd instances take every push already read and acknowledge what is due in one
        UP_CONSUMER_ACKS frame; even ones take one push at a time and ack each alone."""
        batch = self.instance % 2 == 1
        while not self.stop.is_set() and not self.killed.is_set():
            push = client.receive(timeout=0.05 if self.in_flight else 0.2)
            now = time.monotonic()
            while push is not None:
                key = push.body.split(b" ", 1)[0]
                priority = ReceivedMessage.properties_of(push.status).priority
                self.history.deliver(push.channel, key, push.message_id, now, self.node, priority)
                self.in_flight.append((now + self.hold, push))
                push = client.receive(timeout=0) if batch else None
            due = []
            while (self.in_flight and self.in_flight[0][0] <= now and not self.killed.is_set()
                   and not self.stalled.is_set()):
                due.append(self.in_flight.popleft()[1])
            if batch and due:
                client.ack_many(due)
            for held in due:
                if not batch:
                    client.ack(held)
                self.history.consumer_ack(held.channel, held.message_id, time.monotonic(), self.node)
            self.acks_sent += len(due)


class Confirmer(threading.Thread):
    """Marks acks durable once their delivery row is gone from the primary."""

    def __init__(self, dsn: str, topic: str, history: History, interval: float = 0.3):
        super().__init__(daemon=True, name="chaos-confirmer")
        self.dsn = dsn
        self.topic = topic
        self.history = history
        self.interval = interval
        self.stop = threading.Event()
        self.failures = 0

    def run(self) -> None:
        conn = None
        while not self.stop.wait(self.interval):
            conn = self.once(conn)
        if conn is not None:
            conn.close()

    def once(self, conn=None):
        import psycopg

        asked = time.monotonic()
        pending = self.history.unconfirmed()
        if not pending:
            return conn
        try:
            if conn is None or conn.closed:
                conn = psycopg.connect(self.dsn, autocommit=True, connect_timeout=2)
            by_channel: dict[str, list[int]] = {}
            for channel, mid in pending:
                by_channel.setdefault(channel, []).append(mid)
            for channel, ids in by_channel.items():
                rows = conn.execute(
                    "SELECT message_id FROM dmq_pending WHERE topic = %s AND channel = %s"
                    " AND message_id = ANY(%s)", (self.topic, channel, ids)).fetchall()
                still = {r[0] for r in rows}
                # taken after the answer: a push received later came after the ack was durable
                self.history.confirm([(channel, m) for m in ids if m not in still], time.monotonic(), asked)
        except Exception:  # the store is down or failing over: look again later
            self.failures += 1
            if conn is not None:
                conn.close()
            conn = None
        return conn


@dataclass(frozen=True)
class Stalls:
    """The consumers of ``channel`` (each with ``credit``) acknowledge nothing for
    ``stalled`` seconds of every ``period``, the first stall ``first`` seconds after the
    load starts, until the producers stop. Stalled, a node's consumers fill their credit
    within a few dozen pushes and the channel's copies wait in its memory window, which
    fills next (the nodes' ``--mem-queue-size`` is small: ``scenarios.WINDOW``)."""

    channel: str = "audit"
    credit: int = 25
    stalled: float = 2.5
    period: float = 4.0
    # from the start: the window is full a second or so later, before the scenarios' faults
    # (2 s in): a fault of PostgreSQL stops the commits that fill it
    first: float = 0.0
    # the first stall lasts until the window was seen full (``Staller.filled``), at most this
    # long: on a loaded machine 2.5 s of sends may not fill it, and every scenario's report
    # asserts it filled (the priority race of issue 45 §3 needs a full window)
    fill_within: float = 20.0


class Staller(threading.Thread):
    """Sets and clears the ``stalled`` event of the consumers of one channel (``Stalls``);
    consumers added meanwhile join at the next stall. The first stall goes on until
    ``filled`` is set (by whoever watches the window: ``window.WindowWatch``) or
    ``fill_within`` seconds; the next ones follow the period from its end."""

    def __init__(self, stalls: Stalls, consumers: Callable[[], list[Consumer]], filled: threading.Event):
        super().__init__(daemon=True, name="chaos-staller")
        self.stalls = stalls
        self.consumers = consumers
        self.filled = filled
        self.stop = threading.Event()
        self.count = 0  # stalls begun

    def _set(self, stalled: bool) -> None:
        for c in self.consumers():
            if c.channel == self.stalls.channel:
                (c.stalled.set if stalled else c.stalled.clear)()

    def run(self) -> None:
        s = self.stalls
        began = time.monotonic() + s.first
        try:
            while not self.stop.wait(max(0.0, began + self.count * s.period - time.monotonic())):
                self._set(True)
                self.count += 1
                if self.stop.wait(s.stalled):
                    break
                if self.count == 1 and not self.filled.is_set():
                    start = time.monotonic()
                    deadline = start + s.fill_within
                    while not self.filled.wait(0.1):  # an event set by the watch, polled for stop
                        if self.stop.is_set() or time.monotonic() > deadline:
                            break
                    began += time.monotonic() - start  # the next stalls keep their period
                    if self.stop.is_set():
                        break
                self._set(False)
        finally:
            self._set(False)


class Load:
    """``producers`` producers spread over the nodes (sending with priorities when
    ``priorities``), ``consumers`` consumers per channel (each connected to every node),
    those of one channel stalled again and again with ``stalls``."""

    def __init__(self, addresses: Addresses, topic: str, channels: list[str], dsn: str, *,
                 producers: int = 3, consumers: int = 2, rate: float = 150.0, hold: float = 0.0,
                 priorities: bool = False, stalls: Stalls | None = None):
        self.topic = topic
        # set by the scenario's window watch once the stalled channel's window was full
        self.window_filled = threading.Event()
        self.addresses = addresses
        self.channels = list(channels)
        self.hold = hold
        self.stalls = stalls
        self.notes: dict[str, object] = {}
        self.history = History(channels)
        self.producers = [Producer(f"p{i}", _rotated(addresses, i), topic, self.history, rate=rate,
                                   priorities=priorities)
                          for i in range(producers)]
        self.consumers: list[Consumer] = []
        self.instances = {ch: 0 for ch in channels}
        self.add_consumers(consumers, start=False)
        self.confirmer = Confirmer(dsn, topic, self.history)
        self.staller = Staller(stalls, lambda: list(self.consumers), self.window_filled) if stalls is not None else None

    def start(self, timeout: float = 30.0) -> None:
        for c in self.consumers:
            c.start()
        for c in self.consumers:
            if not c.subscribed.wait(timeout):
                raise RuntimeError(f"{c.name} could not subscribe: {c.errors}")
        self.confirmer.start()
        if self.staller is not None:
            self.staller.start()
        for p in self.producers:
            p.start()

    def add_consumers(self, per_channel: int, start: bool = True, channels: list[str] | None = None) -> None:
        """``per_channel`` more consumers on each channel (or on ``channels``), each
        connected to every node."""
        nodes = len(self.addresses())
        for ch in channels or self.channels:
            for _ in range(per_channel):
                instance = self.instances[ch]
                self.instances[ch] += 1
                credit = self.stalls.credit if self.stalls is not None and ch == self.stalls.channel else 200
                for node in range(nodes):
                    consumer = Consumer(f"c-{ch}-{instance}-n{node + 1}", self.addresses, self.topic, ch,
                                        self.history, credit=credit, hold=self.hold, node=node, instance=instance)
                    self.consumers.append(consumer)
                    if start:
                        consumer.start()

    def stop_producing(self, timeout: float = 60.0) -> None:
        """No new sends, the stalls end (the drain goes at the consumers' pace); returns
        once every send was answered or given up."""
        self._end_stalls()
        for p in self.producers:
            p.stopping.set()
        deadline = time.monotonic() + timeout
        for p in self.producers:
            p.join(max(0.1, deadline - time.monotonic()))
        for p in self.producers:
            p.halt.set()
            p.join(10)

    def wait_delivered(self, timeout: float) -> bool:
        """Until every acked send reached every channel (True), or the deadline (False)."""
        deadline = time.monotonic() + timeout
        while any(self.history.missing().values()):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    def _end_stalls(self) -> None:
        if self.staller is not None and self.staller.is_alive():
            self.staller.stop.set()
            self.staller.join(10)
            self.notes["stalls"] = self.staller.count

    def stop(self) -> None:
        self._end_stalls()
        for c in self.consumers:
            c.stop.set()
        for c in self.consumers:
            c.join(10)
        self.confirmer.stop.set()
        self.confirmer.join(10)
        self.confirm_now()  # a last look, after the consumers stopped

    def confirm_now(self) -> None:
        """One look of the confirmer's, from the calling thread: every ack durable by
        now is confirmed by the time it returns (the confirmer's own looks come every
        ``interval``)."""
        conn = self.confirmer.once()
        if conn is not None:
            conn.close()

    def immediate(self, key: bytes) -> bool:
        """Whether the send ``key`` was stored at once (its acknowledged id is its
        dmq_message id), not delayed."""
        producer, sid = key.decode().rsplit("/", 1)
        return not any(p.producer == producer and p.delayed(int(sid)) for p in self.producers)

    def failures(self) -> list[str]:
        return [f"{t.name}: {t.failure!r}" for t in (*self.producers, *self.consumers) if t.failure]


def _rotated(addresses: Addresses, shift: int) -> Addresses:
    """The same addresses, starting at another node: producers spread over the nodes."""
    def rotated() -> list[tuple[str, int]]:
        found = addresses()
        k = shift % len(found)
        return found[k:] + found[:k]
    return rotated
