"""Priority end to end (issue 45 §3): real dmq-server processes on real PostgreSQL, real
sockets, the blocking client.

A channel pushes its waiting copies highest priority first, then in id order, with the
backlog in PostgreSQL and a small memory window (``--mem-queue-size 20``): the read-ahead
brings each priority from the store before the id order of the rest, and a restart
reads them the same way. A message of a high priority sent while a full window of lower
ones waits goes out before them. Counted: every id acknowledged to the producer is
delivered, in that order, none lost across the restart.
"""

from __future__ import annotations

import random

import pytest

from dmq_client.message import ReceivedMessage
from dmq_client.wire import Command

from .support import db_rows, wait_for

pytestmark = pytest.mark.integration

WINDOW = "20"


def _topic(dsn: str, name: str = "jobs", channel: str = "workers") -> str:
    from dmq_server.db.worker import connect
    import registry

    with connect(dsn, autocommit=True) as conn:
        registry.create_topic(conn, name, msg_timeout_ms=30_000)
        registry.add_channel(conn, name, channel)
    return name


def _send(producer, topic: str, body: bytes, priority: int) -> int:
    reply = producer.send(topic, body, priority=priority)
    assert reply.command == Command.SEND_SUCCESS_ACK, reply.status
    return reply.message_id


def _priority(push) -> int:
    return ReceivedMessage.properties_of(push.status).priority


def test_a_backlog_goes_out_highest_priority_first_across_a_restart(make_server, pg_dsn):
    """600 messages of random priority (0 to 9) stored before anyone consumes, 20 of them
    at most in memory: the consumer gets them sorted by priority, then id. Half way the
    server stops with copies in flight; the restarted one goes on from the highest
    priority left, the unacknowledged copies again first."""
    topic = _topic(pg_dsn)
    rng = random.Random(45)
    server = make_server(mem_queue_size=WINDOW)
    with server.client() as producer:
        sent = {_send(producer, topic, b"%d" % i, p): p for i, p in enumerate(rng.choice(range(10)) for _ in range(600))}
    expected = sorted(sent, key=lambda mid: (-sent[mid], mid))
    first: list[int] = []  # first deliveries, in order
    acked: set[int] = set()

    def consume(server, until: int, hold: int = 0) -> None:
        """First deliveries up to ``until``, all acknowledged but the last ``hold``."""
        with server.client() as consumer:
            assert consumer.subscribe(topic, "workers", credit=10).command == Command.SUBSCRIBE_ACK
            while len(first) < until or len(acked) < until - hold:
                push = consumer.receive(timeout=10)
                assert push is not None, f"nothing more after {len(acked)} acknowledged"
                assert _priority(push) == sent[push.message_id]
                if push.message_id not in first:
                    first.append(push.message_id)
                if push.attempts > 1 or first.index(push.message_id) < until - hold:
                    consumer.ack(push)
                    acked.add(push.message_id)

    consume(server, 300, hold=10)  # ten in flight, unacknowledged, through the stop
    server.stop()
    restarted = make_server(mem_queue_size=WINDOW)
    consume(restarted, 600)
    assert acked == set(sent), f"lost: {sorted(set(sent) - acked)[:10]}"
    assert first == expected
    wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)])


def test_a_high_priority_sent_to_a_full_window_goes_out_next(make_server, pg_dsn):
    """300 messages of priority 0 wait (20 in memory, the rest stored); a consumer with
    credit 5 works through them. A priority-9 message sent then goes out before every
    lower copy not yet pushed: at most the 5 already out come before it."""
    topic = _topic(pg_dsn)
    server = make_server(mem_queue_size=WINDOW)
    with server.client() as producer, server.client() as consumer:
        low = [_send(producer, topic, b"low", 0) for _ in range(300)]
        assert consumer.subscribe(topic, "workers", credit=5).command == Command.SUBSCRIBE_ACK
        got: list[int] = []
        for _ in range(30):
            push = consumer.receive(timeout=10)
            got.append(push.message_id)
            consumer.ack(push)
        urgent = _send(producer, topic, b"urgent", 9)
        while urgent not in got:
            push = consumer.receive(timeout=10)
            assert push is not None, "the priority-9 message never came"
            got.append(push.message_id)
            consumer.ack(push)
        passed = got.index(urgent) - 30
        assert passed <= 5, f"{passed} copies of priority 0 went out after the priority-9 one was stored"
        while len(got) < 301:
            push = consumer.receive(timeout=10)
            assert push is not None, f"lost: {sorted(set(low) - set(got))[:10]}"
            got.append(push.message_id)
            consumer.ack(push)
        assert sorted(got) == sorted(low + [urgent])
        rest = [mid for mid in got if mid != urgent]
        assert rest == sorted(rest)  # the others in id order
