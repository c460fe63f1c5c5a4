"""NSQ protocol V2 against a real dmq-server process: fast topics, reliable topics, restarts."""

from __future__ import annotations

import json
import socket
import time

import pytest

from dmq_server.core.nsq_wire import FRAME_ERROR, encode_command, mpub_body

from .support import db_rows, http_get, wait_for

pytestmark = pytest.mark.integration


def test_fast_topic_publish_consume_fin(make_server, tmp_path, nsq_connect):
    """PUB/MPUB/DPUB on a fast topic reach a SUBscribed consumer; FIN completes them."""
    server = make_server(data_path=str(tmp_path / "data"))
    consumer = nsq_connect(server.tcp_port, {"feature_negotiation": True})
    consumer.sub("events", "all", rdy=10)
    producer = nsq_connect(server.tcp_port)
    assert producer.pub("events", b"one") == b"OK"
    producer.send(encode_command(b"MPUB", b"events", body=mpub_body([b"two", b"three"])))
    assert producer.response() == b"OK"
    producer.send(encode_command(b"DPUB", b"events", b"200", body=b"later"))
    assert producer.response() == b"OK"
    got = [consumer.message() for _ in range(4)]
    assert [m[3] for m in got] == [b"one", b"two", b"three", b"later"]
    assert all(m[1] == 1 and len(m[2]) == 16 for m in got)
    for m in got:
        consumer.send(b"FIN " + m[2] + b"\n")
    stats = json.loads(http_get(server.http + "/stats?format=json&topic=events")[1])
    channel = stats["topics"][0]["channels"][0]
    wait_for(lambda: json.loads(http_get(server.http + "/stats?format=json&topic=events")[1])["topics"][0]["channels"][0]["in_flight_count"] == 0)
    assert channel["message_count"] == 4


def test_reliable_topic_over_nsq_is_durable(make_server, topic, pg_dsn, tmp_path, nsq_connect):
    """PUB to a registered reliable topic answers OK after commit; SUB on its channel gets
    the stored message with a 16-hex id; FIN is a durable acknowledgement."""
    server = make_server(data_path=str(tmp_path / "data"))
    producer = nsq_connect(server.tcp_port)
    assert producer.pub(topic, b"order-1") == b"OK"
    ((mid, producer_id, body),) = db_rows(pg_dsn, "SELECT id, producer, body FROM dmq_message")
    assert body == b"order-1" and producer_id.startswith("nsq:127.0.0.1:")
    consumer = nsq_connect(server.tcp_port, {"feature_negotiation": True})
    consumer.sub(topic, "billing")
    ts, attempts, wire_id, got = consumer.message()
    assert (got, attempts, wire_id) == (b"order-1", 1, b"%016x" % mid)
    consumer.send(b"FIN " + wire_id + b"\n")
    wait_for(lambda: not db_rows(pg_dsn, "SELECT 1 FROM dmq_pending"))
    assert "orders" not in json.loads(http_get(server.http + "/stats?format=json")[1]).get("fast", [])


def test_reliable_topic_refusals_are_clear(make_server, topic, tmp_path, nsq_connect):
    """SUB on an unregistered channel of a reliable topic is E_SUB_FAILED; others go on."""
    server = make_server(data_path=str(tmp_path / "data"))
    bad = nsq_connect(server.tcp_port)
    bad.send(f"SUB {topic} nosuch\n".encode())
    kind, data = bad.frame()
    assert kind == FRAME_ERROR and data.startswith(b"E_SUB_FAILED SUB failed E_NO_CHANNEL")
    assert bad.closed()
    ok = nsq_connect(server.tcp_port)
    assert ok.pub(topic, b"still works") == b"OK"


def test_bad_input_closes_only_that_connection(make_server, tmp_path, nsq_connect):
    """A fatal error closes the offending connection; a bystander keeps publishing."""
    server = make_server(data_path=str(tmp_path / "data"))
    bystander = nsq_connect(server.tcp_port)
    bad = nsq_connect(server.tcp_port)
    bad.send(b"PUB bad!topic\n")
    assert bad.frame() == (FRAME_ERROR, b'E_BAD_TOPIC PUB topic name "bad!topic" is not valid')
    assert bad.closed()
    assert bystander.pub("fine", b"x") == b"OK"


def test_clean_restart_keeps_fast_messages_and_metadata(make_server, tmp_path, nsq_connect):
    """SIGTERM flushes memory and in-flight fast messages to disk; after a restart the
    topics, channels and pause flags are back and every message is delivered."""
    data = tmp_path / "data"
    server = make_server(data_path=str(data))
    c = nsq_connect(server.tcp_port)
    c.sub("keep", "ch", rdy=1)
    p = nsq_connect(server.tcp_port)
    for i in range(5):
        assert p.pub("keep", b"m%d" % i) == b"OK"
    first = c.message()  # one in flight, four in memory
    assert http_get(server.http + "/channel/pause?topic=keep&channel=ch")[0] == 405  # POST only
    c.close(), p.close()
    assert server.terminate() == 0
    meta = json.loads((data / "nsq" / "nsqd.dat").read_text())
    assert meta["topics"][0]["name"] == "keep"
    assert (data / "nsq" / "keep:ch.diskqueue.meta.dat").exists()
    server.start()
    c2 = nsq_connect(server.tcp_port)
    c2.sub("keep", "ch", rdy=10)
    got = {c2.message()[3] for _ in range(5)}
    assert got == {b"m%d" % i for i in range(5)}
    assert first[3] in got


def test_heartbeat_keeps_a_quiet_consumer_and_drops_a_silent_one(make_server, tmp_path, nsq_connect):
    """With a 1 s heartbeat, a client answering NOP stays; one that stays silent is closed
    after two intervals."""
    server = make_server(data_path=str(tmp_path / "data"))
    talker = nsq_connect(server.tcp_port, {"heartbeat_interval": 1000})
    silent = nsq_connect(server.tcp_port, {"heartbeat_interval": 1000})
    deadline = time.monotonic() + 3
    beats = 0
    while time.monotonic() < deadline:
        try:
            kind, data = talker.reader.feed(talker.sock.recv(65536))[0]
        except socket.timeout:
            continue
        if data == b"_heartbeat_":
            beats += 1
            talker.send(b"NOP\n")
    assert beats >= 2
    assert silent.closed(timeout=3)
    assert talker.pub("t", b"alive") == b"OK"


def test_dmq_producer_reaches_a_fast_topic_and_nsq_consumers_get_every_acked_id(
    make_server, pg_dsn, tmp_path, nsq_connect
):
    """The broker routes a dmq send by the topic's store: to a topic registered with
    ``store=fast`` it goes to the fast store, is acknowledged with the fast store's id,
    and an NSQ consumer receives it under that same id. Counted: every id acknowledged
    to the producer is delivered, none twice; nothing goes to PostgreSQL's tables."""
    from dmq_client.wire import Command
    from dmq_server.db.schema import migrate
    from dmq_server.db.worker import connect
    import registry

    migrate(pg_dsn)
    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "clicks", store="fast")
    server = make_server(data_path=str(tmp_path / "data"))
    consumer = nsq_connect(server.tcp_port, {"feature_negotiation": True})
    consumer.sub("clicks", "counter", rdy=100)
    with server.client() as producer:
        replies = producer.send_many("clicks", [b"click-%d" % i for i in range(50)])
        assert {r.command for r in replies} == {Command.SEND_SUCCESS_ACK}
        unregistered = producer.send("nowhere", b"x")
        assert unregistered.command == Command.SEND_NO_TOPIC_ACK
    acked = {r.message_id for r in replies}
    assert len(acked) == 50
    delivered = [consumer.message() for _ in range(50)]
    assert sorted(int(m[2], 16) for m in delivered) == sorted(acked)
    assert {m[3] for m in delivered} == {b"click-%d" % i for i in range(50)}
    assert db_rows(pg_dsn, "SELECT count(*) FROM dmq_message") == [(0,)]
