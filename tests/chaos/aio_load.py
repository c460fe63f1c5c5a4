"""The chaos load of ``load.py`` made of asyncio clients (``dmq_client.aio.Client``, issue 47).

``AioLoad`` is a ``Load`` whose producers and consumers are coroutines on one event loop,
run in a thread of its own, so the scenario's runner (``scenarios.run``), the ``Staller``,
the ``Confirmer``, the window watch and the report drive it as they drive the threaded
load: it records into the same ``History`` the same way (attempted before the first write,
acknowledged with the id ``SEND_SUCCESS_ACK`` carried, every push the consumer is handed
and every ack it sends, with the node of the connection), so ``checker.check`` counts it.

What differs is what the client does by itself, which is what is under test:

* ``AioProducer``: one ``Client`` per producer given every node's address (as a service
  without ZooKeeper configures it), paced sends (one in ten a DELAY due a second
  later, two in three with a priority, as ``Producer``), each awaited in a task of its
  own, at most ``window`` unanswered in the client (``max_in_flight``: its backpressure)
  and twice that awaiting. Resends under the same session id, failover when a node dies
  or says it is shutting down, and the wait for a server are the client's. A send it
  reports not stored (``NO_TOPIC``, ``SOCKET_ERROR``, the outcome-unknown ones) is sent
  again under its session id; if an earlier try was stored after all, the server refuses
  it as already stored and the send stays unacknowledged (the checker counts it
  "unacknowledged delivered"; ``Client.resend(result)`` would write ``UP_PRODUCER_RESEND``
  and be answered with the stored id: the load keeps the plain send, the harder case).
* ``AioConsumer``: one ``Client`` per consumer, subscribed on every node by the client
  itself (``async for message in client.subscribe(...)``), acknowledging with ``await
  message.ack()`` (after ``hold`` seconds; never while ``stalled``). Even instances keep
  the client's duplicate suppression, as an application has it; odd ones turn it off (a
  window of a microsecond) so that they are handed every push the nodes make, as the
  threaded consumers record them: a push after a durable ack cannot hide in the client.
  A delivery is recorded when the iteration hands the message out (the client's queue is
  between the socket and it; the acks go from a task of their own, so it stays short), and
  an ack when ``ack()`` returned, also when the client wrote nothing because the connection
  the copy came on was gone (the node gives that copy again; the confirmer sees the ack
  durable only once some ack of the copy is). One first push in ``REQUEUE_EVERY`` (by id)
  is given back instead, ``await message.requeue(REQUEUE_DELAY)``, while the load runs:
  ``Requeues`` counts that each comes back to some consumer of its channel after the
  requeue (kill -9 included: a requeue written to a node that dies is answered by nobody,
  and the copy must come back by the takeover), and the drain waits for them.

Every wait is bounded and everything stops by itself; sockets go to loopback addresses only.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from typing import Any, Coroutine, TypeVar

from dmq_client import Message, SendResult, Status
from dmq_client.aio import AioMessage, Client, RequeueError
from dmq_client.aio.link import LinkState, ServerLink
from dmq_client.routing import affinity

from .checker import History
from .load import Addresses, Load, SendPlan, Stalls

__all__ = ["AioLoad", "AioProducer", "AioConsumer", "topic_served_by"]

T = TypeVar("T")

# sent again under the same session id: not stored, or not known to be
AGAIN = (Status.NO_TOPIC, Status.SOCKET_ERROR, Status.SERVER_ERROR, Status.OUT_OF_RETRY, Status.CLIENT_CLOSED,
         Status.RATE_LIMIT_EXCEEDED)
# the clients' settings: a node that comes back is used again within a second
CLIENT = {"reconnect_backoff": 0.1, "reconnect_backoff_max": 0.5, "connect_timeout": 3.0}
# and the producers': a send whose answer never comes (on a connection that stays up) is
# written again after 2 s, for a minute before OUT_OF_RETRY
PRODUCER = {**CLIENT, "resend_interval": 2.0, "resend_check_interval": 0.25, "resend_tries": 30,
            "close_timeout": 2.0}
# a consumer gives back one first push in REQUEUE_EVERY (by message id), due again after
# REQUEUE_DELAY seconds
REQUEUE_EVERY = 20
REQUEUE_DELAY = 0.2


class Requeues:
    """The copies consumers gave back (``made``) and their pushes after that (``seen``),
    per channel: each must come back. Used on the load's event loop only."""

    def __init__(self) -> None:
        self.open = True  # consumers requeue while the load runs
        self.made: dict[tuple[str, int], float] = {}  # (channel, id) -> when it was given back
        self.returned: set[tuple[str, int]] = set()
        self.refused = 0  # requeues whose connection went before the answer (RequeueError)

    def seen(self, channel: str, message_id: int, at: float) -> None:
        made = self.made.get((channel, message_id))
        if made is not None and at >= made:
            self.returned.add((channel, message_id))

    def outstanding(self) -> list[tuple[str, int]]:
        return sorted(set(self.made) - self.returned)


def topic_served_by(addresses: list[tuple[str, int]], node: int, prefix: str) -> str:
    """A topic name starting with ``prefix`` that the clients send to node ``node`` while it
    is up (``routing.affinity``: every client sends a topic to the same server), so its
    producers fail over when that node dies and its copies are the ones taken over."""
    servers = [f"{host}:{port}" for host, port in addresses]
    for n in range(100_000):
        topic = f"{prefix}_{n}"
        if max(servers, key=lambda s: affinity(topic, s)) == servers[node]:
            return topic
    raise RuntimeError(f"no topic {prefix}_N is served by {servers[node]}")  # 1 in 3 are, each N


class _Client(Client):
    """The asyncio client with an event set while every one of its servers is connected
    (``Client`` has one for any: ``wait_connected``)."""

    def __init__(self, **settings: Any):
        super().__init__(**settings)
        self.all_ready = asyncio.Event()

    async def __aenter__(self) -> "_Client":
        await self.start()
        return self

    def link_ready(self, link: ServerLink) -> None:
        super().link_ready(link)
        if all(other.state is LinkState.READY for other in self.links.values()):
            self.all_ready.set()

    def link_leaving(self, link: ServerLink) -> None:
        self.all_ready.clear()
        super().link_leaving(link)


class _Stall:
    """An asyncio consumer's ``stalled`` flag, set and cleared from other threads (the
    ``Staller``, a scenario) as the threaded consumer's ``threading.Event`` is; its acker
    waits on ``flowing``, the loop's side of it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.flowing = asyncio.Event()
        self.flowing.set()
        self._stalled = False

    def _post(self, change: Any) -> None:
        if not self.loop.is_closed():
            self.loop.call_soon_threadsafe(change)

    def set(self) -> None:
        self._stalled = True
        self._post(self.flowing.clear)

    def clear(self) -> None:
        self._stalled = False
        self._post(self.flowing.set)

    def is_set(self) -> bool:
        return self._stalled


class AioProducer(SendPlan):
    def __init__(self, name: str, servers: list[str], topic: str, history: History, *, rate: float = 150.0,
                 window: int = 16, delay_every: int = 10, body_size: int = 200, priorities: bool = False):
        self._plan(name, topic, history, rate=rate, window=window, delay_every=delay_every, body_size=body_size,
                   priorities=priorities)
        self.name = f"chaos-{name}"
        self.servers = servers
        self.stopping = asyncio.Event()  # no new sends; finish what is outstanding
        self.written_again = 0  # acknowledged after more than one write (the client's resends, failovers)
        self.answered_duplicate = 0  # acknowledged as a resend of a message already stored
        self.acked_by: dict[str, list[float]] = {}  # server -> when it acknowledged each send
        self.client: _Client | None = None

    async def run(self, ready_within: float) -> None:
        try:
            async with _Client(servers=self.servers, producer_id=self.producer, max_in_flight=self.window,
                               **PRODUCER) as client:
                self.client = client
                async with asyncio.timeout(ready_within):
                    await client.all_ready.wait()
                await self._produce(client)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # reported by the scenario, never swallowed
            self.failure = exc

    async def _produce(self, client: _Client) -> None:
        started = time.monotonic()
        room = asyncio.Semaphore(2 * self.window)  # awaiting: in the client's window, or waiting for room in it
        sending: set[asyncio.Task[None]] = set()

        def done(task: asyncio.Task[None]) -> None:
            sending.discard(task)
            room.release()
            if not task.cancelled() and task.exception() is not None and self.failure is None:
                self.failure = task.exception()

        made = 0
        while not self.stopping.is_set():
            due = int((time.monotonic() - started) * self.rate)
            while made < due and not self.stopping.is_set():
                await room.acquire()
                made += 1
                task = asyncio.get_running_loop().create_task(self._send(client, made))
                sending.add(task)
                task.add_done_callback(done)
            try:  # the pace: until the next send is due, or the stop
                async with asyncio.timeout(max(0.0, started + (made + 1) / self.rate - time.monotonic())):
                    await self.stopping.wait()
            except TimeoutError:
                pass
        if sending:
            await asyncio.wait(set(sending))

    async def _send(self, client: _Client, sid: int) -> None:
        key = self.key(sid)
        priority = self.priority(sid)
        self.history.attempt(key, priority)
        body = self.body(sid)
        if self.delayed(sid):
            message = Message.delayed(self.topic, body, delay=1.0, session_id=sid, priority=priority)
        else:
            message = Message(self.topic, body, session_id=sid, priority=priority)
        while True:
            result: SendResult = await client.send(message)
            now = time.monotonic()
            if result.status is Status.SUCCESS:
                assert result.message_id is not None
                self.history.ack(key, result.message_id, now)
                self.ack_times.append(now)
                self.written_again += result.attempts > 1
                self.answered_duplicate += bool(result.duplicate)
                server = result.server or "?"
                self.acked_by.setdefault(server, []).append(now)
                return
            self._error(result.status.name)
            if result.status is Status.INVALID_MESSAGE and "already stored" in result.description:
                return  # an earlier try was stored, its answer lost: delivered, never acknowledged
            if result.status not in AGAIN:
                raise AssertionError(f"send {key!r}: unexpected {result.status.name}: {result.description}")
            self.resends += 1
            await asyncio.sleep(0.05)  # a retry's pause


class AioConsumer:
    def __init__(self, name: str, servers: list[str], topic: str, channel: str, history: History, *,
                 loop: asyncio.AbstractEventLoop, credit: int = 200, hold: float = 0.0, instance: int = 0,
                 requeues: Requeues | None = None):
        self.name = f"chaos-{name}"
        self.requeues = requeues
        self.servers = servers
        self.topic = topic
        self.channel = channel
        self.history = history
        self.credit = credit
        self.hold = hold
        self.instance = instance
        self.suppress = instance % 2 == 0  # the client's duplicate suppression, as an application has it
        self.stalled = _Stall(loop)
        self.held: deque[tuple[float, AioMessage]] = deque()  # (ack due at, message)
        self._more = asyncio.Event()  # something was added to ``held``
        self.acks_sent = 0
        self.failure: BaseException | None = None
        self.client: _Client | None = None

    async def run(self, subscribed: asyncio.Event) -> None:
        settings: dict[str, Any] = {} if self.suppress else {"dedup_max_age": 1e-6}
        try:
            async with _Client(servers=self.servers, **CLIENT, **settings) as client:
                self.client = client
                acker = asyncio.get_running_loop().create_task(self._ack())
                try:
                    subscription = client.subscribe(self.topic, self.channel, credit=self.credit)
                    await client.all_ready.wait()  # every node greeted; each subscribes it on its own
                    subscribed.set()
                    async for message in subscription:
                        now = time.monotonic()
                        key = message.body.split(b" ", 1)[0]
                        self.history.deliver(message.channel, key, message.message_id, now, self._node(message),
                                             message.priority)
                        if self.requeues is not None:
                            self.requeues.seen(message.channel, message.message_id, now)
                        self.held.append((now + self.hold, message))
                        self._more.set()
                finally:
                    acker.cancel()
                    await asyncio.gather(acker, return_exceptions=True)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.failure = exc

    def _node(self, message: AioMessage) -> int:
        return self.servers.index(message.server) if message.server in self.servers else -1

    async def _ack(self) -> None:
        flowing = self.stalled.flowing
        while True:
            await flowing.wait()
            if not self.held:
                self._more.clear()
                await self._more.wait()
                continue
            due, message = self.held[0]
            if due > time.monotonic():
                await asyncio.sleep(due - time.monotonic())  # the hold: the scenario's pace
                continue
            self.held.popleft()
            requeues = self.requeues
            if (requeues is not None and requeues.open and message.attempts == 1
                    and message.message_id % REQUEUE_EVERY == 0):
                requeues.made[(message.channel, message.message_id)] = time.monotonic()
                try:
                    await message.requeue(REQUEUE_DELAY)
                except RequeueError:  # its connection went first: the node's successor gives it back
                    requeues.refused += 1
                continue
            await message.ack()
            self.history.consumer_ack(message.channel, message.message_id, time.monotonic(), self._node(message))
            self.acks_sent += 1


class AioLoad(Load):
    """``Load``'s shape and interface (``producers`` producers, ``consumers`` consumers per
    channel, ``stalls``), with asyncio producers and consumers on one event loop in a thread
    of its own; each consumer is one client connected to every node."""

    def __init__(self, addresses: Addresses, topic: str, channels: list[str], dsn: str, *,
                 producers: int = 3, consumers: int = 2, rate: float = 150.0, hold: float = 0.0,
                 priorities: bool = False, stalls: Stalls | None = None):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True, name="chaos-aio-loop")
        self.servers = [f"{host}:{port}" for host, port in addresses()]
        # the history, confirmer, staller and notes of ``Load``; its threads are never made
        super().__init__(addresses, topic, channels, dsn, producers=0, consumers=0, rate=rate, hold=hold,
                         priorities=priorities, stalls=stalls)
        self.producers: list[AioProducer] = [  # type: ignore[assignment]
            AioProducer(f"aio-p{i}", self.servers, topic, self.history, rate=rate, priorities=priorities)
            for i in range(producers)]
        self.consumers: list[AioConsumer] = []  # type: ignore[assignment]
        self.requeues = Requeues()
        self.add_consumers(consumers, start=False)
        self._tasks: dict[str, asyncio.Task[None]] = {}

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def _spawn(self, consumer: AioConsumer) -> asyncio.Event:
        subscribed = asyncio.Event()
        self._tasks[consumer.name] = self.loop.create_task(consumer.run(subscribed), name=consumer.name)
        return subscribed

    def add_consumers(self, per_channel: int, start: bool = True, channels: list[str] | None = None) -> None:
        for ch in channels or self.channels:
            for _ in range(per_channel):
                instance = self.instances[ch]
                self.instances[ch] += 1
                credit = self.stalls.credit if self.stalls is not None and ch == self.stalls.channel else 200
                consumer = AioConsumer(f"aio-c-{ch}-{instance}", self.servers, self.topic, ch, self.history,
                                       loop=self.loop, credit=credit, hold=self.hold, instance=instance,
                                       requeues=self.requeues)
                self.consumers.append(consumer)
                if start:
                    self.loop.call_soon_threadsafe(self._spawn, consumer)

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        self._call(self._start(timeout), timeout + 5)
        self.confirmer.start()
        if self.staller is not None:
            self.staller.start()
        self._call(self._start_producers(timeout), 5)

    async def _start(self, timeout: float) -> None:
        waits = [(c, self._spawn(c)) for c in self.consumers]
        for c, subscribed in waits:
            try:
                async with asyncio.timeout(timeout):
                    await subscribed.wait()
            except TimeoutError:
                raise RuntimeError(f"{c.name} not connected to every node within {timeout} s: "
                                   f"{c.failure!r} {c.client and c.client.links}") from None

    async def _start_producers(self, ready_within: float) -> None:
        for p in self.producers:
            self._tasks[p.name] = asyncio.get_running_loop().create_task(p.run(ready_within), name=p.name)

    def stop_producing(self, timeout: float = 60.0) -> None:
        self._end_stalls()
        self._call(self._stop_producing(timeout), timeout + 20)
        self.loop.call_soon_threadsafe(setattr, self.requeues, "open", False)

    def wait_delivered(self, timeout: float) -> bool:
        """``Load``'s wait, then until every copy given back came back (False at the deadline)."""
        deadline = time.monotonic() + timeout
        if not super().wait_delivered(timeout):
            return False
        while self._call(self._outstanding(), 5):
            if time.monotonic() > deadline:
                return False
            time.sleep(0.1)
        return True

    async def _outstanding(self) -> list[tuple[str, int]]:
        return self.requeues.outstanding()

    async def _stop_producing(self, timeout: float) -> None:
        """No new sends; each producer's client gets ``timeout`` seconds to have every one
        answered, then it is cancelled (its sends, detached, end as the client says)."""
        for p in self.producers:
            p.stopping.set()
        tasks = [self._tasks[p.name] for p in self.producers if p.name in self._tasks]
        if tasks:
            _, late = await asyncio.wait(tasks, timeout=timeout)
            for task in late:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def stop(self) -> None:
        self._end_stalls()
        if self.thread.is_alive():
            try:
                self._call(self._close(), 30)
            finally:
                self.loop.call_soon_threadsafe(self.loop.stop)
                self.thread.join(10)
        if not self.thread.is_alive() and not self.loop.is_closed():
            self.loop.close()
        self.confirmer.stop.set()
        self.confirmer.join(10)
        self.confirm_now()
        self.notes["aio"] = self.figures()

    async def _close(self) -> None:
        """Close every client (a producer's still running is cancelled first); wait for
        every task of the load to end."""
        for p in self.producers:
            p.stopping.set()
        for c in self.consumers:
            if c.client is not None:
                await c.client.close()  # ends the iteration: the consumer's task returns
        tasks = list(self._tasks.values())
        _, late = await asyncio.wait(tasks, timeout=10) if tasks else (set(), set())
        for task in late:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def figures(self) -> dict[str, Any]:
        """What the clients did: per node (1..n), the sends it acknowledged, the longest
        time without one while others were acknowledged (a node down, or not the topic's
        server) and how many it acknowledged after that gap; the sends acknowledged after
        more than one write and as already stored; the pushes the suppressing consumers'
        clients kept from them."""
        times: dict[str, list[float]] = {}
        for p in self.producers:
            for server, acked in p.acked_by.items():
                name = f"node{self.servers.index(server) + 1}" if server in self.servers else server
                times.setdefault(name, []).extend(acked)
        end = max((t for acked in times.values() for t in acked), default=0.0)
        by_node = {}
        for name, acked in sorted(times.items()):
            acked.sort()
            gaps = [(b - a, i + 1) for i, (a, b) in enumerate(zip(acked, [*acked[1:], end]))]
            gap, after = max(gaps)
            by_node[name] = {"acked": len(acked), "longest_gap_s": round(gap, 2), "acked_after_it": len(acked) - after}
        return {
            "by_node": by_node,
            "acked_after_more_writes": sum(p.written_again for p in self.producers),
            "acked_as_already_stored": sum(p.answered_duplicate for p in self.producers),
            "pushes_suppressed": sum(c.client.dedup.suppressed for c in self.consumers
                                     if c.client is not None and c.suppress),
            "requeued": len(self.requeues.made),
            "requeues_refused": self.requeues.refused,
            "requeued_not_back": self.requeues.outstanding()[:20],
        }

    def failures(self) -> list[str]:
        roles: list[AioProducer | AioConsumer] = [*self.producers, *self.consumers]
        return [f"{t.name}: {t.failure!r}" for t in roles if t.failure]
