"""``dmq --zk ... channel seek`` on a cluster (issue 46): two dmq-server nodes on one
PostgreSQL, ZooKeeper, real clients.

Each node stores and delivers its own share of a topic (its incarnation's messages), so a
seek must move both shares at once: it rewrites every incarnation's cursor of the channel in
one transaction, and each node learns of it at its next read of the channels' state.

Counted: ten messages stored through each node, acknowledged on billing and audit by a
consumer on each node, consumers left connected. A seek of billing to the first id makes
exactly the twenty pending again (the dry run says 20); each node's billing consumer
receives its node's ten again, each once; no audit consumer receives anything. Then node B
stops: node A takes over B's copies, and a second seek, made while B is down, has A's
consumer receive all twenty again, each once.
"""

from __future__ import annotations

from tests.integration.support import db_rows, run_cli, wait_for
from tests.integration.test_seek import _receive

from .helpers import deliver_all, register_topic, send_many, wait_served

WAIT = 30.0


def _seek(dsn: str, zk_address: str, *args: str) -> str:
    out = run_cli(dsn, "--zk", zk_address, "channel", "seek", "orders", "billing", *args)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_a_seek_moves_every_nodes_share_and_a_stopped_nodes_share_with_its_taker(
        pg_dsn, zk, zk_address, make_node):
    register_topic(zk, "orders", "audit", "billing", retention_ms=3_600_000)
    a = make_node(channel_state_interval="500ms")
    b = make_node(channel_state_interval="500ms")
    for node in (a, b):
        for channel in ("audit", "billing"):
            wait_served(node, "orders", channel, timeout=20)
    with a.client() as producer:
        on_a = send_many(producer, "orders", 10, b"a")
    with b.client() as producer:
        on_b = send_many(producer, "orders", 10, b"b")
    everything = sorted(on_a + on_b)

    consumers = {}
    try:
        for name, node, mine in (("a", a, on_a), ("b", b, on_b)):
            for channel in ("audit", "billing"):
                consumer = consumers[name, channel] = node.client()
                assert deliver_all(consumer, "orders", channel, set(mine), timeout=WAIT) == set(mine)
        wait_for(lambda: not db_rows(pg_dsn, "SELECT 1 FROM dmq_pending"), timeout=WAIT)

        dry = _seek(pg_dsn, zk_address, "--to-id", str(everything[0]), "--dry-run")
        assert f"20 messages from id {everything[0]} " in dry, dry
        _seek(pg_dsn, zk_address, "--to-id", str(everything[0]))
        assert sorted(_receive(consumers["a", "billing"], 10)) == sorted(on_a)
        assert sorted(_receive(consumers["b", "billing"], 10)) == sorted(on_b)
        for key in (("a", "audit"), ("b", "audit"), ("a", "billing"), ("b", "billing")):
            assert consumers[key].receive(timeout=1.0) is None, key  # each once, and nothing else
        wait_for(lambda: not db_rows(pg_dsn, "SELECT 1 FROM dmq_pending"), timeout=WAIT)

        for channel in ("audit", "billing"):
            consumers.pop(("b", channel)).close()
        b.stop()
        # A takes B's incarnation over: it then holds the billing cursor of B's messages
        wait_for(lambda: db_rows(pg_dsn, "SELECT DISTINCT holder FROM dmq_cursor WHERE channel = 'billing'")
                 == [(a.flags["node_id"],)], timeout=WAIT)
        _seek(pg_dsn, zk_address, "--to-id", str(everything[0]))
        assert sorted(_receive(consumers["a", "billing"], 20)) == everything
        assert consumers["a", "billing"].receive(timeout=1.0) is None
        assert consumers["a", "audit"].receive(timeout=0.5) is None
    finally:
        for consumer in consumers.values():
            consumer.close()
