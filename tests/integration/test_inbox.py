"""dmq_client.inbox.transaction on a real application database, then end to end: a real
dmq-server, MqClient consumers in their own processes killed between the handler and its
commit and between the commit and the ack, and the business table counted."""

from __future__ import annotations

import selectors
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import psycopg
import pytest

from dmq_client import inbox

from .support import REPO, db_rows, http_get, run_cli, wait_for

pytestmark = pytest.mark.integration

WAIT = 30.0


@pytest.fixture
def app_dsn(pg_empty_dsn):
    """An application's database: the outbox schema installed and a business table with no
    unique key, so a handler's second effect would show as a second row."""
    done = run_cli(pg_empty_dsn, "outbox", "install", "--dsn", pg_empty_dsn)
    assert done.returncode == 0, done.stderr
    with psycopg.connect(pg_empty_dsn, autocommit=True) as conn:
        conn.execute("CREATE TABLE effects (message_id bigint NOT NULL, body bytea NOT NULL)")
    return pg_empty_dsn


def push(message_id: int, topic: str = "orders", channel: str = "billing") -> SimpleNamespace:
    """A stand-in for a blocking client's push frame: the fields the inbox reads."""
    return SimpleNamespace(topic=topic, channel=channel, message_id=message_id, body=b"x")


def handle(conn, message, acked: list) -> bool:
    """The handler under test: one business row, in the inbox's transaction."""
    with inbox.transaction(conn, message, ack=acked.append) as fresh:
        if fresh:
            conn.execute("INSERT INTO effects VALUES (%s, %s)", (message.message_id, message.body))
    return fresh


def test_a_redelivery_after_the_commit_skips_the_handler_and_is_acked(app_dsn):
    """First delivery: handled, recorded, acked after the commit. Second delivery of the
    same (channel, message id): not handled, acked. The same id on another channel (or
    another topic's channel of the same name) is a message of its own."""
    acked: list = []
    with psycopg.connect(app_dsn) as conn:
        assert handle(conn, push(7), acked) is True
        assert handle(conn, push(7), acked) is False
        assert handle(conn, push(7, channel="audit"), acked) is True
        assert handle(conn, push(7, topic="refunds"), acked) is True
    assert len(acked) == 4
    assert db_rows(app_dsn, "SELECT count(*) FROM effects") == [(3,)]
    assert db_rows(app_dsn, "SELECT channel, message_id FROM dmq_outbox.inbox ORDER BY 1") == [
        ("orders/audit", "7"), ("orders/billing", "7"), ("refunds/billing", "7")
    ]


def test_a_rolled_back_handler_leaves_no_record_and_no_ack(app_dsn):
    """A handler that raises rolls back its writes and the inbox record and is not acked,
    so the redelivery runs it again."""
    acked: list = []
    with psycopg.connect(app_dsn) as conn:
        with pytest.raises(RuntimeError):
            with inbox.transaction(conn, push(8), ack=acked.append) as fresh:
                assert fresh
                conn.execute("INSERT INTO effects VALUES (8, 'x')")
                raise RuntimeError("charge failed")
        assert acked == []
        assert db_rows(app_dsn, "SELECT count(*) FROM dmq_outbox.inbox") == [(0,)]
        assert handle(conn, push(8), acked) is True
    assert db_rows(app_dsn, "SELECT count(*) FROM effects") == [(1,)]


def test_the_ack_waits_for_the_commit(app_dsn):
    """When ack is called the record and the effect are committed (another connection
    sees them)."""
    seen: list = []
    with psycopg.connect(app_dsn) as conn:
        handle(conn, push(9), [])  # warm: not the case under test
        ack = lambda m: seen.append(db_rows(app_dsn, "SELECT count(*) FROM effects WHERE message_id = 10"))  # noqa: E731
        with inbox.transaction(conn, push(10), ack=ack) as fresh:
            conn.execute("INSERT INTO effects VALUES (10, 'x')")
            assert fresh and seen == []
    assert seen == [[(1,)]]


def test_a_connection_inside_a_transaction_or_a_message_without_ack_is_refused(app_dsn):
    """The helper must own the transaction (a savepoint's release is no commit), and it
    needs a way to ack."""
    with psycopg.connect(app_dsn) as conn:
        conn.execute("SELECT 1")  # psycopg opened a transaction
        with pytest.raises(ValueError, match="begins the transaction itself"):
            with inbox.transaction(conn, push(1), ack=print):
                pass
        conn.rollback()
        with pytest.raises(TypeError, match="has no ack"):
            with inbox.transaction(conn, push(1)):
                pass
    assert db_rows(app_dsn, "SELECT count(*) FROM dmq_outbox.inbox") == [(0,)]


def test_a_concurrent_redelivery_waits_for_the_first_transaction(app_dsn):
    """A second consumer handed the same message while the first one's transaction is open
    waits on the record's key, and skips once the first commits."""
    first_in = threading.Event()
    release = threading.Event()
    outcome: dict = {}

    def first() -> None:
        with psycopg.connect(app_dsn) as conn:
            with inbox.transaction(conn, push(11), ack=lambda m: None) as fresh:
                conn.execute("INSERT INTO effects VALUES (11, 'first')")
                outcome["first"] = fresh
                first_in.set()
                release.wait(WAIT)

    def second() -> None:
        with psycopg.connect(app_dsn) as conn:
            outcome["second"] = handle(conn, push(11), [])

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    threads[0].start()
    try:
        assert first_in.wait(WAIT)
        threads[1].start()
        # the second's insert waits on the first's uncommitted key: seen as a lock wait
        wait_for(lambda: db_rows(app_dsn, "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                                 " AND query LIKE 'INSERT INTO dmq_outbox.inbox%%'") == [(1,)], timeout=WAIT)
        assert "second" not in outcome
    finally:
        release.set()
        for thread in threads:
            thread.join(WAIT)
    assert outcome == {"first": True, "second": False}
    assert db_rows(app_dsn, "SELECT body FROM effects") == [(b"first",)]


@pytest.mark.parametrize("kind", ["Session", "Connection"])
def test_sqlalchemy_session_and_connection(app_dsn, kind):
    """The same with SQLAlchemy: handled once, a committed redelivery skipped, a raise
    rolled back with its record; a Session or Connection already in a transaction refused."""
    import sqlalchemy
    from sqlalchemy.orm import Session

    engine = sqlalchemy.create_engine(app_dsn.replace("postgresql://", "postgresql+psycopg://", 1))
    acked: list = []

    def run(conn, message_id: int, fail: bool = False) -> bool:
        with inbox.transaction(conn, push(message_id), ack=acked.append) as fresh:
            if fresh:
                conn.execute(sqlalchemy.text("INSERT INTO effects VALUES (:id, 'x')"), {"id": message_id})
            if fail:
                raise RuntimeError("handler failed")
        return fresh

    try:
        with (Session(engine) if kind == "Session" else engine.connect()) as conn:
            assert run(conn, 1) is True
            assert run(conn, 1) is False
            with pytest.raises(RuntimeError):
                run(conn, 2, fail=True)
            assert run(conn, 2) is True
            conn.execute(sqlalchemy.text("SELECT 1"))  # autobegins
            with pytest.raises(ValueError, match="begins the transaction itself"):
                run(conn, 3)
            conn.rollback()
    finally:
        engine.dispose()
    assert [m.message_id for m in acked] == [1, 1, 2]
    assert db_rows(app_dsn, "SELECT message_id FROM effects ORDER BY 1") == [(1,), (2,)]
    assert db_rows(app_dsn, "SELECT message_id FROM dmq_outbox.inbox ORDER BY 1") == [("1",), ("2",)]


# -- end to end: a real server, MqClient consumers killed at the two points ---------------

CONSUMER = r"""
import logging, os, sys, threading
import psycopg
from dmq_client import MqClient, MqConfig, inbox

servers, app_dsn, crash = sys.argv[1:4]
# the client's own lines (connected, subscribed, lost) go to the test with the others: a CI
# run once saw the second consumer say "subscribed" and then nothing for 30 s
logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="log %(name)s: %(message)s")
conn = psycopg.connect(app_dsn)

def say(*words):
    print(*words, flush=True)

class Handler:
    def on_message(self, message):
        def ack(m):
            if crash == "before_ack":
                say("dying before the ack of", m.message_id)
                os._exit(9)
            m.ack()
            say("acked", m.message_id)
        with inbox.transaction(conn, message, ack=ack) as fresh:
            if not fresh:
                say("skipped", message.message_id)
            else:
                conn.execute("INSERT INTO effects VALUES (%s, %s)", (message.message_id, message.body))
                say("applied", message.message_id)
                if crash == "before_commit":
                    os._exit(9)

with MqClient(MqConfig(servers=servers, handler_threads=1)) as client:
    client.subscribe("orders", "billing", Handler(), auto_ack=False, credit=10)
    say("subscribed")
    sys.stdin.read()  # until the test closes it
"""


class Consumer:
    """A consumer process whose lines are read with a deadline."""

    def __init__(self, servers: str, app_dsn: str, crash: str):
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CONSUMER, servers, app_dsn, crash],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, text=True,
        )
        self.lines: list[str] = []

    def expect(self, line: str, context=lambda: "") -> None:
        """Wait for ``line``; on failure the message adds ``context()`` (the server's view)."""
        deadline = time.monotonic() + WAIT
        with selectors.DefaultSelector() as sel:
            sel.register(self.proc.stdout, selectors.EVENT_READ)
            while line not in self.lines:
                if not sel.select(max(0.0, deadline - time.monotonic())):
                    raise AssertionError(f"no {line!r}; saw {self.lines}{context()}")
                got = self.proc.stdout.readline()
                assert got, f"consumer exited ({self.proc.wait()}) before {line!r}; saw {self.lines}"
                self.lines.append(got.rstrip("\n"))

    def died(self) -> int:
        return self.proc.wait(WAIT)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(WAIT)
        self.proc.stdout.close()
        if not self.proc.stdin.closed:
            self.proc.stdin.close()


@pytest.fixture
def consumers():
    started: list[Consumer] = []

    def start(*args: str) -> Consumer:
        started.append(Consumer(*args))
        return started[-1]

    yield start
    for consumer in started:
        if consumer.proc.poll() is None:
            consumer.proc.kill()
        consumer.close()


@pytest.mark.parametrize("crash, then_says", [("before_ack", "skipped"), ("before_commit", "applied")])
def test_a_consumer_killed_around_its_commit_has_each_effect_once(
    make_server, topic, pg_dsn, app_dsn, consumers, crash, then_says
):
    """Killed between its commit and its ack: the message comes back, is skipped and acked.
    Killed between the handler and the commit: rolled back, comes back, applied. Either
    way the business table holds the message's effect exactly once and dmq has nothing
    left to deliver."""
    server = make_server()
    servers = f"127.0.0.1:{server.tcp_port}"
    with server.client() as producer:
        reply = producer.send(topic, b"order 1")
    message_id = reply.message_id

    first = consumers(servers, app_dsn, crash)
    first.expect(f"applied {message_id}")
    assert first.died() == 9
    committed = db_rows(app_dsn, "SELECT count(*) FROM effects")[0][0]
    assert committed == (1 if crash == "before_ack" else 0)

    second = consumers(servers, app_dsn, "none")

    def server_view() -> str:
        status, body = http_get(server.http + "/stats?format=json")
        return f"\nthe server's /stats: {body[:3000]!r}\nits log: {server.log()}"

    second.expect(f"{then_says} {message_id}", server_view)
    second.expect(f"acked {message_id}")
    wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)], timeout=WAIT)
    second.close()
    assert db_rows(app_dsn, "SELECT message_id, body FROM effects") == [(message_id, b"order 1")]
    assert db_rows(app_dsn, "SELECT channel, message_id FROM dmq_outbox.inbox") == [
        ("orders/billing", str(message_id))
    ]
