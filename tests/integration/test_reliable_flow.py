"""The reliable flow end to end: a real dmq-server, real PostgreSQL, real sockets."""

from __future__ import annotations

import json

import pytest

from dmq_client.wire import Command

from .support import db_rows, http_get, run_cli, wait_for


@pytest.mark.parametrize("db_io", ["reactor", "threads"])
def test_send_store_push_ack_remove(make_server, topic, pg_dsn, db_io):
    """A send is stored before its ack, pushed to the channel, and its ack is made durable,
    with the group commit and the acker on the reactor's connections or on threads."""
    server = make_server(db_io=db_io)
    with server.client() as producer, server.client() as consumer:
        reply = producer.send(topic, b"hello")
        assert reply.command == Command.SEND_SUCCESS_ACK
        assert reply.message_id > 0
        # stored and fanned out before the producer heard SEND_SUCCESS_ACK
        assert db_rows(pg_dsn, "SELECT body FROM dmq_message WHERE id = %s", reply.message_id) == [
            (b"hello",)
        ]
        assert db_rows(
            pg_dsn, "SELECT channel FROM dmq_pending WHERE message_id = %s", reply.message_id
        ) == [("billing",)]

        assert consumer.subscribe(topic, "billing").command == Command.SUBSCRIBE_ACK
        push = consumer.receive(timeout=10)
        assert push is not None and push.command == Command.CONSUMER_PUSH
        assert (push.message_id, push.body, push.topic, push.channel) == (
            reply.message_id,
            b"hello",
            topic,
            "billing",
        )
        assert push.session_id == reply.session_id and push.producer == producer.producer
        assert push.attempts == 1
        consumer.ack(push)

        wait_for(lambda: not db_rows(pg_dsn, "SELECT 1 FROM dmq_pending"))
        log = db_rows(
            pg_dsn,
            "SELECT message_id, channel, attempts, first_delivered_at IS NOT NULL FROM dmq_delivery_log",
        )
        assert log == [(reply.message_id, "billing", 1, True)]


def test_every_channel_gets_its_copy_and_one_consumer_per_channel(make_server, topic, pg_dsn):
    """Each channel receives every message; within a channel each goes to one consumer."""
    run_cli(pg_dsn, "channel", "add", topic, "audit").check_returncode()
    server = make_server()
    with server.client() as producer, server.client() as a1, server.client() as a2, server.client() as b:
        for c, ch in ((a1, "billing"), (a2, "billing"), (b, "audit")):
            assert c.subscribe(topic, ch).command == Command.SUBSCRIBE_ACK
        replies = producer.send_many(topic, [b"m%d" % i for i in range(40)])
        ids = {r.message_id for r in replies}
        assert all(r.command == Command.SEND_SUCCESS_ACK for r in replies)

        def drain(client):
            got = []
            while (push := client.receive(timeout=1.0)) is not None:
                client.ack(push)
                got.append(push.message_id)
            return got

        billing = drain(a1) + drain(a2)
        audit = drain(b)
        assert sorted(billing) == sorted(ids)  # each exactly once across the group
        assert sorted(audit) == sorted(ids)


def test_resend_is_answered_from_the_stored_row(make_server, topic, pg_dsn):
    """UP_PRODUCER_RESEND with a stored (producer, session id) returns the same id, stores nothing."""
    server = make_server()
    with server.client() as producer:
        first = producer.send(topic, b"once", session_id=42)
        again = producer.send(topic, b"once", session_id=42, resend=True)
        assert first.command == again.command == Command.SEND_SUCCESS_ACK
        assert again.message_id == first.message_id
        assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_message") == [(1,)]
        assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(1,)]
    # a different producer may use the same session id
    with server.client() as other:
        assert other.send(topic, b"other", session_id=42).message_id != first.message_id


def test_refusals_are_specific(make_server, topic, pg_dsn):
    """Unknown topics, unregistered channels, bad names and big bodies each get their own reply."""
    run_cli(pg_dsn, "topic", "create", "lonely").check_returncode()  # no channel
    server = make_server(max_msg_size=1024)
    with server.client() as c:
        assert c.send("nosuch", b"x").command == Command.SEND_NO_TOPIC_ACK
        assert c.send("lonely", b"x").command == Command.SEND_NO_TOPIC_ACK
        bad = c.send("bad topic!", b"x")
        assert bad.command == Command.SEND_INVALID_ACK and bad.status.startswith("E_BAD_TOPIC")
        big = c.send(topic, b"x" * 1025)
        assert big.command == Command.SEND_INVALID_ACK and big.status.startswith("E_BAD_BODY")
        neg = c.send(topic, b"x", session_id=-1)
        assert neg.command == Command.SEND_INVALID_ACK and "negative" in neg.status
        assert c.send(topic, b"x" * 1024).command == Command.SEND_SUCCESS_ACK

        assert c.subscribe("nosuch", "billing").command == Command.SUBSCRIBE_NO_TOPIC_ACK
        assert c.subscribe(topic, "nobody").command == Command.SUBSCRIBE_NO_CLIENT_ID_ACK
        assert c.subscribe(topic, "bad/chan").command == Command.SUBSCRIBE_INVALID_ACK
        assert c.subscribe(topic, "billing").command == Command.SUBSCRIBE_ACK
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_message") == [(1,)]


def test_backlog_beyond_memory_is_delivered_once_in_order(make_server, topic, pg_dsn):
    """Messages stored with no consumer, more than the memory window, arrive on subscribe."""
    server = make_server(mem_queue_size=50)
    with server.client() as producer:
        replies = producer.send_many(topic, [b"%05d" % i for i in range(500)], window=64)
    ids = [r.message_id for r in replies]
    with server.client() as consumer:
        consumer.subscribe(topic, "billing", credit=20)
        got = []
        while len(got) < 500:
            push = consumer.receive(timeout=10)
            assert push is not None, f"only {len(got)} of 500 delivered"
            got.append(push.message_id)
            consumer.ack(push)
        assert consumer.receive(timeout=0.5) is None
    assert got == sorted(ids)
    wait_for(lambda: db_rows(pg_dsn, "SELECT count(*) FROM dmq_pending") == [(0,)])


def test_credit_limits_unacknowledged_pushes(make_server, topic):
    """A consumer with credit 2 holds at most 2 unacknowledged messages."""
    server = make_server()
    with server.client() as producer, server.client() as consumer:
        producer.send_many(topic, [b"a", b"b", b"c", b"d", b"e"])
        consumer.subscribe(topic, "billing", credit=2)
        first = [consumer.receive(timeout=5), consumer.receive(timeout=5)]
        assert all(first)
        assert consumer.receive(timeout=0.5) is None
        consumer.ack(first[0])
        third = consumer.receive(timeout=5)
        assert third is not None
        assert consumer.receive(timeout=0.5) is None
        consumer.credit(topic, "billing", 10)
        rest = [consumer.receive(timeout=5), consumer.receive(timeout=5)]
        assert all(rest)


def test_unacknowledged_copy_returns_after_timeout_and_on_disconnect(make_server, pg_dsn):
    """An unacked push is redelivered after the topic's timeout, and at once when its consumer leaves."""
    for args in (("topic", "create", "jobs", "--msg-timeout", "1s"), ("channel", "add", "jobs", "w")):
        run_cli(pg_dsn, *args).check_returncode()
    server = make_server(scan_interval="0.05s")
    with server.client() as producer, server.client() as lazy:
        sent = producer.send("jobs", b"work")
        lazy.subscribe("jobs", "w")
        first = lazy.receive(timeout=5)
        assert first.attempts == 1
        again = lazy.receive(timeout=5)  # after the 1 s message timeout
        assert again is not None and again.message_id == sent.message_id and again.attempts == 2
        with server.client() as other:
            other.subscribe("jobs", "w")
            assert other.receive(timeout=0.3) is None  # still in flight with `lazy`
            lazy.close()
            moved = other.receive(timeout=5)
            assert moved is not None and moved.message_id == sent.message_id
            other.ack(moved)
    wait_for(lambda: db_rows(pg_dsn, "SELECT attempts FROM dmq_delivery_log") == [(3,)])


def test_garbage_closes_only_the_offending_connection(make_server, topic):
    """Bad magic, bad frames and oversized frames get PROTOCOL_ERROR; others keep working."""
    import socket

    from dmq_client.wire import FrameDecoder

    server = make_server(max_msg_size=1024)
    with server.client() as healthy:
        assert healthy.send(topic, b"before").command == Command.SEND_SUCCESS_ACK

        def raw(payload: bytes) -> list:
            s = socket.create_connection(("127.0.0.1", server.tcp_port), timeout=5)
            s.sendall(payload)
            data = b""
            while chunk := s.recv(65536):
                data += chunk
            s.close()
            decoder = FrameDecoder()
            return [f for f in decoder.feed(data) if f.command != Command.SERVER_HEALTH]

        bad_magic = raw(b"HTTP/1.1 GET /\r\n")
        assert bad_magic[0].command == Command.PROTOCOL_ERROR
        assert bad_magic[0].status.startswith("E_BAD_PROTOCOL")
        # NSQ's magic reaches the NSQ protocol: a bad command gets nsqd's error frame
        nsq = socket.create_connection(("127.0.0.1", server.tcp_port), timeout=5)
        nsq.sendall(b"  V2BAD\n")
        reply = b""
        while chunk := nsq.recv(65536):
            reply += chunk
        nsq.close()
        assert reply == b"\x00\x00\x00\x21\x00\x00\x00\x01E_INVALID invalid command BAD"
        garbage = raw(b"DMQ1" + b"\x00\x00\x00\x40" + b"\xff" * 64)
        assert garbage[-1].command == Command.PROTOCOL_ERROR
        assert garbage[-1].status.startswith("E_BAD_COMMAND")
        huge = raw(b"DMQ1" + (10 * 1024 * 1024).to_bytes(4, "big"))
        assert huge[-1].status.startswith("E_FRAME_TOO_LARGE")
        short = raw(b"DMQ1" + (3).to_bytes(4, "big") + b"abc")
        assert short[-1].status.startswith("E_BAD_FRAME")
        # a truncated frame followed by a hang-up changes nothing
        s = socket.create_connection(("127.0.0.1", server.tcp_port))
        s.sendall(b"DMQ1\x00\x00\x01\x00partial")
        s.close()

        assert healthy.send(topic, b"after").command == Command.SEND_SUCCESS_ACK


def test_heartbeats_and_silent_peer_disconnect(make_server, topic):
    """The server heartbeats; a client that says nothing for two intervals is disconnected."""
    server = make_server(heartbeat_interval="0.3s")
    with server.client() as c:
        beat = c.next_frame(timeout=5)
        while beat is not None and beat.command == Command.SERVER_HEALTH:
            beat = c.next_frame(timeout=5)
        assert beat is not None and beat.command == Command.SERVER_HEARTBEAT
        assert beat.credit == 300
        frames = []
        while (f := c.next_frame(timeout=5)) is not None:
            frames.append(f)
            if f.command == Command.PROTOCOL_ERROR:
                break
        assert frames[-1].command == Command.PROTOCOL_ERROR
        assert frames[-1].status.startswith("E_TIMEOUT")
    with server.client() as talker:
        for _ in range(6):  # a client that heartbeats stays connected
            talker.heartbeat()
            f = talker.next_frame(timeout=1)
            assert f is None or f.command != Command.PROTOCOL_ERROR
        assert talker.send(topic, b"still here").command == Command.SEND_SUCCESS_ACK


def test_http_ping_info_stats(make_server, topic):
    """/ping says OK when ready; /info and /stats describe the node."""
    server = make_server()
    assert http_get(server.http + "/ping") == (200, "OK")
    status, body = http_get(server.http + "/info")
    info = json.loads(body)
    assert status == 200 and info["tcp_port"] == server.tcp_port
    with server.client() as c:
        c.subscribe(topic, "billing")
        status, body = http_get(server.http + "/stats")
        stats = json.loads(body)
        channel = stats["topics"][0]["channels"][0]
        assert (stats["topics"][0]["topic_name"], channel["channel_name"], channel["clients"]) == (
            topic,
            "billing",
            1,
        )


def test_graceful_shutdown_sends_reboot_and_answers_pending(make_server, topic, pg_dsn):
    """SIGTERM: clients hear SERVER_REBOOT, every acknowledged send is stored, exit code 0."""
    server = make_server()
    with server.client() as producer:
        first = producer.send_many(topic, [b"early"] * 50)
        for i in range(500):
            producer.write(producer.send_frame(topic, b"%d" % i))
        code = server.terminate()
        frames = producer.drain(timeout=5)
    assert code == 0
    assert any(f.command == Command.SERVER_REBOOT for f in frames)
    replies = [f for f in frames if f.command in (Command.SEND_SUCCESS_ACK, Command.SEND_SERVER_ERROR)]
    for f in replies:
        assert f.command == Command.SEND_SUCCESS_ACK or f.status.startswith("E_SHUTTING_DOWN")
    acked = {f.message_id for f in first + replies if f.command == Command.SEND_SUCCESS_ACK}
    stored = {r[0] for r in db_rows(pg_dsn, "SELECT id FROM dmq_message")}
    assert len(acked) >= 50 and acked <= stored
