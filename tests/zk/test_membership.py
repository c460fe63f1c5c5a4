"""A dmq-server in a cluster: registration, heartbeat, clean leave, lost sessions.

Real ZooKeeper, real dmq-server subprocesses, real PostgreSQL. Every wait is on an
observable condition (a znode's data, a ZooKeeper watch, an HTTP answer) with a
deadline.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time

import pytest

from registry import paths
from tests.integration.support import REPO, http_get, wait_for

from . import zkserver
from .helpers import deliver_all, node_info, register_topic, send_many, wait_served, zk_client



def test_node_registers_heartbeats_and_leaves(make_node, zk):
    """A started node has its ephemeral znode with its addresses, version and start time;
    last_heartbeat advances with --node-heartbeat; SIGTERM removes the znode."""
    node = make_node(node_heartbeat="200ms")
    node_id = node.flags["node_id"]
    info = wait_for(lambda: node_info(zk, node_id), timeout=10)
    assert (info.host, info.tcp_port, info.http_port) == ("127.0.0.1", node.tcp_port, node.http_port)
    assert info.version and info.start_time > 0 and info.instance
    _, stat = zk.get(paths.node(node_id))
    assert stat.ephemeralOwner != 0  # ephemeral: dies with the node's session
    first = info.last_heartbeat
    wait_for(lambda: node_info(zk, node_id).last_heartbeat > first, timeout=10)

    gone = threading.Event()
    assert zk.exists(paths.node(node_id), watch=lambda event: gone.set()) is not None
    assert node.terminate() == 0
    assert gone.wait(10), "the znode outlived a clean shutdown"
    assert zk.exists(paths.node(node_id)) is None


def test_node_info_reports_cluster_state(make_node):
    """/info carries the cluster section: registered, ZooKeeper state, live nodes."""
    node = make_node()
    status, body = http_get(node.http + "/info")
    cluster = json.loads(body)["cluster"]
    assert status == 200
    assert cluster["registered"] is True and cluster["zk_state"] == "CONNECTED"
    assert cluster["nodes"] == [node.flags["node_id"]]


def test_zookeeper_unreachable_at_start_is_a_clear_error(pg_dsn, tmp_path):
    """With nothing listening at --zk, the server retries for --zk-connect-timeout, then
    exits with status 1 and a message naming the address (documented in operations.md)."""
    port = zkserver.free_port()
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable, "-m", "dmq_server.main",
            "--pg-dsn", pg_dsn,
            "--tcp-address", f"127.0.0.1:{zkserver.free_port()}",
            "--http-address", f"127.0.0.1:{zkserver.free_port()}",
            "--admin-address", "",
            "--data-path", str(tmp_path / "data"),
            "--zk", f"127.0.0.1:{port}",
            "--zk-connect-timeout", "2s",
        ],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )
    elapsed = time.monotonic() - started
    assert proc.returncode == 1
    assert f"cannot reach ZooKeeper at 127.0.0.1:{port} within 2s" in proc.stderr
    assert elapsed < 30


def test_duplicate_node_id_is_refused(make_node):
    """A second process with a live node's id does not start: it would deliver the same
    messages. It waits out a possible stale registration first, then names the holder."""
    first = make_node()
    second = make_node(start=False, node_id=first.flags["node_id"])
    with pytest.raises(RuntimeError, match="is registered by another live process"):
        second.start(timeout=30)
    assert http_get(first.http + "/ping")[0] == 200


def test_expired_session_re_registers_and_keeps_serving(make_node, zk):
    """A node frozen past its session timeout (SIGSTOP, like a long GC pause) loses its
    session: the ephemeral znode goes. Thawed, it sees LOST, registers again under a new
    session, and its producer and consumer keep working; nothing stored is lost."""
    node = make_node()
    node_id = node.flags["node_id"]
    register_topic(zk, "orders", "billing")
    wait_for(lambda: node_info(zk, node_id), timeout=10)
    wait_served(node, "orders", "billing")
    _, before = zk.get(paths.node(node_id))
    with node.client() as producer:
        ids = send_many(producer, "orders", 20, prefix=b"before")

    gone = threading.Event()
    zk.exists(paths.node(node_id), watch=lambda event: gone.set())
    node.proc.send_signal(19)  # SIGSTOP
    try:
        assert gone.wait(30), "the session did not expire"
    finally:
        node.proc.send_signal(18)  # SIGCONT

    def re_registered():
        stat = zk.exists(paths.node(node_id))
        return stat is not None and stat.ephemeralOwner != before.ephemeralOwner

    wait_for(re_registered, timeout=30)
    wait_for(lambda: json.loads(http_get(node.http + "/info")[1])["cluster"]["registered"], timeout=10)
    assert json.loads(http_get(node.http + "/info")[1])["cluster"]["re_registrations"] >= 1
    with node.client() as producer:
        ids += send_many(producer, "orders", 20, prefix=b"after")
    with node.client() as consumer:
        got = deliver_all(consumer, "orders", "billing", set(ids))
    assert got == set(ids)


def test_zookeeper_restart_node_keeps_serving(zk_private, make_node):
    """ZooKeeper stopped and started again (same data directory and port): sends are
    stored while it is away, the node reconnects (registering again if its session did
    not survive), and every message stored before, during and after is delivered."""
    address = f"{zk_private.address}/restart"
    node = make_node(zk=address, zk_session_timeout="4s")
    node_id = node.flags["node_id"]
    with zk_client(address) as zk:
        register_topic(zk, "orders", "billing")
        wait_for(lambda: node_info(zk, node_id), timeout=10)
    wait_served(node, "orders", "billing")
    with node.client() as producer:
        ids = send_many(producer, "orders", 10, prefix=b"before")
        server = zk_private.servers[0]
        server.stop()
        ids += send_many(producer, "orders", 10, prefix=b"during")  # PostgreSQL is enough
        assert http_get(node.http + "/ping")[0] == 200
        server.start()
        ids += send_many(producer, "orders", 10, prefix=b"after")
    with zk_client(address) as zk:
        wait_for(lambda: node_info(zk, node_id), timeout=30)
    wait_for(lambda: json.loads(http_get(node.http + "/info")[1])["cluster"]["registered"], timeout=30)
    with node.client() as consumer:
        assert deliver_all(consumer, "orders", "billing", set(ids)) == set(ids)


def test_node_deleted_by_hand_registers_again(make_node, zk):
    """An operator deleting a live node's znode makes the other nodes think it left, so
    the node drops what it held (it may be taken over) and registers again at once."""
    node = make_node()
    node_id = node.flags["node_id"]
    register_topic(zk, "orders", "billing")
    with node.client() as producer:
        ids = send_many(producer, "orders", 10)
    _, before = zk.get(paths.node(node_id))
    zk.delete(paths.node(node_id))

    def back():
        stat = zk.exists(paths.node(node_id))
        return stat is not None and stat.ctime != before.ctime

    wait_for(back, timeout=15)
    wait_for(lambda: json.loads(http_get(node.http + "/info")[1])["cluster"]["re_registrations"] >= 1, timeout=10)
    with node.client() as consumer:
        assert deliver_all(consumer, "orders", "billing", set(ids)) == set(ids)
