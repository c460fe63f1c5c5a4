"""TLS on the TCP ports against a real server: the dmq protocol on --tls-address with client
certificates, NSQ's in-band upgrade byte by byte, handshakes that are garbage, cut short or
never finished (closed, and everyone else still served), and certificates re-read on SIGHUP
without dropping a connection."""

from __future__ import annotations

import json
import signal
import socket
import ssl
import struct
import time

import pytest

from dmq_client import MqClient, MqConfig, Message
from dmq_client.blocking import BlockingClient, ClientError
from dmq_client.wire import Command

from .certs import make_certs
from .support import free_port, wait_for


def _auth_file(tmp_path, secrets=None, common_names=None) -> str:
    path = tmp_path / "auth.json"
    path.write_text(json.dumps({"secrets": secrets or {}, "common_names": common_names or {}}))
    return str(path)


def _everything(identity: str, ttl: int = 3600) -> dict:
    return {"identity": identity, "ttl": ttl,
            "authorizations": [{"topic": ".*", "channels": [".*"], "permissions": ["publish", "subscribe"]}]}


def _tls_server(make_server, certs, **flags):
    tls_port = free_port()
    server = make_server(tls_address=f"127.0.0.1:{tls_port}", **certs.server_flags(**flags))
    server.tls_port = tls_port
    return server


def test_the_dmq_client_over_tls_with_a_client_certificate(make_server, certs, topic, tmp_path):
    """--tls-client-auth-policy require-verify and an auth file keyed by the certificate's
    name: a client presenting its certificate and an empty secret (authenticate me by my
    certificate) sends and receives over the TLS port; one without a certificate fails
    the handshake; the plaintext port refuses the dmq protocol (TLS is required)."""
    auth = _auth_file(tmp_path, common_names={"billing-service": _everything("billing")})
    server = _tls_server(make_server, certs, tls_root_ca_file=str(certs.ca_file),
                         tls_client_auth_policy="require-verify", auth_file=auth, admin_token="tok",
                         tls_required="tcp-https")  # TLS on TCP; plain HTTP stays open (nsqd's mode)
    tls = dict(tls=True, ca_file=str(certs.ca_file), cert_file=str(certs.client_cert), key_file=str(certs.client_key))
    with BlockingClient("127.0.0.1", server.tls_port, auth_secret="", **tls) as producer:
        assert producer.identity == {"identity": "billing", "identity_url": "", "permission_count": 1}
        assert producer.send(topic, b"over tls").command == Command.SEND_SUCCESS_ACK
        (seen,) = json.loads(_http(server, "/admin/clients", Authorization="Bearer tok"))["clients"]
        assert (seen["tls"], seen["authed"], seen["auth_identity"]) == (True, True, "billing")
        assert seen["tls_version"].startswith("TLSv1.")
    with BlockingClient("127.0.0.1", server.tls_port, auth_secret="", **tls) as consumer:
        assert consumer.subscribe(topic, "billing").command == Command.SUBSCRIBE_ACK
        push = consumer.receive(timeout=10)
        assert push is not None and push.body == b"over tls"
        consumer.ack(push)
    with pytest.raises(ClientError):  # no client certificate: the server ends the handshake
        with BlockingClient("127.0.0.1", server.tls_port, tls=True, ca_file=str(certs.ca_file)) as anonymous:
            anonymous.send(topic, b"x")
    with BlockingClient("127.0.0.1", server.tcp_port) as plain:
        (refusal,) = [f for f in plain.drain(timeout=5) if f.command == Command.PROTOCOL_ERROR]
        assert refusal.status.startswith("E_TLS_REQUIRED")


def test_mqclient_over_tls_with_an_auth_secret(make_server, certs, topic, tmp_path):
    """MqClient with tls=True, the test CA and an auth secret: the send is stored and
    acknowledged; with a wrong secret the connection never becomes ready, so the send
    fails with SOCKET_ERROR and nothing is stored."""
    auth = _auth_file(tmp_path, secrets={"s3cret": _everything("orders-app")})
    server = _tls_server(make_server, certs, auth_file=auth)
    base = dict(servers=f"127.0.0.1:{server.tls_port}", tls=True, tls_ca_file=str(certs.ca_file), route_wait=2.0)
    with MqClient(MqConfig(auth_secret="s3cret", **base)) as client:
        result = client.send(Message(topic, b"secured")).result(timeout=15)
        assert result.status.name == "SUCCESS", result
    with MqClient(MqConfig(auth_secret="wrong", **base)) as client:
        result = client.send(Message(topic, b"refused")).result(timeout=15)
        assert result.status.name == "SOCKET_ERROR"  # never connected: certainly not stored
    with BlockingClient("127.0.0.1", server.tls_port, tls=True, ca_file=str(certs.ca_file), auth_secret="s3cret") as c:
        assert c.subscribe(topic, "billing").command == Command.SUBSCRIBE_ACK
        push = c.receive(timeout=10)
        assert push.body == b"secured"
        assert c.receive(timeout=1) is None  # "refused" was never stored


# -- NSQ's in-band upgrade, byte by byte ----------------------------------------------------
def _frame(sock) -> tuple[int, bytes]:
    head = _exactly(sock, 8)
    size, kind = struct.unpack(">ii", head)
    return kind, _exactly(sock, size - 4)


def _exactly(sock, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError(f"closed after {data!r}")
        data += chunk
    return data


def _identify(sock, **fields) -> None:
    body = json.dumps(fields).encode()
    sock.sendall(b"IDENTIFY\n" + struct.pack(">i", len(body)) + body)


def test_the_nsq_tls_upgrade_byte_by_byte(make_server, certs):
    """The sequence the Go tools (to_nsq --tls) and pynsq expect: the IDENTIFY answer in
    plaintext with tls_v1 true, then the TLS handshake, then exactly one OK response
    (00000006 00000000 'OK') over TLS; PUB then works over the encrypted stream. With
    --tls-required, a PUB before the upgrade is a fatal E_INVALID naming TLS."""
    server = make_server(tls_required="tcp-https", **certs.server_flags())  # TCP needs TLS; HTTP (/stats) not
    raw = socket.create_connection(("127.0.0.1", server.tcp_port), timeout=10)
    raw.sendall(b"  V2")
    _identify(raw, feature_negotiation=True, tls_v1=True)
    kind, data = _frame(raw)
    assert kind == 0
    answer = json.loads(data)
    assert answer["tls_v1"] is True and answer["auth_required"] is False
    context = ssl.create_default_context(cafile=str(certs.ca_file))
    tls = context.wrap_socket(raw, server_hostname="127.0.0.1")
    assert _exactly(tls, 10) == bytes.fromhex("00000006 00000000") + b"OK"
    tls.sendall(b"PUB over_tls\n" + struct.pack(">i", 5) + b"hello")
    assert _exactly(tls, 10) == bytes.fromhex("00000006 00000000") + b"OK"
    tls.close()
    plain = socket.create_connection(("127.0.0.1", server.tcp_port), timeout=10)
    plain.sendall(b"  V2PUB plain\n" + struct.pack(">i", 1) + b"x")
    kind, data = _frame(plain)
    assert (kind, data) == (1, b"E_INVALID cannot PUB in current state (TLS required)")
    assert plain.recv(10) == b""  # fatal: closed
    plain.close()
    stats = json.loads(_http(server, "/stats?format=json"))
    (topic,) = [t for t in stats["topics"] if t["topic_name"] == "over_tls"]
    assert topic["message_count"] == 1
    assert not [t for t in stats["topics"] if t["topic_name"] == "plain"]


def _http(server, path: str, **headers: str) -> str:
    import urllib.request

    request = urllib.request.Request(server.http + path, headers=headers)
    with urllib.request.urlopen(request, timeout=10) as resp:
        return resp.read().decode()


# -- handshakes that never come, come cut short, or are not TLS -----------------------------
def _closed_within(sock, seconds: float) -> bool:
    """True once the server closed ``sock`` (EOF or reset) within ``seconds``."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
        return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def _client_hello(certs) -> bytes:
    """The first flight of a real TLS client (its ClientHello), from a memory BIO."""
    context = ssl.create_default_context(cafile=str(certs.ca_file))
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = context.wrap_bio(incoming, outgoing, server_hostname="127.0.0.1")
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_bad_and_unfinished_handshakes_are_closed_and_others_served(make_server, certs, topic):
    """On the TLS port and in the NSQ upgrade: a client that never starts the handshake,
    one that sends half a ClientHello, one that sends garbage, and one that upgrades
    and then sends plaintext garbage are each closed (the silent ones within
    --tls-handshake-timeout), while a well-behaved client connected all along keeps
    sending and a new one still connects."""
    server = _tls_server(make_server, certs, tls_handshake_timeout="1s")
    good = BlockingClient("127.0.0.1", server.tls_port, tls=True, ca_file=str(certs.ca_file))
    assert good.send(topic, b"before").command == Command.SEND_SUCCESS_ACK
    hello = _client_hello(certs)
    started = time.monotonic()
    silent = socket.create_connection(("127.0.0.1", server.tls_port))
    half = socket.create_connection(("127.0.0.1", server.tls_port))
    half.sendall(hello[: len(hello) // 2])
    garbage = socket.create_connection(("127.0.0.1", server.tls_port))
    garbage.sendall(b"GET / HTTP/1.1\r\n\r\n" + bytes(range(256)))
    upgraded_silent = socket.create_connection(("127.0.0.1", server.tcp_port))
    upgraded_silent.sendall(b"  V2")
    _identify(upgraded_silent, feature_negotiation=True, tls_v1=True)
    assert json.loads(_frame(upgraded_silent)[1])["tls_v1"] is True
    upgraded_garbage = socket.create_connection(("127.0.0.1", server.tcp_port))
    upgraded_garbage.sendall(b"  V2")
    _identify(upgraded_garbage, feature_negotiation=True, tls_v1=True)
    _frame(upgraded_garbage)
    upgraded_garbage.sendall(b"PUB not_tls\n" + struct.pack(">i", 1) + b"x")
    for sock in (garbage, upgraded_garbage):
        assert _closed_within(sock, 5)
    for sock in (silent, half, upgraded_silent):
        assert _closed_within(sock, 5)
    assert time.monotonic() - started < 5
    assert good.send(topic, b"after").command == Command.SEND_SUCCESS_ACK
    with BlockingClient("127.0.0.1", server.tls_port, tls=True, ca_file=str(certs.ca_file)) as fresh:
        assert fresh.send(topic, b"fresh").command == Command.SEND_SUCCESS_ACK
    good.close()
    for sock in (silent, half, garbage, upgraded_silent, upgraded_garbage):
        sock.close()
    assert "TLS handshake not finished within 1.0s" in server.log()


def test_sighup_reloads_the_certificate_without_dropping_connections(make_server, certs, topic, tmp_path):
    """The certificate files are replaced by ones from another CA and the server gets
    SIGHUP: a new connection is served the new certificate (verified with the new CA,
    refused with the old), while a connection opened before keeps working."""
    server = _tls_server(make_server, certs)
    before = BlockingClient("127.0.0.1", server.tls_port, tls=True, ca_file=str(certs.ca_file))
    assert before.send(topic, b"one").command == Command.SEND_SUCCESS_ACK
    rotated = make_certs(tmp_path / "rotated")
    certs.server_cert.write_bytes(rotated.server_cert.read_bytes())
    certs.server_key.write_bytes(rotated.server_key.read_bytes())
    server.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "TLS: certificate and key re-read" in server.log(), timeout=10)
    with BlockingClient("127.0.0.1", server.tls_port, tls=True, ca_file=str(rotated.ca_file)) as after:
        assert after.send(topic, b"two").command == Command.SEND_SUCCESS_ACK
    with pytest.raises(ClientError, match="certificate verify failed"):
        BlockingClient("127.0.0.1", server.tls_port, tls=True, ca_file=str(certs.ca_file))
    assert before.send(topic, b"three").command == Command.SEND_SUCCESS_ACK
    before.close()
    certs.server_key.write_text("not a key")
    server.proc.send_signal(signal.SIGHUP)
    wait_for(lambda: "certificate reload failed, keeping the current one" in server.log(), timeout=10)
    with BlockingClient("127.0.0.1", server.tls_port, tls=True, ca_file=str(rotated.ca_file)) as still:
        assert still.send(topic, b"four").command == Command.SEND_SUCCESS_ACK


def test_the_admin_console_over_tls_and_the_exposure_warning(make_server, certs):
    """--admin-tls: the console speaks TLS with the server's certificate (a plaintext
    client gets no banner); a node listening on every address without TLS or auth logs
    one SECURITY WARNING per exposed listener at start."""
    admin_port = free_port()
    server = make_server(admin_address=f"127.0.0.1:{admin_port}", admin_tls="true", admin_token="tok",
                         **certs.server_flags())
    context = ssl.create_default_context(cafile=str(certs.ca_file))
    with context.wrap_socket(socket.create_connection(("127.0.0.1", admin_port), timeout=10),
                             server_hostname="127.0.0.1") as tls:
        lines = tls.makefile("rb")
        assert b"dmq admin console" in lines.readline()
        tls.sendall(b"auth tok\r\n")
        assert lines.readline().startswith(b"OK")
    plain = socket.create_connection(("127.0.0.1", admin_port), timeout=10)
    plain.sendall(b"help\r\n")
    assert _closed_within(plain, 10)  # not TLS: the handshake fails, no console
    plain.close()
    exposed = make_server(tcp_address=f"0.0.0.0:{free_port()}", admin_address="")
    log = exposed.log()
    assert "SECURITY WARNING: the TCP port (dmq and NSQ) listens on non-loopback address 0.0.0.0 without TLS or " \
           "authentication" in log
    assert log.count("SECURITY WARNING") == 1
