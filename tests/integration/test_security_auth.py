"""AUTH against a real auth server run by the test (nsqd's contract: allow, deny, regex, ttl
expiry, unreachable), the same rules on the dmq protocol, and counting: a connection that
failed auth publishes nothing and receives nothing, while every message acknowledged to an
authorized producer reaches the authorized consumer. Auth servers framing their answers
each way nsqd accepts (a length, chunks, the connection's close), and failing each way
(hung, down, not JSON, cut short, too large, 500): clear errors, nothing hangs."""

from __future__ import annotations

import json

import pytest
import socket
import struct
import time

from dmq_client.blocking import BlockingClient, ClientError
from dmq_client.wire import Command, Frame, encode

from .authserver import CHUNKED, CLOSE, CUT_CHUNKED, CUT_LENGTH, LENGTH, AuthServer, grant
from .support import db_rows, free_port


OPEN: list["Nsq"] = []  # closed after each test, passed or not (see close_connections)


@pytest.fixture(autouse=True)
def close_connections():
    yield
    while OPEN:
        OPEN.pop().close()


class Nsq:
    """A raw NSQ V2 connection: commands out, frames in (type, data)."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        OPEN.append(self)
        self.sock.sendall(b"  V2")

    def send(self, *raw: bytes) -> None:
        self.sock.sendall(b"".join(raw))

    def frame(self) -> tuple[int, bytes]:
        size, kind = struct.unpack(">ii", self._exactly(8))
        return kind, self._exactly(size - 4)

    def _exactly(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError(f"closed after {data!r}")
            data += chunk
        return data

    def closed(self) -> bool:
        self.sock.settimeout(5)
        try:
            return self.sock.recv(1) == b""
        except ConnectionResetError:
            return True

    def frames_until_closed(self) -> list[tuple[int, bytes]]:
        out = []
        try:
            while True:
                out.append(self.frame())
        except (ConnectionError, socket.timeout):
            return out

    def close(self) -> None:
        self.sock.close()


def identify(**fields) -> bytes:
    body = json.dumps({"feature_negotiation": True, **fields}).encode()
    return b"IDENTIFY\n" + struct.pack(">i", len(body)) + body


def auth(secret: str) -> bytes:
    return b"AUTH\n" + struct.pack(">i", len(secret)) + secret.encode()


def pub(topic: str, body: bytes) -> bytes:
    return f"PUB {topic}\n".encode() + struct.pack(">i", len(body)) + body


def test_nsq_auth_against_an_auth_server_allow_deny_regex(make_server):
    """IDENTIFY announces auth_required; AUTH is answered with the identity (the auth
    server heard remote_ip, tls=false, the secret and an empty common_name); a topic the
    regex finds publishes, one it does not is a fatal E_UNAUTHORIZED; a refused secret is
    a fatal E_AUTH_FAILED; a PUB before AUTH a fatal E_AUTH_FIRST."""
    with AuthServer() as authd:
        authd.allow("eu", "eu-app", [grant(r"^orders\.eu$")])
        server = make_server(auth_http_address=authd.address)
        c = Nsq(server.tcp_port)
        c.send(identify())
        assert json.loads(c.frame()[1])["auth_required"] is True
        c.send(auth("eu"))
        assert json.loads(c.frame()[1]) == {"identity": "eu-app", "identity_url": "https://id/eu-app", "permission_count": 1}
        (asked,) = authd.requests
        assert {k: asked[k] for k in ("remote_ip", "tls", "secret", "common_name", "_method", "_path")} == {
            "remote_ip": "127.0.0.1", "tls": "false", "secret": "eu", "common_name": "", "_method": "GET", "_path": "/auth"}
        c.send(pub("orders.eu", b"a"))
        assert c.frame() == (0, b"OK")
        c.send(pub("orders.us", b"b"))
        assert c.frame() == (1, b'E_UNAUTHORIZED AUTH failed for PUB on "orders.us" ""')
        assert c.closed()
        denied = Nsq(server.tcp_port)
        denied.send(identify(), auth("nope"))
        denied.frame()
        assert denied.frame() == (1, b"E_AUTH_FAILED AUTH failed")
        assert denied.closed()
        first = Nsq(server.tcp_port)
        first.send(pub("orders.eu", b"c"))
        assert first.frame() == (1, b"E_AUTH_FIRST AUTH required before PUB")
        assert authd.count("eu") == 1  # one AUTH: the PUBs were decided from its answer
        assert "refused PUB on 'orders.us'" in server.log() and "eu-app" in server.log()


def test_nsq_auth_ttl_expiry_asks_again(make_server):
    """An answer with ttl 1: PUBs within the second are decided without asking; the first
    PUB after it asks the auth server again, whose new answer (the topic withdrawn)
    refuses it."""
    with AuthServer() as authd:
        authd.allow("s", "app", [grant("^t$")], ttl=1)
        server = make_server(auth_http_address=authd.address)
        c = Nsq(server.tcp_port)
        c.send(identify(), auth("s"))
        c.frame(), c.frame()
        authed_at = time.monotonic()
        c.send(pub("t", b"1"), pub("t", b"2"))
        assert [c.frame(), c.frame()] == [(0, b"OK"), (0, b"OK")]
        assert authd.count("s") == 1
        authd.allow("s", "app", [grant("^other$")], ttl=1)
        time.sleep(max(0.0, authed_at + 1.05 - time.monotonic()))  # the ttl itself is under test
        c.send(pub("t", b"3"))
        assert c.frame() == (1, b'E_UNAUTHORIZED AUTH failed for PUB on "t" ""')
        assert authd.count("s") == 2


def test_nsq_auth_with_an_unreachable_auth_server_and_a_second_one(make_server):
    """Every auth server unreachable: AUTH fails (E_AUTH_FAILED, the reason only in the
    log) and the node keeps serving; with a dead address and a live one listed, AUTH
    succeeds through the live one."""
    dead = f"127.0.0.1:{free_port()}"
    with AuthServer() as authd:
        authd.allow("s", "app", [grant(".*")])
        alone = make_server(auth_http_address=dead)
        c = Nsq(alone.tcp_port)
        c.send(identify(), auth("s"))
        c.frame()
        assert c.frame() == (1, b"E_AUTH_FAILED AUTH failed")
        assert "Connection refused" in alone.log() or "refused" in alone.log()
        both = make_server(auth_http_address=f"{dead},{authd.address}", auth_http_request_method="post")
        for _ in range(4):  # the first address is chosen at random: both orders come up
            c = Nsq(both.tcp_port)
            c.send(identify(), auth("s"))
            c.frame()
            assert json.loads(c.frame()[1])["identity"] == "app"
            c.close()
        assert all(r["_method"] == "POST" for r in authd.requests)


def test_a_connection_that_failed_auth_publishes_and_receives_nothing(make_server, topic, pg_dsn):
    """Counting. An authorized dmq producer sends 50 messages and an authorized consumer
    receives every id acknowledged to it. Meanwhile: an NSQ client that failed AUTH
    pipelines 20 PUBs to the same topic; a dmq client with a wrong secret pipelines 20
    sends after its UP_AUTH; a dmq client that never authenticated sends 20 (each
    refused E_AUTH_FIRST) and subscribes (refused); an NSQ client without AUTH
    subscribes. None of them stores a message or receives one: the table holds exactly
    the 50 acknowledged ids, and the refused consumers got no push."""
    with AuthServer() as authd:
        authd.allow("producer", "producer", [grant("^orders$", permissions=["publish"])])
        authd.allow("consumer", "consumer", [grant("^orders$", channels=["^billing$"], permissions=["subscribe"])])
        server = make_server(auth_http_address=authd.address)
        bad_nsq = Nsq(server.tcp_port)
        bad_nsq.send(identify(), auth("wrong"), *[pub(topic, b"nsq-%d" % i) for i in range(20)])
        bad_frames = bad_nsq.frames_until_closed()
        assert bad_frames[1:] == [(1, b"E_AUTH_FAILED AUTH failed")]
        bad_dmq = BlockingClient("127.0.0.1", server.tcp_port)
        bad_dmq.write(Frame(Command.UP_AUTH, body=b"wrong"), *[bad_dmq.send_frame(topic, b"bad-%d" % i) for i in range(20)])
        frames = bad_dmq.drain(timeout=5)
        assert [f.command for f in frames if f.command != Command.SERVER_HEALTH] == [Command.PROTOCOL_ERROR]
        assert frames[-1].status == "E_AUTH_FAILED AUTH failed"
        anonymous = BlockingClient("127.0.0.1", server.tcp_port)
        replies = anonymous.send_many(topic, [b"anon-%d" % i for i in range(20)])
        assert {(r.command, r.status) for r in replies} == {
            (Command.SEND_INVALID_ACK, "E_AUTH_FIRST AUTH required before send")}
        assert anonymous.subscribe(topic, "billing").status == "E_AUTH_FIRST AUTH required before subscribe"
        nsq_sub = Nsq(server.tcp_port)
        nsq_sub.send(identify(), f"SUB {topic} billing\n".encode())
        nsq_sub.frame()
        assert nsq_sub.frame() == (1, b"E_AUTH_FIRST AUTH required before SUB")

        producer = BlockingClient("127.0.0.1", server.tcp_port, auth_secret="producer")
        acked = {r.message_id for r in producer.send_many(topic, [b"ok-%d" % i for i in range(50)])
                 if r.command == Command.SEND_SUCCESS_ACK}
        assert len(acked) == 50
        assert producer.subscribe(topic, "billing").status.startswith("E_UNAUTHORIZED")  # publish only
        consumer = BlockingClient("127.0.0.1", server.tcp_port, auth_secret="consumer")
        assert consumer.subscribe(topic, "billing", credit=100).command == Command.SUBSCRIBE_ACK
        delivered = set()
        while len(delivered) < len(acked):
            push = consumer.receive(timeout=10)
            assert push is not None, f"lost: {sorted(acked - delivered)}"
            delivered.add(push.message_id)
            consumer.ack(push)
        assert delivered == acked
        assert anonymous.receive(timeout=1) is None
        stored = {row[0] for row in db_rows(pg_dsn, "SELECT id FROM dmq_message WHERE topic = %s", topic)}
        assert stored == acked
        for client in (bad_dmq, anonymous, producer, consumer):
            client.close()
        for c in (bad_nsq, nsq_sub):
            c.close()


def test_the_admin_console_with_authentication_on(make_server, tmp_path):
    """With an authorizer the console opens for nobody on its own, even on loopback:
    `auth SECRET` with the admin permission opens it, one without is refused
    (E_UNAUTHORIZED), an unknown one fails (E_AUTH_FAILED), --admin-token still works."""
    from .test_admin_surfaces import Console

    with AuthServer() as authd:
        authd.allow("ops", "operator", [grant(".*", permissions=["admin"])])
        authd.allow("pub", "publisher", [grant(".*", permissions=["publish"])])
        admin_port = free_port()
        make_server(auth_http_address=authd.address, admin_address=f"127.0.0.1:{admin_port}", admin_token="break-glass")
        console = Console(admin_port)
        assert "authenticate with: auth TOKEN" in console.banner
        assert console.cmd("stats")[1].startswith("ERR E_AUTH")
        assert console.cmd("auth pub")[1] == "ERR E_UNAUTHORIZED publisher has no admin permission"
        assert console.cmd("auth nope")[1].startswith("ERR E_AUTH_FAILED")
        assert console.cmd("stats")[1].startswith("ERR E_AUTH")
        assert console.cmd("auth ops")[1] == "OK authenticated as operator"
        assert console.cmd("stats")[1].startswith("OK")
        console.close()
        token = Console(admin_port)
        assert token.cmd("auth break-glass")[1] == "OK authenticated"
        assert token.cmd("topics")[1].startswith("OK")
        token.close()


def _window(client: BlockingClient, sends: list[tuple[str, bytes]]) -> list[Frame]:
    """The sends written at once (the server reads them together), their replies in the
    order sent."""
    frames = [client.send_frame(topic, body) for topic, body in sends]
    client.write(*frames)
    replies = {}
    while len(replies) < len(frames):
        reply = client.next_send_reply(timeout=10)
        replies[reply.session_id] = reply
    return [replies[f.session_id] for f in frames]


def test_a_window_of_sends_is_checked_send_by_send_where_the_authorizer_says_no(make_server, topic, pg_dsn):
    """One write of sends from an authorized producer, alternating between a topic it may
    publish to and one it may not (the server admits a run of sends the authorizer allows
    in one call, ``DmqConnection._send_run``): each send to the allowed topic is stored and
    acknowledged, each to the other refused with E_UNAUTHORIZED. Then the authorization's
    ttl (1 s) runs out and a second window waits for the authorizer, asked once, and is
    stored whole. Every id acknowledged is stored, and nothing else."""
    with AuthServer() as authd:
        authd.allow("producer", "producer", [grant(f"^{topic}$", permissions=["publish"])], ttl=1)
        server = make_server(auth_http_address=authd.address)
        producer = BlockingClient("127.0.0.1", server.tcp_port, auth_secret="producer")
        authed_at = time.monotonic()
        plan = [topic] * 3 + ["denied"] * 2 + [topic] * 3 + ["denied"] + [topic] * 4
        replies = _window(producer, [(t, b"w1-%d" % i) for i, t in enumerate(plan)])
        assert [r.command for r in replies] == [
            Command.SEND_SUCCESS_ACK if t == topic else Command.SEND_INVALID_ACK for t in plan]
        assert all(r.status.startswith("E_UNAUTHORIZED") for r, t in zip(replies, plan) if t != topic)
        time.sleep(max(0.0, authed_at + 1.05 - time.monotonic()))  # the ttl itself is under test
        asked = authd.count("producer")
        again = _window(producer, [(topic, b"w2-%d" % i) for i in range(20)])
        assert [r.command for r in again] == [Command.SEND_SUCCESS_ACK] * 20
        assert authd.count("producer") == asked + 1
        acked = {r.message_id for r in replies + again if r.command == Command.SEND_SUCCESS_ACK}
        stored = {row[0] for row in db_rows(pg_dsn, "SELECT id FROM dmq_message WHERE topic = %s", topic)}
        assert stored == acked and len(acked) == 30
        producer.close()


@pytest.mark.parametrize("framing", [LENGTH, CHUNKED, CLOSE])
def test_auth_servers_of_each_framing_are_understood(make_server, framing):
    """An auth server's 200 answer read whole however it is framed, as nsqd's Go client
    reads it: with a Content-Length, chunked, or ended by closing the connection (HTTP/1.0
    without a length: a BaseHTTPRequestHandler's plain answer). AUTH succeeds on both
    protocols and the client publishes."""
    with AuthServer(framing) as authd:
        authd.allow("s", "app", [grant("^t$")])
        server = make_server(auth_http_address=authd.address)
        c = Nsq(server.tcp_port)
        c.send(identify(), auth("s"))
        c.frame()
        assert json.loads(c.frame()[1]) == {"identity": "app", "identity_url": "https://id/app", "permission_count": 1}
        c.send(pub("t", b"nsq"))
        assert c.frame() == (0, b"OK")
        dmq = BlockingClient("127.0.0.1", server.tcp_port, auth_secret="s")
        assert dmq.identity == {"identity": "app", "identity_url": "https://id/app", "permission_count": 1}
        assert dmq.send("t", b"dmq").command == Command.SEND_SUCCESS_ACK
        dmq.close()
        assert authd.count("s") == 2
        assert " failed: " not in server.log_path.read_text()


def _refused_on_both_protocols(server, secret: str) -> None:
    """AUTH with ``secret`` is answered nsqd's E_AUTH_FAILED on NSQ (and the connection
    closed) and on the dmq protocol (PROTOCOL_ERROR, closed)."""
    c = Nsq(server.tcp_port)
    c.send(identify(), auth(secret))
    c.frame()
    assert c.frame() == (1, b"E_AUTH_FAILED AUTH failed"), secret
    assert c.closed()
    with pytest.raises(ClientError, match="server closed the connection: E_AUTH_FAILED AUTH failed"):
        BlockingClient("127.0.0.1", server.tcp_port, auth_secret=secret).close()


def _serves(server, secret: str = "ok") -> None:
    """An authorized client on each protocol authenticates and publishes."""
    c = Nsq(server.tcp_port)
    c.send(identify(), auth(secret))
    c.frame()
    assert json.loads(c.frame()[1])["identity"] == "app"
    c.send(pub("t", b"nsq"))
    assert c.frame() == (0, b"OK")
    with BlockingClient("127.0.0.1", server.tcp_port, auth_secret=secret) as dmq:
        assert dmq.send("t", b"dmq").command == Command.SEND_SUCCESS_ACK


def test_an_auth_server_that_fails_is_a_clear_error_and_the_node_keeps_serving(make_server):
    """Auth servers that fail each their way, against a request timeout of 1 s: one that
    never answers (AUTH fails after the timeout, while other clients authenticate and
    publish meanwhile), one answering a body that is not JSON, one cut short of its
    Content-Length or of its last chunk, one over the size limit (declared, or sent
    without a length), one answering 500, and one that is down (nothing listens). Each
    AUTH is answered E_AUTH_FAILED on both protocols, at once or at the timeout, never
    later; the log says what went wrong, in words; and the node serves after all of it."""
    from dmq_server.security.authorizer import MAX_ANSWER

    with AuthServer() as authd:
        authd.allow("ok", "app", [grant("^t$")])
        for secret, framing in (("cut", CUT_LENGTH), ("cut-chunked", CUT_CHUNKED)):
            authd.allow(secret, "app", [grant("^t$")])
            authd.framings[secret] = framing
        authd.answers["garbage"] = (200, b"<html>not JSON</html>")
        authd.answers["huge"] = authd.answers["huge-declared"] = (200, b" " * (MAX_ANSWER + 1))
        authd.framings["huge"] = CLOSE
        authd.answers["error"] = (500, {"message": "boom"})
        authd.held.add("slow")
        server = make_server(auth_http_address=authd.address, http_client_request_timeout="1s")

        slow = Nsq(server.tcp_port)
        slow.send(identify(), auth("slow"))
        asked_at = time.monotonic()
        slow.frame()
        _serves(server)  # while the slow AUTH waits
        assert slow.frame() == (1, b"E_AUTH_FAILED AUTH failed")
        assert 1.0 <= time.monotonic() - asked_at < 4.0
        for secret in ("slow", "garbage", "cut", "cut-chunked", "huge", "huge-declared", "error"):
            _refused_on_both_protocols(server, secret)
        _serves(server)

        log = server.log_path.read_text()
        failed = f"auth server http://{authd.address}/auth failed: "
        size = len(json.dumps(authd.answers["cut"][1]))
        for why, times in (
            ("no answer within 1 s (--http-client-request-timeout)", 3),
            ("answer is not JSON: Expecting value: line 1 column 1 (char 0)", 2),
            (f"the answer ended after {size} of the {size + 100} bytes its Content-Length declared", 2),
            (f"the answer ended after {size // 2} bytes, short of its end: ConnectionDone: Connection was "
             "closed cleanly.; _DataLoss: Chunked decoder in 'CHUNK_LENGTH' state", 2),
            (f"an answer over the limit of {MAX_ANSWER} bytes (not read further)", 2),
            (f"an answer of {MAX_ANSWER + 1} bytes (Content-Length), over the limit of {MAX_ANSWER}", 2),
            ("status 500 Internal Server Error: b'{\"message\": \"boom\"}'", 2),
        ):
            assert log.count(failed + why) == times, why
        assert "PartialDownloadError" not in log

    down = make_server(auth_http_address=f"127.0.0.1:{free_port()}")
    asked_at = time.monotonic()
    _refused_on_both_protocols(down, "ok")
    assert time.monotonic() - asked_at < 4.0
    assert "failed: cannot connect: Connection was refused by other side" in down.log_path.read_text()
