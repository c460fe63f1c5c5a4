"""Confirmation when consumed (issue 44 §3, docs/protocol.md §4.14) across the nodes of a
cluster: ZooKeeper, two dmq-server processes on one PostgreSQL, real clients.

The node that stored a message watches it and asks PostgreSQL (the cursors and dead
letters), never its channels in memory, so acknowledgements taken by another node count.
Node A stores; its copies are taken over by node B while A is frozen (SIGSTOP past its
session timeout, as a long pause), consumed and dead-lettered there; A, thawed, tells the
producer on its connection. Killed instead, A takes its watches along: the producer hears
LOST (the documented promise), and a resend of the message through B watches it again
there."""

from __future__ import annotations

import signal

import pytest

from dmq_client import ConsumeStatus, Message, MqClient, Status
from dmq_client.blocking import ClientError
from dmq_client.wire import Command, parse_consumed
from tests.integration.support import db_rows, wait_for
from tests.integration.test_client import fast_config
from tests.integration.test_confirm_consumed import acked_in_postgres, take

from .helpers import register_topic, wait_served

WAIT = 30.0


def holders(dsn: str) -> dict[str, int]:
    """Which node delivers the copies still waiting, and how many."""
    return dict(db_rows(dsn, "SELECT holder, count(*) FROM dmq_pending GROUP BY holder"))


def stored(producer, topic: str, body: bytes, confirm_timeout: float):
    """A send's reply once it was stored: a node thawed after its incarnation was retired
    refuses sends (E_FENCED) until it began a new one; the producer resends (idempotent)."""
    first = producer.send(topic, body, confirm_timeout=confirm_timeout)
    replies = [first]

    def again():
        if replies[-1].command == Command.SEND_SUCCESS_ACK:
            return replies[-1]
        assert "E_FENCED" in replies[-1].status, replies[-1]
        replies.append(producer.send(topic, body, session_id=first.session_id, resend=True,
                                     confirm_timeout=confirm_timeout))
        return None

    return wait_for(again, timeout=WAIT)


def consume_on(node, topic: str, channel: str, message_id: int) -> None:
    """``message_id`` received and acknowledged on ``channel`` through ``node``, durably."""
    with node.client() as consumer:
        assert consumer.subscribe(topic, channel, credit=10).command == Command.SUBSCRIBE_ACK
        consumer.ack(take(consumer, message_id))
        wait_for(lambda: acked_in_postgres(node.dsn, topic, channel, message_id), timeout=WAIT)


def test_acks_and_a_dead_letter_taken_by_the_node_that_took_over_are_confirmed_by_the_storing_node(
        make_node, zk, pg_dsn):
    """A producer on A asks to be told about two messages: ``orders`` (channels a, b) and
    ``perishable`` (a, b; one attempt of 1 s each). A is frozen right after both were
    stored; B takes their copies over. Through B, channel a acknowledges both, and b's
    copy of ``perishable`` is pushed and never acknowledged (a dead letter). A, thawed,
    has not answered ``orders`` while b still holds it (a probe's deadline report comes
    from a statement asked after a's ack was durable), then answers CONSUMED naming a and
    b once b acknowledged through B, and E_DEAD_LETTERED naming b for ``perishable``."""
    register_topic(zk, "orders", "a", "b")
    register_topic(zk, "perishable", "a", "b", msg_timeout_ms=1000, max_attempts=1)
    a, b = make_node(), make_node()
    for node in (a, b):
        for topic in ("orders", "perishable"):
            for channel in ("a", "b"):
                wait_served(node, topic, channel)
    a_id, b_id = a.flags["node_id"], b.flags["node_id"]
    producer = a.client()
    try:
        order = producer.send("orders", b"order 1", confirm_timeout=120)
        fragile = producer.send("perishable", b"fragile", confirm_timeout=120)
        assert order.command == fragile.command == Command.SEND_SUCCESS_ACK
        assert holders(pg_dsn) == {a_id: 4}

        a.proc.send_signal(signal.SIGSTOP)  # A stores and watches, but does nothing more until thawed
        try:
            wait_for(lambda: holders(pg_dsn) == {b_id: 4}, timeout=WAIT)  # B took the copies over
            consume_on(b, "orders", "a", order.message_id)
            consume_on(b, "perishable", "a", fragile.message_id)
            with b.client() as lets_expire:
                assert lets_expire.subscribe("perishable", "b").command == Command.SUBSCRIBE_ACK
                take(lets_expire, fragile.message_id)  # its one attempt, never acknowledged
                wait_for(lambda: db_rows(pg_dsn, "SELECT channel FROM dmq_dead_letter WHERE message_id = %s",
                                         fragile.message_id) == [("b",)], timeout=WAIT)
        finally:
            a.proc.send_signal(signal.SIGCONT)

        report = parse_consumed(producer.wait_consumed(fragile.session_id, timeout=WAIT).status)
        assert (report.code, report.acked, report.dead, report.waiting) == ("E_DEAD_LETTERED", ("a",), ("b",), ())
        probe = stored(producer, "orders", b"probe", confirm_timeout=0.3)
        late = parse_consumed(producer.wait_consumed(probe.session_id, timeout=WAIT).status)
        assert (late.code, late.waiting) == ("E_DEADLINE", ("a", "b"))
        with pytest.raises(ClientError):  # asked with the probe: one channel of two is not enough
            producer.wait_consumed(order.session_id, timeout=0)

        consume_on(b, "orders", "b", order.message_id)
        frame = producer.wait_consumed(order.session_id, timeout=WAIT)
        assert (frame.command, frame.message_id, frame.topic) == (Command.SEND_CONSUMED_ACK, order.message_id, "orders")
        report = parse_consumed(frame.status)
        assert (report.code, report.acked, report.dead, report.waiting) == ("CONSUMED", ("a", "b"), (), ())
    finally:
        producer.close()


def test_the_storing_node_killed_the_producer_hears_lost_and_a_resend_through_the_other_node_confirms(
        make_node, zk, pg_dsn):
    """A producer on A asks to be told about a message; A is killed (kill -9) before any
    channel took it. The watch went with A: the producer hears LOST at once, not after
    its deadline (docs/protocol.md §4.14, "Lost with the connection"). B takes the copies
    over; the producer resends the message through B (``MqClient.resend`` with
    ``confirm``): answered as a duplicate (stored once), it is watched by B, which answers
    only once both channels acknowledged through B."""
    register_topic(zk, "orders", "a", "b")
    a, b = make_node(), make_node()
    for node in (a, b):
        for channel in ("a", "b"):
            wait_served(node, "orders", channel)
    b_id = b.flags["node_id"]
    with MqClient(fast_config(a)) as client:
        future = client.send(Message("orders", b"order 7"), confirm="consumed", confirm_timeout=600)
        sent = future.result(WAIT)
        assert sent.status is Status.SUCCESS
        a.kill()
        lost = future.consumed.result(WAIT)  # well before the deadline of 600 s
        assert lost.status is ConsumeStatus.LOST and lost.message_id == sent.message_id

    wait_for(lambda: holders(pg_dsn) == {b_id: 2}, timeout=WAIT)
    with MqClient(fast_config(b)) as client:
        watched = client.resend(sent, confirm="consumed", confirm_timeout=120)
        redone = watched.result(WAIT)
        assert (redone.status, redone.message_id, redone.duplicate) == (Status.SUCCESS, sent.message_id, True)
        consume_on(b, "orders", "a", sent.message_id)
        probe = client.send(Message("orders", b"probe"), confirm="consumed", confirm_timeout=0.3)
        assert probe.consumed.result(WAIT).status is ConsumeStatus.DEADLINE
        assert not watched.consumed.done(), "resolved with one channel of two acknowledged"
        consume_on(b, "orders", "b", sent.message_id)
        consumed = watched.consumed.result(WAIT)
        assert (consumed.status, consumed.acked, consumed.dead, consumed.message_id) == (
            ConsumeStatus.CONSUMED, ("a", "b"), (), sent.message_id)
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_message WHERE body = %s", b"order 7") == [(1,)]
