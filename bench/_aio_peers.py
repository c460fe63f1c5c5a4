"""asyncio clients at one window, for ``client_publish.py``: the harness, and nats-py and aio-pika as a user writes them.

``client_publish.py`` compares what an application pays in its own process to
publish through dmq's asyncio client and through the peers' ordinary asyncio
clients, each to its own private server. So unlike ``_nats.py`` and
``_rabbit.py`` (load generators that splice templates to leave the cores to the
server), these use the public API the way their documentation shows:

* nats-py: ``await js.publish(subject, body)`` (a request whose answer is the
  PubAck) and a durable push consumer with explicit acks,
  ``async for msg in sub.messages: await msg.ack()``;
* aio-pika: a channel with publisher confirms,
  ``await exchange.publish(Message(body, delivery_mode=PERSISTENT), queue)`` to a
  durable queue (it returns once the broker confirmed), and
  ``async for message in queue.iterator(): await message.ack()`` with a prefetch.

The harness is shared with dmq's own asyncio runs so that every client is driven
alike: ``window`` tasks each awaiting its publishes one after another (at most
``window`` unanswered), a consumer task acking each message as it comes, and the
process's CPU time (``time.process_time``: all threads) and wall time around
the measured part. A run publishes ``WARM`` messages first (connections, caches,
the consumer's first deliveries) and measures the next ``count``.

Each run gets its own connections and, for the peers, a fresh stream or purged
queue, so no run consumes another's messages.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Awaitable, Callable

WARM = 200
TIMEOUT = 600.0  # seconds a measured run may take before it counts as failed

SendOne = Callable[[], Awaitable[bool]]  # one publish, awaited to its answer: acknowledged or not


def shares(count: int, window: int) -> list[int]:
    """``count`` split over ``window`` tasks as evenly as it goes (the first get one more)."""
    return [count // window + (1 if i < count % window else 0) for i in range(window) if i < count]


async def publish_window(send_one: SendOne, count: int, window: int) -> int:
    """``count`` publishes by ``window`` tasks, each awaiting its own one after another;
    returns how many were not acknowledged."""
    failed = 0

    async def sender(n: int) -> None:
        nonlocal failed
        for _ in range(n):
            if not await send_one():
                failed += 1

    await asyncio.gather(*(sender(n) for n in shares(count, window)))
    return failed


class Tally:
    """Messages the consumer acked; ``reached`` is set at the expected count."""

    def __init__(self) -> None:
        self.acked = 0
        self.expected = 0
        self.reached = asyncio.Event()

    def expect(self, n: int) -> None:
        self.acked, self.expected = 0, n
        self.reached.clear()

    def count(self) -> None:
        self.acked += 1
        if self.acked >= self.expected:
            self.reached.set()


async def consume(messages: AsyncIterator[Any], tally: Tally) -> None:
    """What a consumer does with each message here: ack it (awaited), then count it."""
    async for message in messages:
        await message.ack()
        tally.count()


async def measure_publish(send_one: SendOne, count: int, window: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) for ``count`` acknowledged publishes after a warm-up."""
    failed = await publish_window(send_one, WARM, window)
    cpu, wall = time.process_time(), time.perf_counter()
    failed += await publish_window(send_one, count, window)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    if failed:
        raise RuntimeError(f"{failed} publishes not acknowledged")
    return wall, cpu


async def measure_e2e(send_one: SendOne, messages: AsyncIterator[Any], count: int,
                      window: int) -> tuple[float, float]:
    """(wall seconds, process CPU seconds) from the first publish of ``count`` to the consumer's
    ack of the last of them, publishing and consuming at once in this process."""
    tally = Tally()
    consumer = asyncio.ensure_future(consume(messages, tally))
    try:
        tally.expect(WARM)
        failed = await publish_window(send_one, WARM, window)
        await _reached(tally, consumer, 60)
        tally.expect(count)
        cpu, wall = time.process_time(), time.perf_counter()
        failed += await publish_window(send_one, count, window)
        await _reached(tally, consumer, TIMEOUT)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    finally:
        consumer.cancel()
        await asyncio.gather(consumer, return_exceptions=True)
    if failed:
        raise RuntimeError(f"{failed} publishes not acknowledged")
    return wall, cpu


async def _reached(tally: Tally, consumer: "asyncio.Future[Any]", timeout: float) -> None:
    waiting: asyncio.Future[Any] = asyncio.ensure_future(tally.reached.wait())
    done, _ = await asyncio.wait((waiting, consumer), timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    if waiting not in done:
        waiting.cancel()
        if consumer in done:
            consumer.result()  # the consumer's error, if it raised one
            raise RuntimeError(f"the consumer stopped after {tally.acked} of {tally.expected} messages")
        raise TimeoutError(f"the consumer acked {tally.acked} of {tally.expected} messages within {timeout}s")


# ---------------------------------------------------------------- nats-py


async def nats_publish(url: str, subject: str, count: int, body: bytes, window: int) -> tuple[float, float]:
    import nats

    nc = await nats.connect(url, allow_reconnect=False)
    try:
        js = nc.jetstream()

        async def send_one() -> bool:
            await js.publish(subject, body, timeout=60)  # raises unless the PubAck came
            return True

        return await measure_publish(send_one, count, window)
    finally:
        await nc.close()


async def nats_e2e(url: str, subject: str, count: int, body: bytes, window: int) -> tuple[float, float]:
    import nats
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

    producer = await nats.connect(url, allow_reconnect=False)
    consumer = await nats.connect(url, allow_reconnect=False)
    try:
        js = producer.jetstream()
        sub = await consumer.jetstream().subscribe(
            subject, durable="e2e", manual_ack=True,
            config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT, deliver_policy=DeliverPolicy.ALL,
                                  max_ack_pending=window, ack_wait=60),
        )

        async def send_one() -> bool:
            await js.publish(subject, body, timeout=60)
            return True

        return await measure_e2e(send_one, sub.messages, count, window)
    finally:
        await consumer.close()
        await producer.close()


# ---------------------------------------------------------------- aio-pika


async def _rabbit_sender(port: int, queue: str, body: bytes) -> tuple[Any, SendOne]:
    """A connection and a publish of one persistent message to the durable queue, awaited
    to its publisher confirm: True for a Basic.Ack, False for a Nack."""
    import aio_pika
    from pamqp.commands import Basic

    conn = await aio_pika.connect(host="127.0.0.1", port=port)
    channel = await conn.channel(publisher_confirms=True)
    exchange = channel.default_exchange

    async def send_one() -> bool:
        message = aio_pika.Message(body, delivery_mode=aio_pika.DeliveryMode.PERSISTENT)
        return isinstance(await exchange.publish(message, routing_key=queue), Basic.Ack)

    return conn, send_one


async def rabbit_publish(port: int, queue: str, count: int, body: bytes, window: int) -> tuple[float, float]:
    conn, send_one = await _rabbit_sender(port, queue, body)
    try:
        return await measure_publish(send_one, count, window)
    finally:
        await conn.close()


async def rabbit_e2e(port: int, queue: str, count: int, body: bytes, window: int) -> tuple[float, float]:
    import aio_pika

    conn, send_one = await _rabbit_sender(port, queue, body)
    consumer = await aio_pika.connect(host="127.0.0.1", port=port)
    try:
        channel = await consumer.channel()
        await channel.set_qos(prefetch_count=window)
        declared = await channel.declare_queue(queue, durable=True)
        iterator = declared.iterator()
        try:
            return await measure_e2e(send_one, iterator, count, window)
        finally:
            await iterator.close()
    finally:
        await consumer.close()
        await conn.close()
