"""An ordered topic moved between two real PostgreSQL clusters under load keeps each
key's order (``broker.placement.move_held``): a real dmq-server process on the test's
database (main) and a private PostgreSQL (cluster b), the real CLI's ``dmq topic move``.

The topic starts on b and moves to main, whose ids are lower (slot 0): delivered in id
order, a key's new copies would overtake its old ones. Producers own their keys and send
a key's next message only after the previous one's ``SEND_SUCCESS_ACK`` (a refused send,
``E_MOVED`` among them, is sent again first), so per key the order of their acks is the
commit order the channels must keep. Consumers record every push. Counted per channel:
every acknowledged id delivered, and per key the first deliveries in ack order (every
copy stored on b before any stored on main).
"""

from __future__ import annotations

import random
import threading
import time

import pytest

from dmq_client.blocking import BlockingClient, ClientError
from dmq_client.message import ReceivedMessage
from dmq_client.wire import Command
from dmq_client.wire.properties import Properties

from .support import db_rows, wait_for
from .test_clusters import cli

pytestmark = pytest.mark.integration

TOPIC = "ledger"
CHANNELS = ("c1", "c2")


class KeyedProducer(threading.Thread):
    """Sends rounds of one message per key it owns, pipelined across its keys; a key's
    next message goes only after the previous one's ack. A send answered otherwise is
    sent again with the same session id before anything else of its key."""

    def __init__(self, port: int, name: str, keys: list[str]):
        super().__init__(daemon=True)
        self.port, self.name, self.keys = port, name, keys
        self.acked: dict[str, list[int]] = {k: [] for k in keys}  # per key, in ack order
        self.refused = 0
        self.stop = threading.Event()
        self.error: BaseException | None = None

    @property
    def count(self) -> int:
        return sum(len(ids) for ids in self.acked.values())

    def run(self) -> None:
        try:
            client = BlockingClient("127.0.0.1", self.port, timeout=30, producer=self.name)
            try:
                while not self.stop.is_set():
                    self._round(client)
                    time.sleep(0.08)  # ~100 messages a second each: the drain outlasts nothing
            finally:
                client.close()
        except (ClientError, OSError) as exc:
            self.error = exc

    def _round(self, client: BlockingClient) -> None:
        out: dict[int, tuple[str, bytes]] = {}
        for key in self.keys:
            body = b"%s:%d" % (key.encode(), len(self.acked[key]))
            frame = client.send_frame(TOPIC, body, properties=Properties(key))
            client.write(frame)
            out[frame.session_id] = (key, body)
        while out:
            reply = client.next_send_reply()
            key, body = out[reply.session_id]
            if reply.command == Command.SEND_SUCCESS_ACK:
                del out[reply.session_id]
                if reply.message_id not in self.acked[key]:  # a resend of a stored one answers its id
                    self.acked[key].append(reply.message_id)
                continue
            self.refused += 1
            time.sleep(0.05)
            client.write(client.send_frame(TOPIC, body, reply.session_id, resend=True, properties=Properties(key)))


class RecordingConsumer(threading.Thread):
    """Records every push (id, key) in arrival order; holds up to ``hold`` copies and
    acknowledges a random half of them, a little slower than the producers send."""

    def __init__(self, port: int, channel: str, seed: int, hold: int = 12):
        super().__init__(daemon=True)
        self.port, self.channel = port, channel
        self.rng = random.Random(seed)
        self.hold = hold
        self.pushes: list[tuple[int, str | None]] = []
        self.times: list[float] = []  # when each push arrived (one clock for every consumer)
        self.stop = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            client = BlockingClient("127.0.0.1", self.port, timeout=10)
            try:
                assert client.subscribe(TOPIC, self.channel, credit=2 * self.hold).command == Command.SUBSCRIBE_ACK
                held: list = []
                while not self.stop.is_set():
                    push = client.receive(timeout=0.1)
                    if push is not None:
                        self.times.append(time.monotonic())
                        self.pushes.append((push.message_id, ReceivedMessage.properties_of(push.status).key))
                        held.append(push)
                        time.sleep(0.002)
                    if len(held) >= self.hold or (push is None and held):
                        chosen = self.rng.sample(held, len(held) // 2 or 1)
                        for one in chosen:
                            held.remove(one)
                        client.ack_many(chosen)
            finally:
                client.close()
        except (ClientError, OSError, AssertionError) as exc:
            self.error = exc



def first_pushes(consumers: list[RecordingConsumer], channel: str) -> dict[str | None, list[int]]:
    """Per key, its ids in the order first pushed on ``channel`` (to any of its consumers:
    a key's next copy goes out only after the ack of the one before, so arrival times
    order them)."""
    pushes = sorted((t, m, k) for c in consumers if c.channel == channel for t, (m, k) in zip(c.times, c.pushes))
    seen: set[int] = set()
    out: dict[str | None, list[int]] = {}
    for _, message_id, key in pushes:
        if message_id not in seen:
            seen.add(message_id)
            out.setdefault(key, []).append(message_id)
    return out


def test_a_moved_ordered_topic_delivers_each_keys_old_copies_before_its_new_ones(pg_dsn, pg_private, make_server):
    """32 keys sent by 4 producers, a backlog of them stored on b before consumers start;
    ``dmq topic move ledger --cluster main`` while both run: every key has copies on both
    clusters, none is lost on either channel, and per key the first deliveries follow the
    producers' acks (b's copies first, though main's ids are lower)."""
    b_dsn = pg_private.dsn
    server = make_server(pg_cluster=f"b={b_dsn}")
    out = cli(pg_dsn, b_dsn, "topic", "create", TOPIC, "--cluster", "b", "--ordered")
    assert out.returncode == 0, out.stderr
    for channel in CHANNELS:
        assert cli(pg_dsn, b_dsn, "channel", "add", TOPIC, channel).returncode == 0
    # a channel reaches b's database with the node's mirror of the registry (test_clusters)
    wait_for(lambda: db_rows(b_dsn, "SELECT name FROM dmq_channel WHERE topic = %s ORDER BY name", TOPIC)
             == [(c,) for c in CHANNELS], timeout=30)
    producers = [KeyedProducer(server.tcp_port, f"p{i}", [f"k{i}-{j}" for j in range(8)]) for i in range(4)]
    for thread in producers:
        thread.start()
    wait_for(lambda: sum(p.count for p in producers) >= 800, timeout=90)  # a backlog on b
    consumers = [RecordingConsumer(server.tcp_port, c, seed) for seed, c in enumerate(CHANNELS * 2)]
    for thread in consumers:
        thread.start()
    move = cli(pg_dsn, b_dsn, "topic", "move", TOPIC, "--cluster", "main", "--settle", "3", "--timeout", "50")
    assert move.returncode == 0, move.stdout + move.stderr
    assert "cluster b drained" in move.stdout and f"topic {TOPIC} is on cluster main" in move.stdout
    moved_at = sum(p.count for p in producers)
    wait_for(lambda: sum(p.count for p in producers) >= moved_at + 300, timeout=60)
    for thread in producers:
        thread.stop.set()
        thread.join(60)
    assert not [p.error for p in producers if p.error], [p.error for p in producers]
    acked = {key: ids for p in producers for key, ids in p.acked.items()}
    every = {m for ids in acked.values() for m in ids}

    def delivered(channel: str) -> set[int]:
        return {m for c in consumers if c.channel == channel for m, _ in c.pushes}

    wait_for(lambda: all(every <= delivered(c) for c in CHANNELS), timeout=120)
    wait_for(lambda: not db_rows(pg_dsn, "SELECT 1 FROM dmq_pending WHERE topic = %s", TOPIC), timeout=30)
    for thread in consumers:
        thread.stop.set()
        thread.join(30)
    assert not [c.error for c in consumers if c.error], [c.error for c in consumers]

    both = [k for k, ids in acked.items() if {m >> 48 for m in ids} == {0, 1}]
    assert len(both) == len(acked) == 32, both  # every key has copies on b (slot 1), then on main (slot 0)
    for ids in acked.values():  # b's, then main's: acks in commit order
        assert [m >> 48 for m in ids] == sorted((m >> 48 for m in ids), reverse=True)
    assert db_rows(pg_dsn, "SELECT cluster, draining FROM dmq_topic WHERE name = %s", TOPIC) == [("main", [])]
    for channel in CHANNELS:
        lost = every - delivered(channel)
        assert not lost, f"{channel}: {len(lost)} acknowledged ids never delivered: {sorted(lost)[:10]}"
        first = first_pushes(consumers, channel)
        wrong = {}
        for key, ids in acked.items():
            got = [m for m in first.get(key, []) if m in set(ids)]  # a send answered otherwise may be stored too
            if got != ids:
                wrong[key] = (ids, got)
        print(f"{channel}: {len(every)} acknowledged ({sum(m >> 48 == 1 for m in every)} on b), "
              f"{len(delivered(channel))} delivered, keys out of order: {len(wrong)}")
        assert not wrong, f"{channel}: {len(wrong)} keys first delivered out of their commit order, e.g. " + \
            "; ".join(f"{k} from #{i}: acked {[hex(m) for m in a[i:i + 4]]}, pushed {[hex(m) for m in g[i:i + 4]]}"
                      for k, (a, g) in list(wrong.items())[:2]
                      for i in [next(i for i, (x, y) in enumerate(zip(a + [0], g + [0])) if x != y)])
