"""gnsq (gevent) Producer, Consumer and HTTP clients, unchanged, against dmq."""

from __future__ import annotations

import pytest

import gnsq  # noqa: E402  (the dev extra installs it; a missing client is an error, not a skip)
import gevent  # noqa: E402
from gevent.event import Event  # noqa: E402

from tests.integration.support import db_rows, wait_for  # noqa: E402



def producer_for(server):
    producer = gnsq.Producer(nsqd_tcp_addresses=[f"127.0.0.1:{server.tcp_port}"])
    producer.start()
    return producer


def consume(server, topic: str, channel: str, want: int, timeout: float = 20.0, **kw):
    """Start a gnsq Consumer, wait (event-driven) for ``want`` messages, stop it."""
    got: list = []
    enough = Event()
    if "lookupd_http_addresses" not in kw:
        kw["nsqd_tcp_addresses"] = [f"127.0.0.1:{server.tcp_port}"]
    consumer = gnsq.Consumer(topic, channel, max_in_flight=10, **kw)

    @consumer.on_message.connect
    def handler(consumer, message):
        got.append((message.body, message.attempts, message.id))
        if len(got) >= want:
            enough.set()

    consumer.start(block=False)
    enough.wait(timeout)
    gevent.sleep(0)  # let the auto-FIN of the last message go out before closing
    consumer.close()
    consumer.join(timeout=5)
    return got


def test_gnsq_producer_and_consumer_on_a_fast_topic(nsq_server):
    """publish/multipublish/deferred publish each get OK; a Consumer receives all of them."""
    producer = producer_for(nsq_server)
    assert producer.publish("gnsq_fast", b"one") == b"OK"
    assert producer.multipublish("gnsq_fast", [b"two", b"three"]) == b"OK"
    assert producer.publish("gnsq_fast", b"four", defer=100) == b"OK"
    producer.close()
    producer.join(timeout=5)
    got = consume(nsq_server, "gnsq_fast", "c", 4)
    assert sorted(b for b, _, _ in got) == [b"four", b"one", b"three", b"two"]


def test_gnsq_on_a_reliable_topic(nsq_server, topic, pg_dsn):
    """gnsq publishes durably to a reliable topic and consumes/acknowledges it."""
    producer = producer_for(nsq_server)
    assert producer.publish(topic, b"reliable") == b"OK"
    producer.close()
    producer.join(timeout=5)
    ((mid,),) = db_rows(pg_dsn, "SELECT id FROM dmq_message")
    got = consume(nsq_server, topic, "billing", 1)
    assert [(b, int(i, 16)) for b, _, i in got] == [(b"reliable", mid)]
    wait_for(lambda: not db_rows(pg_dsn, "SELECT 1 FROM dmq_pending"))


def test_gnsq_consumer_through_lookupd(nsq_server):
    """A gnsq Consumer configured with dmq's HTTP port as lookupd finds the node."""
    producer = producer_for(nsq_server)
    assert producer.publish("gnsq_lookup", b"found") == b"OK"
    producer.close()
    got = consume(nsq_server, "gnsq_lookup", "c", 1, lookupd_http_addresses=[nsq_server.http])
    assert [b for b, _, _ in got] == [b"found"]


def test_gnsq_http_clients(nsq_server):
    """gnsq's nsqd and lookupd HTTP clients work against dmq's HTTP port."""
    http = gnsq.NsqdHTTPClient("127.0.0.1", nsq_server.http_port)
    assert http.ping() == b"OK"
    assert http.info()["version"] == "1.3.0"
    assert http.publish("gnsq_http", b"a") == b"OK"
    assert http.multipublish("gnsq_http", [b"b", b"c"]) == b"OK"
    assert http.multipublish("gnsq_http", [b"d\nwith newline"], binary=True) == b"OK"
    assert http.publish("gnsq_http", b"e", defer=1000) == b"OK"
    http.create_channel("gnsq_http", "ch")
    http.pause_channel("gnsq_http", "ch")
    stats = http.stats(topic="gnsq_http")
    (t,) = stats["topics"]
    assert t["message_count"] == 5 and t["channels"][0]["paused"] is True
    assert b"gnsq_http" in http.stats(text=True)
    lookupd = gnsq.LookupdClient("127.0.0.1", nsq_server.http_port)
    assert "gnsq_http" in lookupd.topics()["topics"]
    assert lookupd.channels("gnsq_http")["channels"] == ["ch"]
    producers = lookupd.lookup("gnsq_http")["producers"]
    assert [(p["broadcast_address"], p["tcp_port"]) for p in producers] == [("127.0.0.1", nsq_server.tcp_port)]
    http.delete_topic("gnsq_http")
    with pytest.raises(gnsq.errors.NSQHttpError):
        lookupd.lookup("gnsq_http")


def test_gnsq_consumer_with_deflate(nsq_server):
    """A gnsq Consumer with deflate=True negotiates raw DEFLATE and receives everything.

    (gnsq's Producer cannot use deflate against any nsqd: its response handler is wired
    before IDENTIFY, so the upgrade's OK pops an empty response queue (KeyError) inside
    gnsq. The low-level NsqdTCPClient publishes compressed instead.)"""
    conn = gnsq.NsqdTCPClient("127.0.0.1", nsq_server.tcp_port, deflate=True)
    conn.connect()
    assert conn.identify()["deflate"] is True
    conn.publish("gnsq_deflate", b"small")
    assert conn.read_response() == (0, b"OK")
    conn.multipublish("gnsq_deflate", [b"x" * 1000, b"y" * 1000])
    assert conn.read_response() == (0, b"OK")
    conn.close_stream()
    got = consume(nsq_server, "gnsq_deflate", "c", 3, deflate=True)
    assert sorted(b for b, _, _ in got) == [b"small", b"x" * 1000, b"y" * 1000]
