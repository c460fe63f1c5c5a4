"""Several dmq nodes on one PostgreSQL and one ZooKeeper: registry changes everywhere,
takeover of a dead node's messages, a node returning with the same id, an ensemble
losing a member.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections import Counter


from tests.integration.support import REPO, db_rows, http_get, wait_for

from . import zkserver
from .helpers import deliver_all, node_info, register_topic, send_many, zk_client



def dmq_cli(zk_address: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "dmq_server.admin.cli", "--zk", zk_address, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


def channels_on(node) -> dict[str, list[str]]:
    """The reliable topics and channels a node serves now (its /stats)."""
    status, body = http_get(node.http + "/stats")
    assert status == 200, body
    return {t["topic_name"]: sorted(c["channel_name"] for c in t["channels"]) for t in json.loads(body)["topics"]}


def owners(dsn: str) -> dict[str, int]:
    return dict(db_rows(dsn, "SELECT holder, count(*) FROM dmq_pending GROUP BY holder"))


def test_topic_and_channel_changes_reach_every_node(make_node, zk_address, pg_dsn):
    """`dmq --zk` creates a topic and channels in ZooKeeper; every node serves them
    within seconds (watches), PostgreSQL's registry tables mirror them, and sends on
    every node are stored; removing a channel and deleting the topic take effect
    everywhere too."""
    nodes = [make_node() for _ in range(3)]
    assert dmq_cli(zk_address, "topic", "create", "orders", "--msg-timeout", "30s").returncode == 0
    for channel in ("billing", "audit"):
        out = dmq_cli(zk_address, "channel", "add", "orders", channel)
        assert out.returncode == 0, out.stderr
    for node in nodes:
        wait_for(lambda: channels_on(node).get("orders") == ["audit", "billing"], timeout=10)
    assert db_rows(pg_dsn, "SELECT topic, name FROM dmq_channel ORDER BY name") == [
        ("orders", "audit"),
        ("orders", "billing"),
    ]
    assert db_rows(pg_dsn, "SELECT msg_timeout_ms FROM dmq_topic WHERE name = 'orders'") == [(30000,)]
    for node in nodes:
        with node.client() as producer:
            send_many(producer, "orders", 5)
    assert db_rows(pg_dsn, "SELECT channel, count(*) FROM dmq_pending GROUP BY channel ORDER BY channel") == [
        ("audit", 15),
        ("billing", 15),
    ]

    listed = dmq_cli(zk_address, "topic", "list", "--json")
    assert json.loads(listed.stdout)[0]["channels"] == ["audit", "billing"]
    assert dmq_cli(zk_address, "channel", "remove", "orders", "audit").returncode == 0
    for node in nodes:
        wait_for(lambda: channels_on(node).get("orders") == ["billing"], timeout=10)
    assert db_rows(pg_dsn, "SELECT name FROM dmq_channel") == [("billing",)]
    assert dmq_cli(zk_address, "topic", "delete", "orders").returncode == 0
    for node in nodes:
        wait_for(lambda: "orders" not in channels_on(node), timeout=10)
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_topic") == [(0,)]


def test_cli_refusals_with_zookeeper(zk_address):
    """The CLI gives the same clear refusals against ZooKeeper as against PostgreSQL,
    and exit status 3 when ZooKeeper cannot be reached."""
    assert dmq_cli(zk_address, "topic", "create", "orders").returncode == 0
    dup = dmq_cli(zk_address, "topic", "create", "orders")
    assert dup.returncode == 1 and "topic 'orders' already exists" in dup.stderr
    missing = dmq_cli(zk_address, "channel", "add", "nope", "billing")
    assert missing.returncode == 1 and "no such topic 'nope'" in missing.stderr
    bad = dmq_cli(zk_address, "topic", "create", "bad name")
    assert bad.returncode == 1 and "invalid topic name" in bad.stderr
    port = zkserver.free_port()
    down = dmq_cli(f"127.0.0.1:{port}", "--zk-timeout", "1", "topic", "list")
    assert down.returncode == 3 and "cannot reach ZooKeeper" in down.stderr


def test_node_list(make_node, zk_address):
    """`dmq --zk node list` shows every live node with its addresses."""
    a, b = make_node(), make_node()
    out = dmq_cli(zk_address, "node", "list", "--json")
    listed = {n["node_id"]: n for n in json.loads(out.stdout)}
    assert set(listed) == {a.flags["node_id"], b.flags["node_id"]}
    assert listed[a.flags["node_id"]]["tcp_port"] == a.tcp_port


def test_kill_9_node_with_backlog_and_in_flight_loses_nothing(make_node, zk, pg_dsn):
    """Node A stores 300 messages; a consumer on A holds 25 of them in flight (not
    acknowledged) and the rest wait as backlog. A is killed with SIGKILL. Node B claims
    A's stored copies once A's session expires and delivers every one of them: 0 lost."""
    register_topic(zk, "orders", "billing")
    a, b = make_node(), make_node()
    with a.client() as producer:
        ids = set(send_many(producer, "orders", 300))
    holder = a.client()
    assert holder.subscribe("orders", "billing", credit=25).command.name == "SUBSCRIBE_ACK"
    held = [holder.receive(timeout=10) for _ in range(25)]
    assert all(p is not None for p in held)  # in flight on A, never acknowledged
    assert owners(pg_dsn) == {a.flags["node_id"]: 300}

    a.kill()
    holder.close()
    with b.client() as consumer:
        got = deliver_all(consumer, "orders", "billing", ids, timeout=60)
    assert got == ids
    wait_for(lambda: owners(pg_dsn) == {}, timeout=10)  # every ack durable
    log = db_rows(pg_dsn, "SELECT message_id FROM dmq_delivery_log WHERE channel = 'billing'")
    assert {r[0] for r in log} == ids
    assert {p.message_id for p in held} <= got


def test_returning_node_does_not_deliver_what_was_taken_over(make_node, zk, pg_dsn):
    """After node B took over killed node A's messages, A restarts with the same id.
    It registers, serves new messages, and delivers none of the taken-over ones: those
    arrive once each, from B."""
    register_topic(zk, "orders", "billing")
    a, b = make_node(), make_node()
    a_id, b_id = a.flags["node_id"], b.flags["node_id"]
    with a.client() as producer:
        taken = set(send_many(producer, "orders", 50))
    a.kill()
    wait_for(lambda: owners(pg_dsn) == {b_id: 50}, timeout=30)

    a.start()
    wait_for(lambda: node_info(zk, a_id), timeout=10)
    with a.client() as producer:
        marker = send_many(producer, "orders", 1, prefix=b"marker")[0]
    with a.client() as consumer:
        got_on_a = deliver_all(consumer, "orders", "billing", {marker}, timeout=20)
    assert got_on_a == {marker}  # loaded in id order: a taken-over copy would come first
    seen: Counter = Counter()
    with b.client() as consumer:
        reply = consumer.subscribe("orders", "billing", credit=100)
        assert reply.command.name == "SUBSCRIBE_ACK"
        while not taken <= set(seen):
            push = consumer.receive(timeout=20)
            assert push is not None, f"missing {len(taken - set(seen))} taken-over messages"
            seen[push.message_id] += 1
            consumer.ack(push)
    assert set(seen) == taken and max(seen.values()) == 1


def test_clean_shutdown_hands_backlog_to_the_others(make_node, zk, pg_dsn):
    """A node stopped with SIGTERM leaves the cluster; what it still stored is taken
    over at once by a live node (no session timeout to wait for) and delivered."""
    register_topic(zk, "orders", "billing")
    a, b = make_node(zk_session_timeout="30s"), make_node(zk_session_timeout="30s")
    with a.client() as producer:
        ids = set(send_many(producer, "orders", 40))
    assert a.terminate() == 0
    wait_for(lambda: owners(pg_dsn) == {b.flags["node_id"]: 40}, timeout=15)
    with b.client() as consumer:
        assert deliver_all(consumer, "orders", "billing", ids) == ids


def test_three_member_ensemble_survives_losing_one(make_node, pg_dsn):
    """With a three-server ZooKeeper ensemble, stopping one member (whichever the node
    is connected to or not) keeps the quorum: the node stays registered, heartbeats go
    on, registry changes still arrive, and messages flow."""
    ensemble = zkserver.Ensemble(3)
    try:
        ensemble.start()
        address = f"{ensemble.address}/ens"
        node = make_node(zk=address, zk_session_timeout="4s", node_heartbeat="200ms")
        node_id = node.flags["node_id"]
        with zk_client(address) as zk:
            register_topic(zk, "orders", "billing")
            wait_for(lambda: node_info(zk, node_id), timeout=10)
        ensemble.servers[0].stop()
        survivors = f"{ensemble.servers[1].address},{ensemble.servers[2].address}/ens"
        with zk_client(survivors) as zk:
            beat = node_info(zk, node_id).last_heartbeat
            wait_for(lambda: node_info(zk, node_id) and node_info(zk, node_id).last_heartbeat > beat, timeout=20)
            register_topic(zk, "events", "ops")
        wait_for(lambda: channels_on(node).get("events") == ["ops"], timeout=20)
        with node.client() as producer:
            ids = set(send_many(producer, "orders", 10))
        with node.client() as consumer:
            assert deliver_all(consumer, "orders", "billing", ids) == ids
    finally:
        ensemble.close()


def test_node_starting_later_takes_over_messages_of_a_node_gone_before(make_node, zk, pg_dsn):
    """Node A stores messages and dies while no other node runs. Node B, started once A's
    session is gone, claims them as part of starting (not only at its periodic check,
    set to a minute here) and delivers them."""
    register_topic(zk, "orders", "billing")
    a = make_node()
    a_id = a.flags["node_id"]
    with a.client() as producer:
        ids = set(send_many(producer, "orders", 30))
    a.kill()
    wait_for(lambda: node_info(zk, a_id) is None, timeout=20)
    b = make_node(zk_refresh="60s")
    wait_for(lambda: owners(pg_dsn) == {b.flags["node_id"]: 30}, timeout=15)
    with b.client() as consumer:
        assert deliver_all(consumer, "orders", "billing", ids) == ids


def test_two_survivors_never_claim_the_same_messages(make_node, zk, pg_dsn):
    """Node A dies holding 400 stored messages while B and C both look for departed
    nodes' messages, each with a consumer: every message is claimed by exactly one of
    them and delivered exactly once in all (no copy pushed by both)."""
    register_topic(zk, "orders", "billing")
    a, b, c = make_node(takeover_batch_size="50"), make_node(takeover_batch_size="50"), make_node(
        takeover_batch_size="50"
    )
    with a.client() as producer:
        ids = set(send_many(producer, "orders", 400))
    seen: Counter = Counter()
    consumers = [b.client(), c.client()]
    try:
        for consumer in consumers:
            assert consumer.subscribe("orders", "billing", credit=500).command.name == "SUBSCRIBE_ACK"
        a.kill()
        deadline = time.monotonic() + 60
        while not ids <= set(seen) and time.monotonic() < deadline:
            for consumer in consumers:
                while (push := consumer.receive(timeout=0.02)) is not None:
                    seen[push.message_id] += 1
                    consumer.ack(push)
    finally:
        for consumer in consumers:
            consumer.close()
    assert set(seen) == ids
    assert max(seen.values()) == 1
    claimed = owners(pg_dsn)
    assert a.flags["node_id"] not in claimed
