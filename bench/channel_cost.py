"""dmq-server's CPU per delivered copy, without sockets or PostgreSQL: the push and ack path.

In the fan-out benchmark (``bench/reliable.py`` e2e4) each message is pushed and acked
once per channel, and the profile puts about half of dmq-server's samples in that
path: ``ReliableChannel.add`` down to the frame the connection writes, and
``ack_held`` down to the row the durable ack batches. This runs exactly that code, 4
channels with a consumer each (``DmqSubscription`` on a stand-in connection that keeps
the bytes), in rounds of 100 messages pushed to every channel and then acked in one
``UP_CONSUMER_ACKS``'s worth per channel, and prints the CPU per copy for each half.
The durable-ack callback is the store's own (``ReliableStore._on_acks``), its acker a list.

Time on a shared 2-core virtual machine drifts by a third from minute to minute, which
hides a change of a few per cent; ``--instructions`` counts instructions instead
(``_cost.py``: valgrind's cachegrind, repeated counts agree within 1 %).
``message_cost.py`` measures the whole path of a message with one channel, the
publish half included.

    python bench/channel_cost.py                               # this tree, 5 rounds
    python bench/channel_cost.py --tree /tmp/old --tree . --rounds 7
    python bench/channel_cost.py --tree /tmp/old --tree . --instructions
"""

from __future__ import annotations

import gc
import sys
from types import SimpleNamespace
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import _cost as cost  # noqa: E402

CHANNELS = 4
BATCH = 100


def child(messages: int, check: bool = False) -> dict:
    """Run in a fresh interpreter whose path starts with the tree under test. ``check``
    decodes each round's frames and counts its ack rows (the unit test's run): off for a
    measurement, whose instruction count would include the decoding."""
    from dmq_client.wire import Command, FrameDecoder
    from dmq_client.wire.codec import PushEncoder
    from dmq_server.core.buckets import Buckets
    from dmq_server.reliable.store import ReliableStore
    from dmq_server.protocols.dmq import DmqSubscription
    from dmq_server.reliable.channel import ReliableChannel, ReliableMessage

    class Clock:
        def seconds(self) -> float:
            return 1000.0

    class Connection:
        """What DmqSubscription.push needs of a DmqConnection."""

        blocked = False  # its client reads what it is sent (DmqSubscription.credit)

        closed = False
        peer = "127.0.0.1:1"

        def __init__(self) -> None:
            self.push_frame = PushEncoder()
            self.subscriptions: dict = {}
            self.out: list[bytes] = []

        def queue_write(self, data: bytes) -> None:
            self.out.append(data)

        def queue_parts(self, parts: tuple[bytes, ...]) -> None:
            self.out += parts

    rows: list = []  # what the store hands its acker: an AckRow per ack, or an AckRun per ack_held call
    store = SimpleNamespace(acker=SimpleNamespace(add_many=rows.extend))

    def on_acks(channel, deliveries, acked_ms, consumer) -> None:
        """The store's own durable-ack callback, its acker a list."""
        ReliableStore._on_acks(store, channel, deliveries, acked_ms, consumer)

    clock = Clock()
    pairs = []
    for i in range(CHANNELS):
        channel = ReliableChannel("orders", f"c{i}", clock=clock, msg_timeout=60.0, mem_queue_size=10_000,
                                  load=lambda *a: None, on_acks=on_acks,
                                  deliver_latency=Buckets([0.001 * 2**k for k in range(16)]))
        channel.backlog = False  # nothing waits in PostgreSQL: every copy is pushed at once
        connection = Connection()
        subscription = DmqSubscription(connection, 256)
        channel.subscribe(subscription)
        pairs.append((channel, subscription, connection))
    body = b"x" * 200
    push_cpu = ack_cpu = 0.0
    next_id = 0
    gc.disable()  # the server runs with GC on, but its pauses would land in one half at random
    for _ in range(messages // BATCH):
        batch = []
        for _ in range(BATCH):
            next_id += 1
            batch.append(ReliableMessage(next_id, "orders", "p1", next_id, 1_000_000, body, 1))
        ids = [m.message_id for m in batch]
        start = time.process_time()
        for channel, _, _ in pairs:
            if hasattr(channel, "add_many"):  # a group commit's copies in one call (the store's)
                channel.add_many(batch)
            else:
                for message in batch:
                    channel.add(message)
        pushed = time.process_time()
        for channel, subscription, connection in pairs:
            channel.ack_held(ids, subscription)
            channel.ack_durable(ids)
        push_cpu += pushed - start
        ack_cpu += time.process_time() - pushed
        for channel, _, connection in pairs:
            if not check:
                connection.out.clear()
                continue
            # every copy pushed as its frame, every ack made a row
            frames = FrameDecoder().feed(b"".join(connection.out))
            if [f.message_id for f in frames] != ids or len(channel.in_flight) or any(
                    f.command != Command.CONSUMER_PUSH or f.channel != channel.name for f in frames):
                raise AssertionError(f"{channel.name}: the round's pushes or acks went wrong")
            connection.out.clear()
        acks = sum(len(getattr(r, "message_ids", (r,))) for r in rows)
        if check and acks != BATCH * CHANNELS:
            raise AssertionError(f"{acks} acks handed to the acker for {BATCH * CHANNELS} acked")
        rows.clear()
    gc.enable()
    copies = max(1, messages // BATCH * BATCH * CHANNELS)
    return {"push_ns": push_cpu / copies * 1e9, "ack_ns": ack_cpu / copies * 1e9}


def main() -> None:
    cost.main("channel_cost", __doc__, "copy (push and ack)", ("push_ns", "ack_ns"), 200, 1, CHANNELS)


if __name__ == "__main__":
    main()
