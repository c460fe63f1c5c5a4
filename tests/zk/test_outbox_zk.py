"""The outbox relay in a cluster with ZooKeeper: real ZooKeeper, two dmq-server nodes, real
PostgreSQL for dmq and for the application. Only the node holding the outbox's ZooKeeper
lock (/dmq/outbox_relay/NAME, its data the node id) relays; killed with -9 while the
application commits, the other node takes both locks over and every committed row is
stored and delivered once. `dmq --zk … outbox attach` shows the outbox under /dmq/outbox
(never its password) and its watch makes a node relay it at once, well before its
--registry-refresh; detach stops it."""

from __future__ import annotations

import json
import threading

import psycopg

from registry import paths
from registry.outboxes import RelayLock
from tests.integration.support import db_rows, run_cli, wait_for
from tests.integration.test_outbox_figures import password_of, with_password
from tests.integration.test_outbox_relay import app_dsn, outbox_empty, send_transaction  # noqa: F401 (a fixture)

from .helpers import register_topic, wait_served

WAIT = 60.0


def holder(zk) -> str | None:
    return RelayLock(zk, "shop", "reader").holder()


def relays(node) -> bool:
    return "outbox shop: this node relays dmq_outbox" in node.log()


def consume_bodies(node, count: int) -> list[bytes]:
    """``count`` pushes from orders/billing at ``node``, each acked, then nothing more."""
    bodies = []
    with node.client() as consumer:
        consumer.subscribe("orders", "billing", credit=200)
        while len(bodies) < count:
            push = consumer.receive(timeout=WAIT)
            assert push is not None, f"{len(bodies)} of {count} pushes arrived"
            consumer.ack(push)
            bodies.append(push.body)
        assert consumer.receive(timeout=1.0) is None
    return bodies


def test_the_zookeeper_lock_holder_relays_and_the_other_node_takes_over_after_kill(zk, make_node, pg_dsn, app_dsn):
    """Two nodes with --outbox shop: the one ZooKeeper names relays (its log says so, the
    other's does not). Transactions commit while it is killed with -9; the other node takes
    the ZooKeeper lock and the advisory lock, and every committed row is stored and
    delivered once."""
    register_topic(zk, "orders", "billing")
    a, b = make_node(outbox=f"shop={app_dsn}"), make_node(outbox=f"shop={app_dsn}")
    for node in (a, b):
        wait_served(node, "orders", "billing")
    send_transaction(app_dsn, [b"first"])
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    first = holder(zk)
    leader, other = (a, b) if first == a.flags["node_id"] else (b, a)
    assert first == leader.flags["node_id"]
    assert relays(leader) and not relays(other)

    sent: list[bytes] = [b"first"]
    stop = threading.Event()

    def produce() -> None:
        n = 0
        while not stop.is_set():
            bodies = [b"t%d-%d" % (n, k) for k in range(1 + n % 3)]
            send_transaction(app_dsn, bodies)
            sent.extend(bodies)
            n += 1

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        wait_for(lambda: len(sent) > 100, timeout=WAIT)
        leader.kill()
        wait_for(lambda: holder(zk) == other.flags["node_id"], timeout=WAIT)
        wait_for(lambda: relays(other), timeout=WAIT)
        wait_for(lambda: len(sent) > 300, timeout=WAIT)
    finally:
        stop.set()
        producer.join()
    wait_for(lambda: outbox_empty(app_dsn), timeout=WAIT)
    stored = db_rows(pg_dsn, "SELECT count(*), count(DISTINCT body) FROM dmq_message WHERE producer LIKE 'outbox:%%'")
    assert stored == [(len(sent), len(sent))]
    bodies = consume_bodies(other, len(sent))
    assert sorted(bodies) == sorted(sent) and len(set(bodies)) == len(sent)
    print(f"lost 0, duplicated 0: {len(sent)} committed rows, {stored[0][0]} stored, {len(bodies)} delivered")


def test_attach_with_zookeeper_is_followed_at_once_and_detach_stops_the_relay(zk, zk_address, make_node, pg_dsn,
                                                                              app_dsn):
    """A node whose --registry-refresh is a minute relays an outbox attached with --zk
    within seconds (ZooKeeper's watch), /dmq/outbox/shop shows its schema and database but
    not the password; after detach the znode is gone and the relay stops (its ZooKeeper
    lock released, no relay session left in the application's database)."""
    register_topic(zk, "orders", "billing")
    node = make_node(registry_refresh="60s")
    wait_served(node, "orders", "billing")
    dsn = with_password(app_dsn)
    done = run_cli(pg_dsn, "--zk", zk_address, "outbox", "attach", "shop", "--dsn", dsn)
    assert done.returncode == 0, done.stderr
    data, _ = zk.get(paths.outbox("shop"))
    assert json.loads(data)["schema"] == "dmq_outbox" and password_of(dsn).encode() not in data
    send_transaction(app_dsn, [b"attached"])
    wait_for(lambda: outbox_empty(app_dsn), timeout=10.0)
    assert holder(zk) == node.flags["node_id"]
    assert consume_bodies(node, 1) == [b"attached"]

    done = run_cli(pg_dsn, "--zk", zk_address, "outbox", "detach", "shop")
    assert done.returncode == 0, done.stderr
    assert zk.exists(paths.outbox("shop")) is None
    wait_for(lambda: holder(zk) is None, timeout=10.0)
    with psycopg.connect(app_dsn, autocommit=True) as conn:
        sessions = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'dmq %%'")
        assert sessions.fetchone() == (0,)
    assert "outbox shop is detached: this node stops its relay" in node.log()

