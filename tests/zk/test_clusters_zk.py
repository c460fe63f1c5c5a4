"""Several PostgreSQL clusters in a ZooKeeper cluster: the placement is in the topic's
znode, every node mirrors the registry into every cluster, and a node killed with
messages stored on both clusters is taken over on each of them."""

from __future__ import annotations

import json

from registry.model import RegistryError
from registry.zk import ZkRegistry
from tests.integration.support import db_rows, http_get, wait_for

from .helpers import deliver_all, node_info, register_topic, send_many, wait_served


def holders(dsn: str) -> dict[str, int]:
    return dict(db_rows(dsn, "SELECT holder, count(*) FROM dmq_pending GROUP BY holder"))


def test_kill_9_node_with_copies_on_two_clusters_is_taken_over_on_both(make_node, zk, pg_dsn, pg_private):
    """Nodes A and B connect to main and cluster b. A stores 200 messages of a topic on
    each cluster, a consumer on A holds 20 of b's in flight; A is killed with SIGKILL.
    B claims A's incarnation on both clusters and delivers every message: 0 lost."""
    b_dsn = pg_private.dsn
    a = make_node(pg_cluster=f"b={b_dsn}")
    b = make_node(pg_cluster=f"b={b_dsn}")
    with_unknown = ZkRegistry(zk)
    try:
        with_unknown.create_topic("elsewhere", cluster="nosuch")
        raise AssertionError("an unknown cluster was accepted")
    except RegistryError as exc:
        assert "unknown cluster 'nosuch'" in str(exc) and "b, main" in str(exc)
    register_topic(zk, "local", "c1")
    register_topic(zk, "remote", "c1", cluster="b")
    for node in (a, b):
        wait_served(node, "remote", "c1")
        wait_served(node, "local", "c1")
    info = node_info(zk, a.flags["node_id"])
    assert info.incarnation and info.incarnations.get("b")  # registered with both incarnations
    # the placement reached both databases' registry rows
    for dsn in (pg_dsn, b_dsn):
        wait_for(lambda: db_rows(dsn, "SELECT name, cluster FROM dmq_topic ORDER BY name")
                 == [("local", "main"), ("remote", "b")])
    with a.client() as producer:
        local = set(send_many(producer, "local", 200))
        remote = set(send_many(producer, "remote", 200))
    assert all(m >> 48 == 1 for m in remote) and all(m >> 48 == 0 for m in local)
    holder = a.client()
    assert holder.subscribe("remote", "c1", credit=20).command.name == "SUBSCRIBE_ACK"
    held = [holder.receive(timeout=10) for _ in range(20)]
    assert all(p is not None for p in held)
    assert holders(b_dsn) == {a.flags["node_id"]: 200} and holders(pg_dsn) == {a.flags["node_id"]: 200}

    a.kill()
    holder.close()
    with b.client() as consumer:
        assert deliver_all(consumer, "remote", "c1", remote, timeout=60) == remote
        assert deliver_all(consumer, "local", "c1", local, timeout=60) == local
    for dsn in (pg_dsn, b_dsn):
        wait_for(lambda: holders(dsn) == {}, timeout=10)
    status, body = http_get(b.http + "/info")
    claimed = json.loads(body)["cluster"]["takeover_by_cluster"]
    assert claimed["b"]["claimed"] >= 1 and claimed["main"]["claimed"] >= 1


def test_moving_a_topic_with_zookeeper_under_load_loses_nothing(make_node, zk, zk_address, pg_dsn, pg_private):
    """Two nodes; a producer on one, a consumer on each (a node delivers what it stored);
    ``dmq --zk ... topic move`` while they run: the placement travels through ZooKeeper's
    watches, every node mirrors it into both databases, and every acknowledged id is
    delivered once the move is done."""
    import subprocess
    import sys

    from tests.integration.support import REPO
    from tests.integration.test_cursor_crash import Consumer, Producer

    b_dsn = pg_private.dsn
    a, b = make_node(pg_cluster=f"b={b_dsn}"), make_node(pg_cluster=f"b={b_dsn}")
    register_topic(zk, "moving", "c1")
    for node in (a, b):
        wait_served(node, "moving", "c1")
    producer = Producer(a.tcp_port, "moving", "zk-mover")
    consumers = [Consumer(node.tcp_port, "moving", "c1", 0.5, hold=10) for node in (a, b)]
    producer.start()
    for consumer in consumers:
        consumer.start()
    wait_for(lambda: len(producer.acked) >= 500, timeout=60)
    move = subprocess.run(
        [sys.executable, "-m", "dmq_server.admin.cli", "--zk", zk_address, "--pg-dsn", pg_dsn,
         "--pg-cluster", f"b={b_dsn}", "topic", "move", "moving", "--cluster", "b", "--settle", "3",
         "--timeout", "120"],
        capture_output=True, text=True, cwd=REPO, timeout=180,
    )
    assert move.returncode == 0, move.stdout + move.stderr
    moved_at = len(producer.acked)
    wait_for(lambda: len(producer.acked) >= moved_at + 300, timeout=60)
    producer.stop.set()
    producer.join(30)
    wait_for(lambda: producer.acked <= set().union(*(c.delivered for c in consumers)), timeout=60)
    for consumer in consumers:
        consumer.stop.set()
        consumer.join(30)
    assert any(m >> 48 == 1 for m in producer.acked) and any(m >> 48 == 0 for m in producer.acked)
    assert ZkRegistry(zk).get_topic("moving").draining == ()
    assert db_rows(pg_dsn, "SELECT cluster, draining FROM dmq_topic WHERE name = 'moving'") == [("b", [])]
