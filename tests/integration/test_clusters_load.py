"""Two PostgreSQL clusters under load, counted: ``kill -9`` of the node with both in use,
and a topic moved from one cluster to the other while producers and consumers run.

Every id acknowledged to a producer and every id delivered per channel is recorded; at
the end, with everything drained, no acknowledged id is missing from any channel (lost)
and no copy whose ack was durable (in a cluster's delivery log) was delivered again.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time

import pytest

from dmq_client.wire import Command

from .support import REPO, db_rows, wait_for
from .test_clusters import cli, register
from .test_cursor_crash import Consumer, Producer

pytestmark = pytest.mark.integration

CHANNELS = ("c1", "c2")


def durable(dsns: list[str], topic: str) -> dict[str, set[int]]:
    """Per channel, the ids whose acks are durable on any of the clusters."""
    out: dict[str, set[int]] = {c: set() for c in CHANNELS}
    for dsn in dsns:
        for channel, message_id in db_rows(dsn, "SELECT channel, message_id FROM dmq_delivery_log WHERE topic = %s", topic):
            out[channel].add(message_id)
    return out


def drain_all(server, topic: str, delivered: dict, again: dict, durable_before: dict) -> None:
    with server.client() as one, server.client() as two:
        clients = dict(zip(CHANNELS, (one, two)))
        for channel, client in clients.items():
            assert client.subscribe(topic, channel, credit=1000).command == Command.SUBSCRIBE_ACK
        for channel, client in clients.items():
            while (push := client.receive(timeout=3.0)) is not None:
                if push.message_id in durable_before[channel]:
                    again[channel].add(push.message_id)
                delivered[channel].append(push.message_id)
                client.ack(push)


def check(acked: set[int], delivered: dict, again: dict) -> None:
    for channel in CHANNELS:
        got = set(delivered[channel])
        lost = acked - got
        assert not lost, f"{channel}: {len(lost)} acknowledged ids never delivered: {sorted(lost)[:20]}"
        assert not again[channel], f"{channel}: delivered again after a durable ack: {sorted(again[channel])[:20]}"
        print(f"{channel}: {len(acked)} acknowledged, {len(got)} delivered, "
              f"{len(delivered[channel]) - len(got)} delivered again (not durable at the time)")


def test_kill_9_with_both_clusters_in_use_loses_nothing(pg_dsn, pg_private, make_server):
    """Producers and consumers on a topic of each cluster; the node is killed with SIGKILL
    twice at a random moment and started again: every acknowledged id of both topics
    reaches both channels, and nothing durably acknowledged comes back."""
    b_dsn = pg_private.dsn
    server = make_server(pg_cluster=f"b={b_dsn}")
    register(pg_dsn, b_dsn)
    rng = random.Random(19)
    topics = ("local", "remote")
    acked = {t: set() for t in topics}
    delivered = {t: {c: [] for c in CHANNELS} for t in topics}
    again = {t: {c: set() for c in CHANNELS} for t in topics}
    before = {t: {c: set() for c in CHANNELS} for t in topics}
    for round_ in range(2):
        producers = [Producer(server.tcp_port, t, f"p{round_}-{t}") for t in topics]
        consumers = [Consumer(server.tcp_port, t, c, rng.random()) for t in topics for c in CHANNELS]
        for thread in producers + consumers:
            thread.start()
        target = {p.topic: len(acked[p.topic]) + rng.randint(500, 1500) for p in producers}
        wait_for(lambda: all(len(acked[p.topic] | p.acked) >= target[p.topic] for p in producers), timeout=90)
        time.sleep(rng.random() * 0.5)
        server.kill()
        for thread in producers + consumers:
            thread.stop.set()
            thread.join(30)
        for p in producers:
            acked[p.topic] |= p.acked
        for c in consumers:
            again[c.topic][c.channel] |= set(c.delivered) & before[c.topic][c.channel]
            delivered[c.topic][c.channel].extend(c.delivered)
        before = {t: durable([pg_dsn, b_dsn], t) for t in topics}
        server.start()
    for topic in topics:
        drain_all(server, topic, delivered[topic], again[topic], before[topic])
    for dsn in (pg_dsn, b_dsn):
        wait_for(lambda: not db_rows(dsn, "SELECT 1 FROM dmq_pending"), timeout=30)
    assert all(m >> 48 == 1 for m in acked["remote"]) and all(m >> 48 == 0 for m in acked["local"])
    for topic in topics:
        assert len(acked[topic]) > 1000
        check(acked[topic], delivered[topic], again[topic])


def test_moving_a_topic_under_load_loses_and_doubles_nothing(pg_dsn, pg_private, make_server):
    """A topic on main moves to cluster b while producers publish and consumers (attached
    before the move) acknowledge: ``dmq topic move`` returns once main is drained; every
    id acknowledged before, during and after the move is delivered on both channels,
    nothing durably acknowledged is delivered again, the new ids come from b, and main
    keeps nothing of the topic."""
    b_dsn = pg_private.dsn
    server = make_server(pg_cluster=f"b={b_dsn}")
    register(pg_dsn, b_dsn)
    topic = "local"
    rng = random.Random(20)
    producers = [Producer(server.tcp_port, topic, f"mover-{i}") for i in range(2)]
    consumers = [Consumer(server.tcp_port, topic, c, rng.random(), hold=20) for c in CHANNELS]
    for thread in producers + consumers:
        thread.start()
    wait_for(lambda: sum(len(p.acked) for p in producers) >= 1000, timeout=60)
    before_move = set().union(*(p.acked for p in producers))
    move = subprocess.run(
        [sys.executable, "-m", "dmq_server.admin.cli", "--pg-dsn", pg_dsn, "--pg-cluster", f"b={b_dsn}",
         "topic", "move", topic, "--cluster", "b", "--settle", "3", "--timeout", "120"],
        capture_output=True, text=True, cwd=REPO, timeout=180,
    )
    assert move.returncode == 0, move.stdout + move.stderr
    assert "cluster main drained" in move.stdout and f"topic {topic} is on cluster b" in move.stdout
    moved_at = set().union(*(p.acked for p in producers))
    wait_for(lambda: len(set().union(*(p.acked for p in producers))) >= len(moved_at) + 500, timeout=60)
    for thread in producers + consumers:
        thread.stop.set()
        thread.join(30)
    acked = set().union(*(p.acked for p in producers))
    delivered = {c.channel: list(c.delivered) for c in consumers}
    again = {c: set() for c in CHANNELS}
    settled = durable([pg_dsn, b_dsn], topic)
    drain_all(server, topic, delivered, again, settled)
    wait_for(lambda: not db_rows(b_dsn, "SELECT 1 FROM dmq_pending WHERE topic = %s", topic), timeout=30)

    check(acked, delivered, again)
    after = acked - moved_at
    assert after and all(m >> 48 == 1 for m in after)  # stored on b once the move finished
    assert len(before_move) >= 1000 and all(m >> 48 == 0 for m in before_move)
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending WHERE topic = %s", topic) == [(0,)]
    assert db_rows(pg_dsn, "SELECT cluster, draining FROM dmq_topic WHERE name = %s", topic) == [("b", [])]
    listed = cli(pg_dsn, b_dsn, "topic", "list").stdout
    assert f"{topic}\treliable\tchannels: c1, c2\tcluster: b\n" in listed
