"""pynsq and gnsq, unchanged, against dmq with TLS (``tls_v1``) and AUTH secrets."""

from __future__ import annotations

import json
import ssl
import urllib.request

import nsq

from tests.compat.test_pynsq import Scenario, consume, publish_all


def _auth_file(tmp_path, entries: dict) -> str:
    path = tmp_path / "auth.json"
    path.write_text(json.dumps({"secrets": entries}))
    return str(path)


def _tls_options(certs) -> dict:
    # pynsq's default ssl_version (PROTOCOL_TLSv1_2) is deprecated in Python 3.10+ (a
    # DeprecationWarning, an error under this suite's filterwarnings): ask for the
    # modern client protocol, which verifies the certificate and the host name too
    return {"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": str(certs.ca_file), "ssl_version": ssl.PROTOCOL_TLS_CLIENT}


def test_pynsq_publishes_and_consumes_over_tls_with_an_auth_secret(make_server, certs, tmp_path):
    """pynsq's Writer and Reader with tls_v1=True, deflate=True and auth_secret: the
    connection is upgraded to TLS (the certificate checked against the test CA), then
    to deflate inside it, AUTH succeeds, and messages flow both ways."""
    auth = _auth_file(tmp_path, {
        "pub-secret": {"identity": "producer", "ttl": 60,
                       "authorizations": [{"topic": "^events$", "channels": [".*"], "permissions": ["publish"]}]},
        "sub-secret": {"identity": "consumer", "ttl": 60,
                       "authorizations": [{"topic": "^events$", "channels": ["^c$"], "permissions": ["subscribe"]}]},
    })
    server = make_server(data_path=str(tmp_path / "data"), auth_file=auth, **certs.server_flags())
    scenario = Scenario()
    tls = dict(tls_v1=True, tls_options=_tls_options(certs), deflate=True)  # TLS, then deflate inside it
    writer = nsq.Writer([f"127.0.0.1:{server.tcp_port}"], auth_secret="pub-secret", **tls)
    results: list = []
    got: list = []
    bodies = [f"m{i}".encode() for i in range(5)]

    producers: list = []

    def start_reader():
        stats = urllib.request.Request(server.http + "/stats?format=json", headers={"Authorization": "Bearer pub-secret"})
        with urllib.request.urlopen(stats, timeout=10) as resp:  # reads need an identity too
            producers.extend(json.load(resp)["producers"] or [])
        consume(scenario, server, "events", "c", len(bodies), got, auth_secret="sub-secret", **tls)

    scenario.loop.call_later(0.05, publish_all, scenario, writer, "events", bodies, results, start_reader)
    scenario.run()
    assert not scenario.timed_out, (results, got, server.log())
    assert results == [b"OK"] * len(bodies)
    assert sorted(body for body, _, _ in got) == bodies
    (writer_stats,) = producers
    assert (writer_stats["tls"], writer_stats["deflate"], writer_stats["authed"], writer_stats["auth_identity"]) == (
        True, True, True, "producer")
    assert writer_stats["tls_version"].startswith("TLSv1.")


def test_gnsq_publishes_and_consumes_over_tls_with_an_auth_secret(make_server, certs, tmp_path):
    """gnsq's connection (NsqdTCPClient) and Consumer with tls_v1=True (the certificate
    verified against the test CA) and auth_secret: PUB and MPUB answer OK over TLS, a
    secret that may not publish there is refused E_UNAUTHORIZED, and the Consumer gets
    exactly the authorized messages. (gnsq 1.0.2's Producer cannot upgrade at all: its
    response handler pops a queue it creates only after IDENTIFY, and the upgrade's OK,
    which nsqd sends too, arrives first; so publishing goes through its connection.)"""
    import warnings

    import gevent
    import gnsq
    from gevent.event import Event

    auth = _auth_file(tmp_path, {
        "rw": {"identity": "rw", "ttl": 60, "authorizations": [{"topic": "^g$", "channels": [".*"],
                                                                "permissions": ["publish", "subscribe"]}]},
        "other": {"identity": "other", "ttl": 60, "authorizations": [{"topic": "^elsewhere$", "channels": [".*"],
                                                                      "permissions": ["publish"]}]},
    })
    server = make_server(data_path=str(tmp_path / "data"), auth_file=auth, **certs.server_flags())
    tls = dict(tls_v1=True, tls_options={"cert_reqs": ssl.CERT_REQUIRED, "ca_certs": str(certs.ca_file)})
    with warnings.catch_warnings():
        # gnsq wraps the socket with ssl_version=PROTOCOL_TLSv1_2, deprecated since Python 3.10
        warnings.simplefilter("ignore", DeprecationWarning)
        conn = gnsq.NsqdTCPClient("127.0.0.1", server.tcp_port, auth_secret=b"rw", **tls)
        conn.connect()
        identified = conn.identify()
        assert identified["tls_v1"] is True and identified["auth_required"] is True
        conn.publish("g", b"one")
        assert conn.read_response() == (0, b"OK")
        conn.multipublish("g", [b"two", b"three"])
        assert conn.read_response() == (0, b"OK")
        conn.close_stream()
        intruder = gnsq.NsqdTCPClient("127.0.0.1", server.tcp_port, auth_secret=b"other", **tls)
        intruder.connect()
        intruder.identify()
        intruder.publish("g", b"intruder")
        frame, error = intruder.read_response()
        assert frame == 1 and isinstance(error, gnsq.errors.NSQUnauthorized)  # gnsq maps E_UNAUTHORIZED
        intruder.close_stream()
        got: list = []
        enough = Event()
        address = [f"127.0.0.1:{server.tcp_port}"]
        consumer = gnsq.Consumer("g", "c", nsqd_tcp_addresses=address, max_in_flight=10, auth_secret=b"rw", **tls)

        @consumer.on_message.connect
        def handler(consumer, message):
            got.append(message.body)
            if len(got) >= 3:
                enough.set()

        consumer.start(block=False)
        enough.wait(20)
        gevent.sleep(0)
        consumer.close()
        consumer.join(timeout=5)
    assert sorted(got) == [b"one", b"three", b"two"]


def test_nsq_clients_http_publishers_are_not_taken_for_browsers(nsq_server):
    """What NSQ clients post to nsqd's HTTP API carries no Origin and no Fetch metadata,
    so dmq's guard lets it through whatever its body's type: gnsq's NsqdHTTPClient
    (publish, multipublish as text and binary, create_topic: urllib3, no Content-Type)
    and pynsq's HTTP stack (pynsq 0.9.1 has no HTTP writer: its Reader asks lookupd with
    tornado's AsyncHTTPClient, which gives any POST body a form's Content-Type). Each is
    answered OK, and /stats counts every message."""
    import asyncio

    import gnsq
    from tornado.httpclient import AsyncHTTPClient, HTTPRequest

    client = gnsq.NsqdHTTPClient("127.0.0.1", nsq_server.http_port)
    assert client.publish("http_pub", b"gnsq one") == b"OK"
    assert client.multipublish("http_pub", [b"gnsq two", b"gnsq three"]) == b"OK"
    assert client.multipublish("http_pub", [b"gnsq\nfour", b"gnsq five"], binary=True) == b"OK"
    assert client.create_topic("http_made") == b""

    async def tornado_publish() -> tuple[int, bytes, str]:
        request = HTTPRequest(f"{nsq_server.http}/pub?topic=http_pub", method="POST", body=b"tornado")
        reply = await AsyncHTTPClient().fetch(request)
        return reply.code, reply.body, request.headers["Content-Type"]

    assert asyncio.run(tornado_publish()) == (200, b"OK", "application/x-www-form-urlencoded")
    with urllib.request.urlopen(f"{nsq_server.http}/stats?format=json", timeout=10) as resp:
        topics = {t["topic_name"]: t for t in json.load(resp)["topics"]}
    assert topics["http_pub"]["message_count"] == 6 and "http_made" in topics
