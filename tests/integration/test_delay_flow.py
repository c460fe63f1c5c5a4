"""Delayed messages end to end: real PostgreSQL, real dmq-server processes, real sockets.

Also the scheduler against the real delay table on an injected clock: the
statements are PostgreSQL's, only time is the test's.
"""

from __future__ import annotations

import socket
import struct
import time

import psycopg
import pytest
from twisted.internet import task
from twisted.internet.defer import fail, succeed

from dmq_client.wire import SEND_REPLIES, Command, MessageType
from dmq_server.db.delays import NewDelayed, insert_delayed
from dmq_server.db.messages import NewMessage
from dmq_server.reliable.delay import DelayWorker
from dmq_server.reliable.horizon import OwnWrites
from dmq_server.db.schema import migrate
from dmq_server.db.steps import run_steps
from dmq_server.db.worker import connect

from .support import db_rows, wait_for


def send_delayed(client, topic: str, body: bytes, due_ms: int, session_id: int | None = None, resend=False):
    """UP_PRODUCER_SEND with msg_type DELAY; returns the reply frame."""
    frame = client.send_frame(topic, body, session_id, resend=resend)
    frame.msg_type = MessageType.DELAY
    frame.due_ms = due_ms
    client.write(frame)
    return client._await_reply(lambda f: f.command in SEND_REPLIES and f.session_id == frame.session_id, None)


def now_ms() -> int:
    return int(time.time() * 1000)


def test_delay_message_is_stored_acked_then_delivered_when_due(make_server, topic, pg_dsn):
    """A DELAY send is committed to dmq_delay (fragment 1..8) before SEND_SUCCESS_ACK, is not
    pushed before its due time, and is pushed once it falls due; the delay row is gone."""
    server = make_server(delay_poll_interval="200ms")
    with server.client() as producer, server.client() as consumer:
        assert consumer.subscribe(topic, "billing").command == Command.SUBSCRIBE_ACK
        due = now_ms() + 1500
        reply = send_delayed(producer, topic, b"later", due)
        assert reply.command == Command.SEND_SUCCESS_ACK, reply.status
        rows = db_rows(pg_dsn, "SELECT id, fragment, due_ms, body FROM dmq_delay")
        assert len(rows) == 1
        assert rows[0][0] == reply.message_id and 1 <= rows[0][1] <= 8 and rows[0][2] == due
        assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_message") == [(0,)]
        push = consumer.receive(timeout=10)
        arrived = now_ms()
        assert push is not None and push.body == b"later"
        assert arrived >= due, "delivered before its due time"
        assert arrived - due < 1000
        assert push.session_id == reply.session_id and push.producer == producer.producer
        consumer.ack(push)
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_delay") == [(0,)]


def test_delay_resend_is_idempotent(make_server, topic, pg_dsn):
    """A resent DELAY pair is answered from the stored row: same id, nothing stored twice."""
    server = make_server()
    with server.client() as producer:
        due = now_ms() + 60_000
        first = send_delayed(producer, topic, b"x", due, session_id=7)
        again = send_delayed(producer, topic, b"x", due, session_id=7, resend=True)
        assert first.command == again.command == Command.SEND_SUCCESS_ACK
        assert again.message_id == first.message_id and again.status == "duplicate"
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_delay") == [(1,)]


def test_delay_validation_errors_are_specific(make_server, topic):
    """No due time, or one beyond --max-delay, is SEND_INVALID_ACK naming the problem."""
    server = make_server(max_delay="1h")
    with server.client() as producer:
        missing = send_delayed(producer, topic, b"x", 0)
        assert missing.command == Command.SEND_INVALID_ACK and "due_ms" in missing.status
        far = send_delayed(producer, topic, b"x", now_ms() + 2 * 3600_000)
        assert far.command == Command.SEND_INVALID_ACK and "--max-delay" in far.status


def _nsq_frame(sock: socket.socket) -> tuple[int, bytes]:
    header = b""
    while len(header) < 8:
        header += sock.recv(8 - len(header))
    size, kind = struct.unpack(">ii", header)
    data = b""
    while len(data) < size - 4:
        data += sock.recv(size - 4 - len(data))
    return kind, data


def test_nsq_dpub_to_a_reliable_topic_is_delayed(make_server, topic, pg_dsn):
    """DPUB over NSQ's protocol to a reliable topic answers OK once stored in dmq_delay and is
    delivered to the registered channel after the deferral."""
    server = make_server(delay_poll_interval="200ms")
    with server.client() as consumer:
        assert consumer.subscribe(topic, "billing").command == Command.SUBSCRIBE_ACK
        with socket.create_connection(("127.0.0.1", server.tcp_port), timeout=10) as sock:
            sock.sendall(b"  V2")
            body = b"deferred"
            sent = now_ms()
            sock.sendall(f"DPUB {topic} 700\n".encode() + struct.pack(">i", len(body)) + body)
            kind, data = _nsq_frame(sock)
            while data == b"_heartbeat_":
                kind, data = _nsq_frame(sock)
            assert (kind, data) == (0, b"OK")
        assert db_rows(pg_dsn, "SELECT topic, body FROM dmq_delay") == [(topic, body)]
        push = consumer.receive(timeout=10)
        assert push is not None and push.body == body
        assert now_ms() - sent >= 700
        consumer.ack(push)


def test_two_nodes_deliver_each_due_message_once(make_server, topic, pg_dsn):
    """Two nodes on one database both serve every fragment (no ZooKeeper): SKIP LOCKED lets
    each due row be moved by exactly one of them, so a consumer on each node sees every
    message once in all."""
    a = make_server(delay_poll_interval="100ms")
    b = make_server(delay_poll_interval="100ms")
    count = 120
    with a.client() as pa, b.client() as pb, a.client() as ca, b.client() as cb:
        for c in (ca, cb):
            assert c.subscribe(topic, "billing", credit=1000).command == Command.SUBSCRIBE_ACK
        due = now_ms() + 1000
        for i in range(count):
            producer = pa if i % 2 else pb
            reply = send_delayed(producer, topic, b"m%d" % i, due + (i % 10) * 20)
            assert reply.command == Command.SEND_SUCCESS_ACK
        seen: list[bytes] = []
        deadline = time.monotonic() + 20
        while len(seen) < count and time.monotonic() < deadline:
            for c in (ca, cb):
                push = c.receive(timeout=0.1)
                if push is not None:
                    seen.append(push.body)
                    c.ack(push)
        # a little longer: a duplicate would show up now
        for c in (ca, cb):
            while (push := c.receive(timeout=0.5)) is not None:
                seen.append(push.body)
    assert sorted(seen) == sorted(b"m%d" % i for i in range(count))
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_delay") == [(0,)]
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_message") == [(count,)]
    owners = {r[0] for r in db_rows(pg_dsn, "SELECT node_id FROM dmq_message")}
    assert owners <= {f"{socket.gethostname()}:{a.tcp_port}", f"{socket.gethostname()}:{b.tcp_port}"}


class PgNow:
    """DbWorker stand-in: runs the statement at once on one real connection."""

    def __init__(self, conn: psycopg.Connection):
        self.conn = conn

    def run_steps(self, fn, *args):
        try:
            with self.conn.transaction():
                return succeed(run_steps(self.conn, fn(*args)))
        except Exception as exc:  # surfaces as the worker's failure path
            return fail(exc)


def test_due_time_precision_on_an_injected_clock_with_real_sql(pg_dsn, topic, owner):
    """Against PostgreSQL's delay table, with time from task.Clock: each row moves into
    dmq_message with its delivery exactly when the clock reaches its due time."""
    migrate(pg_dsn)
    clock = task.Clock()
    t0 = 1_800_000_000.0
    clock.advance(t0)
    base = int(t0 * 1000)
    with connect(pg_dsn) as conn:
        with conn.transaction():
            stored = insert_delayed(
                conn,
                [
                    NewDelayed(NewMessage(topic, "p", 1, 0, b"a"), base + 500, 2),
                    NewDelayed(NewMessage(topic, "p", 2, 0, b"b"), base + 750, 3),
                    NewDelayed(NewMessage(topic, "p", 3, 0, b"c"), base + 2600, 6),  # another worker's
                ],
                "n1",
            )
        assert [s.duplicate for s in stored] == [False, False, False]
        moved: list = []
        worker = DelayWorker(
            1, PgNow(conn), clock, max_fragment=8, poll_interval=1.0, batch_size=100,
            tick=0.01, node_id="n1", on_moved=moved.extend, writes=OwnWrites(owner),
        )
        worker.set_fragments((1, 2, 3, 4))
        clock.advance(0.499)
        assert moved == []
        clock.advance(0.001)
        assert [m.body for m in moved] == [b"a"] and moved[0].due_ms == base + 500
        clock.advance(0.25)
        assert [m.body for m in moved] == [b"a", b"b"]
        assert moved[1].channels == ("billing",)
        for _ in range(5):
            clock.advance(1.0)
            worker.poll()
        assert [m.body for m in moved] == [b"a", b"b"]  # fragment 6 is not worker 1's
        deliveries = conn.execute(
            "SELECT d.channel, m.body FROM dmq_pending d JOIN dmq_message m ON m.id = d.message_id ORDER BY m.id"
        ).fetchall()
        assert deliveries == [("billing", b"a"), ("billing", b"b")]
        assert conn.execute("SELECT fragment FROM dmq_delay").fetchall() == [(6,)]
        conn.rollback()
