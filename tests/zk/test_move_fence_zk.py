"""``dmq topic move`` of an ordered topic when a node's view of the registry is stale, or
a node cannot reach the cluster the topic leaves (issue 45 §2): the move's fence holds,
and a key's messages are stored, and delivered, in the order their sends were acknowledged.

Real dmq-server nodes on the test's PostgreSQL (main) and a private one (cluster b), a real
ZooKeeper, the real CLI, and a fault proxy (tests/chaos/faultproxy.py) on the links that
break:

* node Y reaches ZooKeeper through the proxy, and is cut from it (reset) before the
  moves: it keeps its last view, so it routes both topics to b, and each refresh writes
  that view into the registry rows again. Its session (60 s, on a ZooKeeper of the test's
  own that allows it) outlives the cut: nobody takes its incarnation over meanwhile.
* node X reaches cluster b through the proxy, cut during the second move.

Before the moves, a topic created while Y is cut: Y's refreshes write its view without
it, and must not remove its rows (a channel registered again would start after its stored
messages).

The fence: once ``dmq topic move`` wrote cluster b's row, Y's stale view cannot write the
old placement back (the row's version, schema 19), so every send of a moved topic Y makes
is refused ``E_MOVED`` until Y reads the move. Out of reach: X does not route an ordered
topic to its new cluster before it fenced the old one (``db.mirror``), so a key's first
message cannot be stored on main while a stale node stores its next on b.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psycopg
import pytest

from dmq_client.blocking import BlockingClient
from dmq_client.message import ReceivedMessage
from dmq_client.wire import Command
from registry.zk import connect as zk_connect
from tests.chaos.faultproxy import FaultProxy
from tests.integration.support import REPO, db_rows, http_get, wait_for

from . import zkserver
from .helpers import register_topic, wait_served

FENCED, UNREACHED, LATER = "fenced", "unreached", "later"
SESSION_S = 60


def _zk_state(node) -> str:
    status, body = http_get(node.http + "/info")
    return json.loads(body)["cluster"]["zk_state"] if status == 200 else ""


def _move(zk_address: str, pg_dsn: str, topic: str, *clusters: str, wait: bool = False) -> subprocess.Popen:
    """``dmq topic move TOPIC --cluster main``: without ``wait``, it records the move and
    fences the clusters it is given; with it, it waits for the drain (``--settle 1``)."""
    args = [sys.executable, "-m", "dmq_server.admin.cli", "--zk", zk_address, "--pg-dsn", pg_dsn]
    for cluster in clusters:
        args += ["--pg-cluster", cluster]
    args += ["topic", "move", topic, "--cluster", "main"]
    args += ["--settle", "1", "--timeout", "60"] if wait else ["--no-wait"]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO)
    if not wait:
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, out
    return proc


def _send(client: BlockingClient, topic: str, body: bytes, session_id: int | None = None):
    frame = client.send(topic, body, session_id, resend=session_id is not None, key="k", timeout=30)
    return frame


def _stored(client: BlockingClient, topic: str, body: bytes, deadline_s: float = 30.0) -> int:
    """The id ``body`` is stored under, sent again (the same session id) until it is."""
    first = _send(client, topic, body)
    session_id, reply = first.session_id, first
    deadline = time.monotonic() + deadline_s
    while reply.command != Command.SEND_SUCCESS_ACK:
        assert time.monotonic() < deadline, f"{topic} {body!r} never stored: {reply.status}"
        time.sleep(0.1)  # a producer's resend pace, not a wait for an event
        reply = _send(client, topic, body, session_id)
    return reply.message_id


def _start_ids(dsn: str) -> dict[str, int]:
    """Each topic's channel c1 and where it starts, in a cluster's registry rows."""
    return dict(db_rows(dsn, "SELECT topic, start_id FROM dmq_channel WHERE name = 'c1'"))


def _kept_views(node) -> int:
    """How many times the node wrote its last view again (ZooKeeper unreadable)."""
    return node.log_path.read_text(errors="replace").count("keeping the last view")


def _placed(dsn: str, topic: str) -> str:
    return db_rows(dsn, "SELECT cluster FROM dmq_topic WHERE name = %s", topic)[0][0]


def _deliveries(nodes, topic: str, count: int) -> list[bytes]:
    """The bodies of ``topic``'s channel c1, in push order, from whichever node orders it."""
    clients = [node.client() for node in nodes]
    got: list[tuple[int, bytes]] = []
    try:
        for client in clients:
            assert client.subscribe(topic, "c1", credit=10).command == Command.SUBSCRIBE_ACK
        deadline = time.monotonic() + 60
        while len(got) < count and time.monotonic() < deadline:
            for client in clients:
                push = client.receive(timeout=0.2)
                if push is not None:
                    assert ReceivedMessage.properties_of(push.status).key == "k"
                    got.append((push.message_id, push.body))
                    client.ack(push)
    finally:
        for client in clients:
            client.close()
    return [body for _, body in got]


@pytest.fixture
def zk_long(tmp_path):
    """A ZooKeeper of the test's own whose sessions may last ``SESSION_S`` (the shared one
    caps them at 15 s)."""
    server = zkserver.ZooKeeperServer(tmp_path / "zk", zkserver.free_port(),
                                      extra_config=(f"maxSessionTimeout={SESSION_S * 2000}",))
    try:
        yield server.start()
    finally:
        server.kill()


def test_a_stale_node_cannot_undo_the_fence_nor_a_node_route_past_an_unfenced_cluster(
    make_node, zk_long, pg_dsn, pg_private
):
    b_dsn = pg_private.dsn
    info = psycopg.conninfo.conninfo_to_dict(b_dsn)
    zk_address = zk_long.address
    proxy = FaultProxy({"zk": ("127.0.0.1", zk_long.client_port),
                        "b": (str(info.get("host") or "127.0.0.1"), int(info["port"]))})
    zk = zk_connect(zk_address, timeout=30, session_timeout=10)
    try:
        info.update(host="127.0.0.1", port=str(proxy.ports["b"]), sslmode="disable")
        x = make_node(zk=zk_address, pg_cluster=f"b={psycopg.conninfo.make_conninfo(**info)}")
        y = make_node(zk="127.0.0.1:%d" % proxy.ports["zk"], pg_cluster=f"b={b_dsn}",
                      zk_session_timeout=f"{SESSION_S}s")
        for topic in (FENCED, UNREACHED):
            register_topic(zk, topic, "c1", cluster="b", ordered=True)
        for node in (x, y):
            for topic in (FENCED, UNREACHED):
                wait_served(node, topic, "c1")
        proxy.set("zk", "reset")
        wait_for(lambda: _zk_state(y) != "CONNECTED", timeout=30)

        # 0. a topic created while Y is cut is not in Y's view: Y's refreshes write that view
        # again, and must not remove the topic's rows (nor its channel's start)
        register_topic(zk, LATER, "c1")
        wait_served(x, LATER, "c1")
        started = {dsn: _start_ids(dsn) for dsn in (pg_dsn, b_dsn)}
        assert all(LATER in ids for ids in started.values())
        refreshes = _kept_views(y)
        wait_for(lambda: _kept_views(y) >= refreshes + 2, timeout=30)  # two of Y's refreshes
        assert {dsn: _start_ids(dsn) for dsn in (pg_dsn, b_dsn)} == started

        with x.client() as via_x, y.client() as via_y:
            # 1. the fence: the CLI writes it into b; X reads the move and stores on main
            _move(zk_address, pg_dsn, FENCED, f"b={b_dsn}")
            first = _stored(via_x, FENCED, b"1")
            assert first >> 48 == 0  # main's ids
            session_id = None
            for _ in range(20):  # Y's view is stale: each try is refused (E_MOVED), and the
                written = _kept_views(y)  # refresh that follows writes the view back, which
                reply = _send(via_y, FENCED, b"2", session_id)  # b's row refuses
                session_id = reply.session_id
                assert reply.command != Command.SEND_SUCCESS_ACK, f"stored on b after the fence: {reply}"
                wait_for(lambda: _kept_views(y) > written, timeout=10)  # the next try follows a write
                assert _placed(b_dsn, FENCED) == "main"

            # 2. b out of X's reach: nobody fences it, so X keeps routing the topic to b
            proxy.set("b", "reset")
            _move(zk_address, pg_dsn, UNREACHED)
            wait_for(lambda: _placed(pg_dsn, UNREACHED) == "main")
            reply = _send(via_x, UNREACHED, b"1")
            assert reply.command != Command.SEND_SUCCESS_ACK, "stored on main while b was not fenced"
            unreached = [_stored(via_y, UNREACHED, b"1", deadline_s=5), _stored(via_y, UNREACHED, b"2", deadline_s=5)]
            assert all(m >> 48 == 1 for m in unreached)  # on b, in order

            proxy.set("b", "pass")
            proxy.set("zk", "pass")
            wait_for(lambda: _zk_state(y) == "CONNECTED", timeout=30)
            second = _stored(via_y, FENCED, b"2", deadline_s=30)
            assert second >> 48 == 0 and second > first
            wait_for(lambda: _placed(b_dsn, UNREACHED) == "main")  # X fenced it once it reached b
        # the moves finish (b drained: its copies go out first), and each key's copies go
        # out in the order their sends were acknowledged
        for topic in (FENCED, UNREACHED):
            finish = _move(zk_address, pg_dsn, topic, f"b={b_dsn}", wait=True)
            assert _deliveries((x, y), topic, 2) == [b"1", b"2"]
            out, _ = finish.communicate(timeout=60)
            assert finish.returncode == 0, out
    finally:
        zk.stop()
        zk.close()
        proxy.close()
