"""Confirmation when consumed (issue 44 §3, docs/protocol.md §4.14), end to end.

A real dmq-server on a real PostgreSQL; the producer is ``MqClient`` or the blocking
client, the consumers are blocking clients acknowledging by hand, so each test decides
which channel is done when. What a test waits for is an event (a reply, a frame, a row
in PostgreSQL), never a pause.
"""

from __future__ import annotations

from dmq_client import ConsumeStatus, Message, MqClient, Status
from dmq_client.wire import FEATURE_CONFIRM, Command, parse_consumed

from .support import db_rows, wait_for
from .test_client import WAIT, fast_config
from .test_deadletters import make_topic


def acked_in_postgres(dsn: str, topic: str, channel: str, message_id: int) -> bool:
    """The channel's cursor covers the id: its ack is durable."""
    return bool(db_rows(
        dsn, "SELECT 1 FROM dmq_cursor WHERE topic = %s AND channel = %s AND (floor >= %s OR done @> %s::bigint)",
        topic, channel, message_id, message_id))


def take(consumer, message_id: int):
    """The push of ``message_id`` (others pushed meanwhile are left unacknowledged)."""
    while True:
        push = consumer.receive(timeout=WAIT)
        assert push is not None, f"message {message_id} was not pushed"
        if push.message_id == message_id:
            return push


def test_consumed_only_after_both_channels_acked_and_a_deadline_names_the_waiting(make_server, pg_dsn):
    """Two channels: after the first acked (durably) the confirmation is still open, and a
    second message whose deadline passes meanwhile reports both channels waiting; once
    the second channel acked, the first message resolves CONSUMED naming both."""
    topic = make_topic(pg_dsn, "confirmed", channels=("a", "b"))
    server = make_server()
    with MqClient(fast_config(server)) as producer, server.client() as a, server.client() as b:
        assert a.subscribe(topic, "a").command == Command.SUBSCRIBE_ACK
        assert b.subscribe(topic, "b").command == Command.SUBSCRIBE_ACK
        future = producer.send(Message(topic, b"order 1"), confirm="consumed", confirm_timeout=60)
        sent = future.result(WAIT)
        assert sent.status is Status.SUCCESS
        a.ack(take(a, sent.message_id))
        wait_for(lambda: acked_in_postgres(pg_dsn, topic, "a", sent.message_id), WAIT)
        # a probe sent now: its deadline's report comes from a statement that also asked
        # about the first message, after channel a's ack was durable
        probe = producer.send(Message(topic, b"probe"), confirm="consumed", confirm_timeout=0.3)
        late = probe.consumed.result(WAIT)
        assert late.status is ConsumeStatus.DEADLINE
        assert late.waiting == ("a", "b") and late.acked == () and late.message_id == probe.result(WAIT).message_id
        assert not future.consumed.done(), "resolved with one channel of two acknowledged"
        b.ack(take(b, sent.message_id))
        consumed = future.consumed.result(WAIT)
        assert consumed.status is ConsumeStatus.CONSUMED and consumed.ok
        assert consumed.acked == ("a", "b") and consumed.dead == () and consumed.waiting == ()
        assert (consumed.message_id, consumed.session_id, consumed.topic) == (sent.message_id, sent.session_id, topic)
        assert acked_in_postgres(pg_dsn, topic, "b", sent.message_id)


def test_a_dead_lettered_copy_is_reported_with_its_channel(make_server, pg_dsn):
    """Channel a acknowledges, channel b lets its copy expire (the topic's time to live):
    the blocking client's confirmation is E_DEAD_LETTERED with b dead and a acked."""
    topic = make_topic(pg_dsn, "expiring", channels=("a", "b"), ttl_ms=1500)
    server = make_server()
    with server.client() as producer, server.client() as a:
        a.subscribe(topic, "a")
        reply = producer.send(topic, b"perishable", confirm_timeout=60)
        assert reply.command == Command.SEND_SUCCESS_ACK
        a.ack(take(a, reply.message_id))
        frame = producer.wait_consumed(reply.session_id, timeout=WAIT)
        assert (frame.command, frame.message_id, frame.topic) == (Command.SEND_CONSUMED_ACK, reply.message_id, topic)
        report = parse_consumed(frame.status)
        assert (report.code, report.acked, report.dead, report.waiting) == ("E_DEAD_LETTERED", ("a",), ("b",), ())
        assert db_rows(pg_dsn, "SELECT reason, channel FROM dmq_dead_letter WHERE message_id = %s",
                       reply.message_id) == [("expired", "b")]


def test_sends_without_the_field_are_not_watched(make_server, pg_dsn):
    """An old client's frames (credit 0) are answered as before and never get a
    SEND_CONSUMED_ACK; the greeting's status is still OK, its body lists the features."""
    topic = make_topic(pg_dsn, "plain", channels=("a",))
    server = make_server()
    with server.client() as producer, server.client() as a:
        greeting = producer.next_frame(WAIT)
        assert greeting is not None and greeting.command == Command.SERVER_HEALTH and greeting.status == "OK"
        assert FEATURE_CONFIRM in greeting.body.decode().split()
        a.subscribe(topic, "a")
        old = producer.send(topic, b"old style")
        assert old.command == Command.SEND_SUCCESS_ACK
        a.ack(take(a, old.message_id))
        wait_for(lambda: acked_in_postgres(pg_dsn, topic, "a", old.message_id), WAIT)
        # a confirmed send after it, answered only once the old one was done: had the
        # old one been watched, its answer would have come first
        probe = producer.send(topic, b"probe", confirm_timeout=60)
        a.ack(take(a, probe.message_id))
        assert parse_consumed(producer.wait_consumed(probe.session_id, timeout=WAIT).status).code == "CONSUMED"
        assert [f for f in producer.drain(timeout=0.2) if f.command == Command.SEND_CONSUMED_ACK] == []


def test_a_restart_of_the_watching_server_reports_the_confirmation_lost(make_server, pg_dsn):
    """The watches live in the memory of the server that stored the message: killed, it
    takes them along, and the client reports LOST as its connection drops (the message
    stays stored and is delivered after the restart)."""
    topic = make_topic(pg_dsn, "restarted", channels=("a", "b"))
    server = make_server()
    with MqClient(fast_config(server)) as producer:
        future = producer.send(Message(topic, b"x"), confirm="consumed", confirm_timeout=60)
        sent = future.result(WAIT)
        assert sent.status is Status.SUCCESS
        server.kill()
        lost = future.consumed.result(WAIT)
        assert lost.status is ConsumeStatus.LOST and "was lost" in lost.description
        assert lost.message_id == sent.message_id
    server.start()
    with server.client() as a:
        a.subscribe(topic, "a")
        assert take(a, sent.message_id).body == b"x"
