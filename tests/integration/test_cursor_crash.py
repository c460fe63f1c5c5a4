"""kill -9 at random moments under mixed publish and out-of-order ack load, counted.

Three producers publish, two channels consume (one with two consumers, all acknowledging
in random order and holding many copies in flight), and the server is killed with
SIGKILL at a random moment, three times, restarting each time. Every id acknowledged to a
producer and every id delivered per channel is recorded. At the end, with everything
drained: no acknowledged id is missing from any channel (lost), and no copy whose ack was
durable (in the delivery log) before a kill was delivered again after it (duplicated
after a confirmed ack). Copies in flight or acknowledged but not yet durable at a kill
may come again: that is at least once, and is counted but allowed.
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from dmq_client.blocking import BlockingClient, ClientError
from dmq_client.wire import Command
from dmq_server.core.nsq_wire import FRAME_MESSAGE, decode_message

from .support import NsqSocket, db_rows, run_cli, wait_for

pytestmark = pytest.mark.integration

CHANNELS = ("billing", "audit")


class Producer(threading.Thread):
    def __init__(self, port: int, topic: str, name: str):
        super().__init__(daemon=True)
        self.port, self.topic, self.name = port, topic, name
        self.acked: set[int] = set()
        self.stop = threading.Event()
        self.next_session = 0

    def run(self) -> None:
        try:
            client = BlockingClient("127.0.0.1", self.port, timeout=5, producer=self.name)
        except OSError:
            return
        try:
            while not self.stop.is_set():
                replies = client.send_many(self.topic, [b"x" * 100] * 20, window=10)
                self.acked.update(r.message_id for r in replies if r.command == Command.SEND_SUCCESS_ACK)
        except (ClientError, OSError):
            pass
        finally:
            client.close()


class Consumer(threading.Thread):
    """Receives, holds up to ``hold`` copies, and acknowledges them in random order, half
    the time one frame each, half the time all chosen in one UP_CONSUMER_ACKS frame."""

    def __init__(self, port: int, topic: str, channel: str, seed: int, hold: int = 40):
        super().__init__(daemon=True)
        self.port, self.topic, self.channel = port, topic, channel
        self.rng = random.Random(seed)
        self.hold = hold
        self.delivered: list[int] = []
        self.stop = threading.Event()

    def run(self) -> None:
        try:
            client = BlockingClient("127.0.0.1", self.port, timeout=5)
        except OSError:
            return
        held = []
        try:
            client.subscribe(self.topic, self.channel, credit=2 * self.hold)
            while not self.stop.is_set():
                push = client.receive(timeout=0.2)
                if push is not None:
                    self.delivered.append(push.message_id)
                    held.append(push)
                if len(held) >= self.hold or (push is None and held):
                    chosen = self.rng.sample(held, len(held) // 2 or 1)
                    for push in chosen:
                        held.remove(push)
                    if self.rng.random() < 0.5:
                        client.ack_many(chosen)  # one UP_CONSUMER_ACKS frame
                    else:
                        for push in chosen:
                            client.ack(push)
        except (ClientError, OSError):
            pass
        finally:
            client.close()


class NsqConsumer(Consumer):
    """The same habits over NSQ (a raw V2 socket): holds up to ``hold`` messages and
    FINs a random half of them in one write, so the server reads a run of FINs
    (``ReliableSub.finish_many``: one durable-ack run)."""

    def run(self) -> None:
        try:
            sock = NsqSocket(self.port)
            sock.sub(self.topic, self.channel, rdy=2 * self.hold)
        except (OSError, AssertionError):
            return
        held: list[bytes] = []
        try:
            while not self.stop.is_set():
                try:
                    kind, data = sock.frame(timeout=0.2)
                except TimeoutError:
                    kind = None
                if kind == FRAME_MESSAGE:
                    hex_id = decode_message(data)[2]
                    self.delivered.append(int(hex_id, 16))
                    held.append(hex_id)
                if len(held) >= self.hold or (kind is None and held):
                    chosen = self.rng.sample(held, len(held) // 2 or 1)
                    for hex_id in chosen:
                        held.remove(hex_id)
                    sock.send(b"".join(b"FIN " + hex_id + b"\n" for hex_id in chosen))
        except OSError:  # the server was killed (ConnectionError is one)
            pass
        finally:
            sock.close()


def kill_under_load(server, producers: list[Producer], consumers: list[Consumer]) -> set[int]:
    """SIGKILL the server while the threads run, then stop them: the ids the producers
    heard acknowledged."""
    server.kill()
    for t in producers + consumers:
        t.stop.set()
    for t in producers + consumers:
        t.join(30)
    return set().union(*(p.acked for p in producers))


def _durable(pg_dsn: str) -> dict[str, set[int]]:
    rows = db_rows(pg_dsn, "SELECT channel, message_id FROM dmq_delivery_log")
    out: dict[str, set[int]] = {c: set() for c in CHANNELS}
    for channel, message_id in rows:
        out[channel].add(message_id)
    return out


@pytest.mark.parametrize("ack_batch,billing", [(None, Consumer), (7, Consumer), (None, NsqConsumer)],
                         ids=["as shipped", "ack batches of 7", "NSQ consumers on billing"])
def test_kill_9_at_random_moments_loses_nothing_and_repeats_no_durable_ack(
        make_server, topic, pg_dsn, ack_batch, billing):
    """With ``--ack-batch-size 7`` nearly every consumer's run of acks (``db.messages.AckRun``)
    is split across durable-ack transactions, and a kill finds some runs half durable. With
    NSQ consumers on one channel, their reads of FINs are the runs."""
    run_cli(pg_dsn, "channel", "add", topic, "audit").check_returncode()
    rng = random.Random(18)
    server = make_server(**({} if ack_batch is None else {"ack_batch_size": str(ack_batch)}))
    acked: set[int] = set()
    delivered: dict[str, list[int]] = {c: [] for c in CHANNELS}
    again_after_durable: dict[str, set[int]] = {c: set() for c in CHANNELS}
    durable_before: dict[str, set[int]] = {c: set() for c in CHANNELS}
    for round_ in range(3):
        producers = [Producer(server.tcp_port, topic, f"p{round_}-{i}") for i in range(3)]
        consumers = [
            billing(server.tcp_port, topic, "billing", rng.random()),
            billing(server.tcp_port, topic, "billing", rng.random()),
            Consumer(server.tcp_port, topic, "audit", rng.random()),
        ]
        for t in producers + consumers:
            t.start()
        target = len(acked) + rng.randint(800, 2500)
        wait_for(lambda: len(acked | set().union(*(p.acked for p in producers))) >= target, timeout=90)
        time.sleep(rng.random() * 0.5)  # a random moment in the load
        acked |= kill_under_load(server, producers, consumers)
        for c in consumers:
            seen = set(c.delivered)
            again_after_durable[c.channel] |= seen & durable_before[c.channel]
            delivered[c.channel].extend(c.delivered)
        durable_before = _durable(pg_dsn)  # the server is dead: this is what survives
        server.start()

    # every kind of consumer's acks became durable under the load (not only in the drain)
    assert all(len(durable_before[channel]) > 500 for channel in CHANNELS), {
        c: len(ids) for c, ids in durable_before.items()}

    # drain what is left, acknowledging everything
    with server.client() as billing, server.client() as audit:
        for client, channel in ((billing, "billing"), (audit, "audit")):
            assert client.subscribe(topic, channel, credit=1000).command == Command.SUBSCRIBE_ACK
        for client, channel in ((billing, "billing"), (audit, "audit")):
            while (push := client.receive(timeout=3.0)) is not None:
                if push.message_id in durable_before[channel]:
                    again_after_durable[channel].add(push.message_id)
                delivered[channel].append(push.message_id)
                client.ack(push)
    wait_for(lambda: not db_rows(pg_dsn, "SELECT 1 FROM dmq_pending"), timeout=30)

    assert len(acked) > 2000
    for channel in CHANNELS:
        got = set(delivered[channel])
        lost = acked - got
        assert not lost, f"{channel}: {len(lost)} acknowledged ids never delivered: {sorted(lost)[:20]}"
        assert not again_after_durable[channel], (
            f"{channel}: delivered again after a durable ack: {sorted(again_after_durable[channel])[:20]}"
        )
        redelivered = len(delivered[channel]) - len(got)
        print(f"{channel}: {len(acked)} acknowledged, {len(got)} delivered, {redelivered} delivered again "
              "(in flight or not yet durable at a kill)")
