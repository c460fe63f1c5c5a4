"""Writes whose outcome is unknown, and PostgreSQL failing under load: counted.

Every id acknowledged to a producer must reach every channel of its topic, without
restarting dmq. The dangerous case is a commit whose answer was lost: the producer
hears an error and resends, the resend finds the stored row and is answered as a
duplicate, and no channel was ever handed the message unless the server looks in
the store (``Broker.outcome_unknown``).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from typing import Any

import psycopg

from dmq_server.db.schema import migrate
from dmq_server.db.worker import connect
import registry

from .faults import CountingConsumer, NsqMpubProducer, PgProxy, ResendingProducer
from .support import db_rows, wait_for

CHANNELS = ["billing", "audit"]


def _register(dsn: str, topic: str = "orders") -> None:
    migrate(dsn)
    with connect(dsn, autocommit=True) as conn:
        registry.create_topic(conn, topic, msg_timeout_ms=60000)
        for channel in CHANNELS:
            registry.add_channel(conn, topic, channel)


def _await_all_delivered(consumer: CountingConsumer, acked: dict[int, bytes], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        missing = consumer.missing(acked)
        if not any(missing.values()):
            return
        assert consumer.failure is None, consumer.failure
        if time.monotonic() > deadline:
            counts = {c: len(ids) for c, ids in missing.items()}
            raise AssertionError(
                f"acknowledged but never delivered, per channel: {counts} of {len(acked)} "
                f"(e.g. {sorted(set().union(*missing.values()))[:5]})"
            )
        time.sleep(0.05)


def _served(make_server, pg_private) -> tuple[str, Any, CountingConsumer]:
    """A private PostgreSQL, a dmq-server on it with ``orders`` registered, and a
    consumer subscribed to each of its channels."""
    dsn = pg_private.start()
    _register(dsn)
    server = make_server(dsn=dsn)
    consumer = CountingConsumer(server.tcp_port, "orders", CHANNELS)
    consumer.start()
    assert consumer.subscribed.wait(15) and consumer.failure is None
    return dsn, server, consumer


def _check_every_acknowledged(producers: list[ResendingProducer], consumer: CountingConsumer, dsn: str,
                              deadline: float, expected: int, unique_prefix: bytes = b"") -> None:
    """Every producer had each of its bodies acknowledged (after resends: the faults
    were felt), every id acknowledged reached every channel, and each holds its body."""
    for producer in producers:
        producer.join(max(deadline - time.monotonic(), 1) + 10)
        assert producer.failure is None, producer.failure
        assert len(producer.acked) == len(producer.bodies), (len(producer.acked), producer.errors[-3:])
    all_acked = {mid: body for p in producers for mid, body in p.acked.items()}
    assert len(all_acked) == expected
    assert sum(p.resends for p in producers) > 0

    _await_all_delivered(consumer, all_acked, timeout=60)
    consumer.stop.set()
    consumer.join(10)
    _check_stored(dsn, all_acked, unique_prefix)


def _check_stored(dsn: str, acked: dict[int, bytes], unique_prefix: bytes = b"") -> None:
    """Each acknowledged id holds the body it was acknowledged for, and no body (of those
    starting with ``unique_prefix``: the dmq producers') was stored twice (a resend is
    recognised as a resend)."""
    rows = dict(db_rows(dsn, "SELECT id, body FROM dmq_message WHERE id = ANY(%s)", list(acked)))
    assert {mid: bytes(body) for mid, body in rows.items()} == acked
    (total, distinct), = db_rows(
        dsn, "SELECT count(*), count(DISTINCT body) FROM dmq_message WHERE position(%s IN body) = 1",
        unique_prefix)
    assert total == distinct


def test_a_commit_whose_answer_was_lost_reaches_every_channel_without_a_restart(make_server, pg_dsn):
    """The answer to a committed group-commit batch is lost (the connection is cut after
    PostgreSQL finished the statement). Its producers hear SEND_SERVER_ERROR, resend, and
    are answered as duplicates; the messages must still reach both channels."""
    _register(pg_dsn)
    proxy = PgProxy.for_dsn(pg_dsn)
    try:
        server = make_server(dsn=proxy.dsn_for(pg_dsn))
        consumer = CountingConsumer(server.tcp_port, "orders", CHANNELS)
        consumer.start()
        assert consumer.subscribed.wait(15) and consumer.failure is None

        marker = b"lose-my-reply-" + uuid.uuid4().hex.encode()
        bodies = [b"m-%d" % i for i in range(300)]
        bodies[150] = marker
        proxy.lose_reply_once(marker)
        producer = ResendingProducer(server.tcp_port, "orders", bodies, deadline=time.monotonic() + 60)
        producer.start()
        producer.join(70)
        assert producer.failure is None, producer.failure
        assert proxy.replies_lost == 1
        assert any("E_STORAGE" in e for e in producer.errors), producer.errors
        assert len(producer.acked) == len(bodies)

        _await_all_delivered(consumer, producer.acked, timeout=30)
        consumer.stop.set()
        consumer.join(10)
        _check_stored(pg_dsn, producer.acked)
        assert server.proc.poll() is None  # the same server process did it
    finally:
        proxy.close()


def _backend_pids(dsn: str) -> list[int]:
    """dmq's connections to the test database ([] while PostgreSQL is not answering)."""
    try:
        rows = db_rows(
            dsn,
            "SELECT pid FROM pg_stat_activity"
            " WHERE application_name = 'dmq' AND datname = current_database()",
        )
    except psycopg.OperationalError:
        return []
    return [r[0] for r in rows]


def test_postgres_failures_under_load_lose_nothing_acknowledged(make_server, pg_private):
    """Three producers send while PostgreSQL fails three ways (a backend SIGKILLed, which
    restarts every backend; ``pg_ctl stop -m immediate``; the postmaster SIGKILLed), each
    followed by PostgreSQL coming back. dmq is never restarted. Every id acknowledged to
    a producer is delivered to both channels, and holds its body."""
    dsn, server, consumer = _served(make_server, pg_private)

    deadline = time.monotonic() + 150
    producers = [
        ResendingProducer(
            server.tcp_port, "orders", [b"p%d-%d" % (p, i) for i in range(4000)], deadline=deadline
        )
        for p in range(3)
    ]
    for producer in producers:
        producer.start()

    def acked() -> int:
        return sum(len(p.acked) for p in producers)

    def restart() -> None:
        pg_private.start()
        wait_for(lambda: _backend_pids(dsn), timeout=30)  # dmq reconnected

    faults = []
    # 1. a backend killed: the postmaster restarts every backend (crash recovery)
    wait_for(lambda: acked() >= 1000, timeout=60)
    os.kill(_backend_pids(dsn)[0], signal.SIGKILL)
    faults.append("backend SIGKILL")
    wait_for(lambda: _backend_pids(dsn), timeout=30)
    # 2. an immediate stop, then a start
    mark = acked()
    wait_for(lambda: acked() >= mark + 1000, timeout=60)
    pg_private.stop(mode="immediate")
    faults.append("pg_ctl stop -m immediate")
    restart()
    # 3. the postmaster and its children SIGKILLed, then a start (crash recovery)
    mark = acked()
    wait_for(lambda: acked() >= mark + 1000, timeout=60)
    pg_private.kill()
    faults.append("postmaster SIGKILL")
    restart()

    _check_every_acknowledged(producers, consumer, dsn, deadline, 12000)
    assert server.proc.poll() is None, faults


def test_runs_of_sends_in_one_read_lose_nothing_acknowledged_when_postgres_fails(make_server, pg_private):
    """Producers that write their whole window of sends at once (the server admits each
    read's run of sends in one call, ``Broker.publish_each``), resending after every
    error or broken connection, and an NSQ producer of ``MPUB``s (whose bodies reach the
    group commit in one call too), while PostgreSQL's backends are SIGKILLed and then its
    postmaster is, and it comes back. Every id acknowledged reaches both channels and
    holds its body, no dmq send is stored twice, and every body of an ``MPUB`` answered
    OK is stored and reaches both channels."""
    dsn, server, consumer = _served(make_server, pg_private)
    deadline = time.monotonic() + 120
    producers = [
        ResendingProducer(server.tcp_port, "orders", [b"r%d-%d" % (p, i) for i in range(3000)],
                          window=64, burst=True, deadline=deadline)
        for p in range(2)
    ]
    nsq = NsqMpubProducer(server.tcp_port, "orders", [b"n-%d" % i for i in range(3000)], deadline=deadline)
    for producer in [*producers, nsq]:
        producer.start()

    def acked() -> int:
        return sum(len(p.acked) for p in producers) + len(nsq.acked)

    wait_for(lambda: acked() >= 1000, timeout=60)
    os.kill(_backend_pids(dsn)[0], signal.SIGKILL)  # every backend restarts: commits in flight are lost
    wait_for(lambda: _backend_pids(dsn), timeout=30)
    mark = acked()
    wait_for(lambda: acked() >= mark + 1000, timeout=60)
    pg_private.kill()
    pg_private.start()
    wait_for(lambda: _backend_pids(dsn), timeout=30)

    nsq.join(max(deadline - time.monotonic(), 1) + 10)
    assert nsq.failure is None, nsq.failure
    assert sorted(nsq.acked) == sorted(b"n-%d" % i for i in range(3000)), nsq.errors[-3:]
    try:
        wait_for(lambda: not any(consumer.missing_bodies(nsq.acked).values()), timeout=60)
    except AssertionError:
        counts = consumer.missing_bodies(nsq.acked)
        raise AssertionError(f"MPUB bodies answered OK, never delivered, per channel: {counts}") from None
    _check_every_acknowledged(producers, consumer, dsn, deadline, 6000, unique_prefix=b"r")
    stored = {bytes(body) for (body,) in db_rows(dsn, "SELECT body FROM dmq_message")}
    assert set(nsq.acked) <= stored
    assert server.proc.poll() is None
