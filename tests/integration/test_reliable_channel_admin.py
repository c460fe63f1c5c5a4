"""nsqd's channel admin and counters on reliable channels, as the NSQ tools read them.

nsqadmin, nsq_stat and nsq_to_http read ``/stats?format=json`` and call nsqd's HTTP API.
On a reliable channel dmq used to show depth 0 while thousands of copies waited in
PostgreSQL, report a REQ with a delay as in flight and later as a timeout, answer
pause/unpause/empty with 403 (read by the Go tools as "TLS required"), and answer the
second of nsqadmin's two deletes with 404.
"""

from __future__ import annotations

import json

import pytest

from .support import db_rows, http_get, wait_for
from .test_nsq_http import v1

pytestmark = pytest.mark.integration

FAST_STATE = {"channel_state_interval": "0.1"}


def _channel(server, topic: str, name: str = "billing") -> dict:
    stats = json.loads(http_get(server.http + f"/stats?format=json&topic={topic}")[1])
    (t,) = stats["topics"]
    return next(c for c in t["channels"] if c["channel_name"] == name)


def _publish(server, topic: str, n: int, prefix: str = "m") -> None:
    body = "\n".join(f"{prefix}{i}" for i in range(n)).encode()
    assert v1(server, "POST", f"/mpub?topic={topic}", body) == (200, "OK")


def test_depth_counts_the_copies_waiting_in_postgresql(make_server, topic, nsq_connect):
    server = make_server(**FAST_STATE)
    _publish(server, topic, 300)
    wait_for(lambda: _channel(server, topic)["depth"] == 300)
    ch = _channel(server, topic)
    assert ch["in_flight_count"] == 0 and ch["backend_depth"] == 300  # no consumer: none loaded
    consumer = nsq_connect(server.tcp_port)
    consumer.sub(topic, "billing", rdy=10)
    got = [consumer.message() for _ in range(10)]
    wait_for(lambda: _channel(server, topic)["in_flight_count"] == 10)
    wait_for(lambda: _channel(server, topic)["depth"] == 290)  # in flight is not depth
    consumer.send(b"RDY 0\n")
    for m in got:
        consumer.send(b"FIN " + m[2] + b"\n")
    # acknowledged copies leave the stored count once their acks are durable
    wait_for(lambda: (_channel(server, topic)["in_flight_count"], _channel(server, topic)["depth"]) == (0, 290))


def test_req_with_a_delay_is_deferred_not_in_flight_nor_a_timeout(make_server, topic, nsq_connect):
    server = make_server(**FAST_STATE)
    _publish(server, topic, 1)
    consumer = nsq_connect(server.tcp_port)
    consumer.sub(topic, "billing", rdy=1)
    _, attempts, mid, body = consumer.message()
    consumer.send(b"REQ " + mid + b" 1000\n")
    wait_for(lambda: _channel(server, topic)["deferred_count"] == 1)
    ch = _channel(server, topic)
    assert (ch["in_flight_count"], ch["requeue_count"], ch["timeout_count"]) == (0, 1, 0)
    _, attempts2, mid2, body2 = consumer.message()  # after the deferral
    assert (mid2, body2, attempts2) == (mid, body, attempts + 1)
    ch = _channel(server, topic)
    assert (ch["deferred_count"], ch["in_flight_count"], ch["timeout_count"]) == (0, 1, 0)
    consumer.send(b"FIN " + mid2 + b"\n")


def test_pause_unpause_and_empty_on_a_reliable_channel(make_server, topic, pg_dsn, nsq_connect):
    server = make_server(**FAST_STATE)
    assert v1(server, "POST", f"/channel/pause?topic={topic}&channel=billing") == (200, "")
    assert db_rows(pg_dsn, "SELECT topic, channel FROM dmq_channel_pause") == [(topic, "billing")]
    consumer = nsq_connect(server.tcp_port)
    consumer.sub(topic, "billing", rdy=50)
    _publish(server, topic, 20, "held")
    wait_for(lambda: _channel(server, topic)["depth"] == 20)
    ch = _channel(server, topic)
    assert ch["paused"] is True and ch["in_flight_count"] == 0  # nothing pushed while paused

    # the pause is stored: a restarted node is still paused
    server.stop()
    server.start()
    consumer.close()
    consumer = nsq_connect(server.tcp_port)
    consumer.sub(topic, "billing", rdy=50)
    wait_for(lambda: _channel(server, topic)["depth"] == 20)
    assert _channel(server, topic)["paused"] is True and _channel(server, topic)["in_flight_count"] == 0

    assert v1(server, "POST", f"/channel/unpause?topic={topic}&channel=billing") == (200, "")
    got = {consumer.message()[3] for _ in range(20)}
    assert got == {b"held%d" % i for i in range(20)}

    # empty drops what waits (and what is in flight); later messages still arrive
    consumer.close()
    _publish(server, topic, 30, "old")
    wait_for(lambda: _channel(server, topic)["depth"] == 30 + 20)  # the 20 were never FINed
    assert v1(server, "POST", f"/channel/empty?topic={topic}&channel=billing") == (200, "")
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)]
    _publish(server, topic, 5, "new")
    consumer = nsq_connect(server.tcp_port)
    consumer.sub(topic, "billing", rdy=50)
    assert {consumer.message()[3] for _ in range(5)} == {b"new%d" % i for i in range(5)}
    consumer.close()

    assert v1(server, "POST", f"/channel/pause?topic={topic}&channel=nope") == (404, {"message": "CHANNEL_NOT_FOUND"})
    assert v1(server, "POST", f"/topic/pause?topic={topic}") == (200, "")  # every channel
    wait_for(lambda: _channel(server, topic)["paused"] is True)
    assert v1(server, "POST", f"/topic/unpause?topic={topic}") == (200, "")
    assert _channel(server, topic)["paused"] is False


def test_deleting_what_is_gone_answers_success(make_server, tmp_path):
    """nsqadmin (lookupd mode) deletes at the lookupd, then at the node: one URL on dmq."""
    server = make_server(data_path=str(tmp_path / "data"))
    assert v1(server, "POST", "/topic/create?topic=fastone") == (200, "")
    assert v1(server, "POST", "/channel/create?topic=fastone&channel=c") == (200, "")
    for _ in range(2):
        assert v1(server, "POST", "/channel/delete?topic=fastone&channel=c") == (200, "")
    for _ in range(2):
        assert v1(server, "POST", "/topic/delete?topic=fastone") == (200, "")
    assert v1(server, "GET", "/topics")[1] == {"topics": []}


def test_the_same_channel_operations_on_the_cli_the_console_and_the_admin_api(make_server, topic, pg_dsn):
    """`dmq channel pause|unpause|empty`, the console's `channel ...` and
    POST /admin/channels/T/C/ACTION do what nsqd's API does; a channel that is not there
    is 'not found' on each (exit 1, ERR E_NOT_FOUND, 404)."""
    import subprocess
    import sys

    from .support import REPO
    from .test_admin_surfaces import Console, admin_server, http

    server = admin_server(make_server, **FAST_STATE)

    def cli(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "dmq_server.admin.cli", "--pg-dsn", pg_dsn,
             "--http-address", f"127.0.0.1:{server.http_port}", *args],
            capture_output=True, text=True, cwd=REPO, timeout=60,
        )

    paused = cli("channel", "pause", topic, "billing")
    assert paused.returncode == 0 and paused.stdout.strip() == f"paused channel billing of topic {topic}"
    assert _channel(server, topic)["paused"] is True
    gone = cli("channel", "pause", topic, "nope")
    assert gone.returncode == 1 and "CHANNEL_NOT_FOUND" in gone.stderr

    console = Console(server.admin_port)
    try:
        _publish(server, topic, 7)
        wait_for(lambda: _channel(server, topic)["depth"] == 7)
        lines, status = console.cmd(f"channel empty topic={topic} channel=billing")
        assert status == f"OK empty {topic}/billing: 7 stored copies dropped"
        lines, status = console.cmd(f"channel unpause topic={topic} channel=nope")
        assert status.startswith("ERR E_NOT_FOUND")
        lines, status = console.cmd("channel pause topic=orders")
        assert status.startswith("ERR E_INVALID usage: channel pause topic=T channel=C")
    finally:
        console.close()
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)]

    assert http(server, "POST", f"/admin/channels/{topic}/billing/unpause") == (200, {"ok": f"unpause {topic}/billing"})
    assert _channel(server, topic)["paused"] is False
    status, answer = http(server, "POST", "/admin/channels/nope/billing/pause")
    assert status == 404 and answer["error"] == "E_NOT_FOUND"
