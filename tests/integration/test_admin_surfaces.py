"""The admin console and the HTTP admin API over real sockets, against a real server.

Covers the operations (stats, topics, clients, delay, dead letters list/show/
replay/delete, client reports), malformed input (a clear ERR, the session goes
on) and tokens (missing or wrong: refused).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request

from dmq_client.wire import Command

from .support import db_rows, free_port, run_cli, wait_for
from .test_deadletters import add_dead_letter


class Console:
    """A telnet-like session: send a line, read until the OK/ERR status line."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.file = self.sock.makefile("rb")
        self.banner = self.readline()

    def readline(self) -> str:
        line = self.file.readline()
        if not line:
            raise AssertionError("console closed the connection")
        return line.decode("utf-8").rstrip("\r\n")

    def raw(self, data: bytes) -> tuple[list[str], str]:
        self.sock.sendall(data)
        return self.answer()

    def answer(self) -> tuple[list[str], str]:
        lines = []
        while True:
            line = self.readline()
            if line.startswith("OK") or line.startswith("ERR "):
                return lines, line
            lines.append(line)

    def cmd(self, line: str) -> tuple[list[str], str]:
        return self.raw(line.encode("utf-8") + b"\r\n")

    def data(self, line: str) -> list:
        lines, status = self.cmd(line)
        assert status.startswith("OK"), status
        return [json.loads(x) for x in lines if x.startswith("{")]

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def admin_server(make_server, **flags):
    port = free_port()
    server = make_server(admin_address=f"127.0.0.1:{port}", delay_poll_interval="100ms", **flags)
    server.admin_port = port
    return server


def http(server, method: str, path: str, token: str | None = None, body: bytes | None = None):
    headers = {"Content-Type": "application/json"} if body is not None else {}
    request = urllib.request.Request(server.http + path, data=body, method=method, headers=headers)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_console_operations(make_server, topic, pg_dsn):
    """help, stats, topics, clients, delay and the dead-letter commands answer with data
    lines and one OK; replay delivers to the channel; delete removes; both are audited."""
    server = admin_server(make_server)
    console = Console(server.admin_port)
    try:
        assert console.banner.startswith("# dmq admin console") and "help" in console.banner
        lines, status = console.cmd("help")
        assert status.startswith("OK") and any("dlq replay" in line for line in lines)
        stats = console.data("stats")[0]
        assert stats["server"]["health"] == "OK" and "dead_letters" in stats["stored"]
        assert [t["name"] for t in console.data("topics")] == [topic]
        with server.client() as consumer:
            assert consumer.subscribe(topic, "billing").command == Command.SUBSCRIBE_ACK
            clients = console.data("clients")
            assert [s["channel"] for c in clients for s in c["subscriptions"]] == ["billing"]
            delay = console.data("delay")[0]
            assert [w["range"] for w in delay["workers"]] == ["1-4", "5-8"] and delay["pending"] == 0

            first = add_dead_letter(pg_dsn, topic=topic, body=b"one")
            second = add_dead_letter(pg_dsn, topic=topic, reason="max_attempts", body=b"two")
            assert [r["id"] for r in console.data(f"dlq list topic={topic} reason=expired")] == [first]
            shown = console.data(f"dlq show {first}")[0]
            assert shown["body"] == "one" and shown["channel"] == "billing"
            lines, status = console.cmd(f"dlq replay {first}")
            assert status == "OK replayed 1" and lines == ["PROGRESS replayed 1/1"]
            push = consumer.receive(timeout=10)
            assert push is not None and push.body == b"one"
            consumer.ack(push)
            lines, status = console.cmd(f"dlq replay {first}")
            assert status == "OK replayed 0"
            assert console.cmd(f"dlq delete ids={second}")[1] == "OK deleted 1"
        assert [r["id"] for r in console.data("dlq list")] == [first]
        log = db_rows(pg_dsn, "SELECT surface, operation, affected FROM dmq_admin_log ORDER BY id")
        assert log == [("console", "dlq.replay", 1), ("console", "dlq.replay", 0), ("console", "dlq.delete", 1)]
        assert console.cmd("quit")[1] == "OK bye"
    finally:
        console.close()


def test_console_malformed_commands_get_clear_errors_and_the_session_goes_on(make_server, topic):
    """Unknown verbs, bad options, bad quoting, bad UTF-8, overlong lines and destructive
    commands without a selection each get one specific ERR; the next command still works."""
    server = admin_server(make_server)
    console = Console(server.admin_port)
    try:
        cases = [
            (b"frobnicate now\n", "ERR E_UNKNOWN_COMMAND unknown command 'frobnicate now'"),
            (b"dlq list reason=bored\n", "ERR E_INVALID reason: unknown reason 'bored'"),
            (b"dlq list colour=red\n", "ERR E_INVALID unknown filter 'colour'"),
            (b"dlq list since=yesterday\n", "ERR E_INVALID since: invalid time 'yesterday'"),
            (b"dlq list limit=0\n", "ERR E_INVALID limit: expected 1..10000"),
            (b"dlq show\n", "ERR E_INVALID usage: dlq show ID"),
            (b'dlq list topic="orders\n', "ERR E_INVALID cannot parse the line"),
            (b"dlq delete\n", "ERR E_INVALID delete needs a selection"),
            (b"dlq replay topic=\n", "ERR E_INVALID topic: empty name"),
            (b"stats extra\n", "ERR E_INVALID unexpected word 'extra'"),
            (b"\xff\xfe\n", "ERR E_BAD_ENCODING commands must be UTF-8 text"),
            (b"x" * 20000 + b"\n", "ERR E_LINE_TOO_LONG"),
        ]
        for data, expected in cases:
            _, status = console.raw(data)
            assert status.startswith(expected), (data[:40], status)
            assert console.data("topics")[0]["name"] == topic  # still usable
        # pipelined commands are answered in order
        console.sock.sendall(b"topics\nnope\ntopics\n")
        assert [console.answer()[1] for _ in range(3)] == [
            "OK 1 topics",
            "ERR E_UNKNOWN_COMMAND unknown command 'nope'; type help for the commands",
            "OK 1 topics",
        ]
    finally:
        console.close()


def test_console_token_missing_or_wrong_is_refused(make_server, topic):
    """With --admin-token, commands before auth and auth with a wrong token are refused;
    the right token opens the session."""
    server = admin_server(make_server, admin_token="s3cret")
    console = Console(server.admin_port)
    try:
        assert "auth TOKEN" in console.banner
        assert console.cmd("stats")[1].startswith("ERR E_AUTH")
        assert console.cmd("dlq delete all")[1].startswith("ERR E_AUTH")
        assert console.cmd("help")[1].startswith("OK")  # help needs no token
        assert console.cmd("auth wrong")[1] == "ERR E_AUTH wrong admin token"
        assert console.cmd("auth")[1] == "ERR E_INVALID usage: auth TOKEN"
        assert console.cmd("stats")[1].startswith("ERR E_AUTH")
        assert console.cmd("auth s3cret")[1] == "OK authenticated"
        assert console.data("topics")[0]["name"] == topic
    finally:
        console.close()


def test_http_admin_api_operations(make_server, topic, pg_dsn):
    """The JSON admin API offers the same operations; bad input is a 4xx JSON error."""
    server = admin_server(make_server)
    status, index = http(server, "GET", "/admin")
    assert status == 200 and "GET /admin/dead-letters" in index["endpoints"]
    status, stats = http(server, "GET", "/admin/stats")
    assert status == 200 and stats["server"]["node_id"] and stats["delay"]["fragments"] == 8
    assert http(server, "GET", "/admin/topics")[1]["topics"][0]["name"] == topic
    assert http(server, "GET", "/admin/clients") == (200, {"clients": []})
    assert http(server, "GET", "/admin/delay")[1]["owned"] == list(range(1, 9))

    letter = add_dead_letter(pg_dsn, topic=topic, body=b"http")
    other = add_dead_letter(pg_dsn, topic=topic, reason="rate_limited", channel=None)
    status, listed = http(server, "GET", "/admin/dead-letters?reason=expired")
    assert status == 200 and [r["id"] for r in listed["dead_letters"]] == [letter]
    assert http(server, "GET", f"/admin/dead-letters/{letter}")[1]["body"] == "http"
    with server.client() as consumer:
        assert consumer.subscribe(topic, "billing").command == Command.SUBSCRIBE_ACK
        assert http(server, "POST", f"/admin/dead-letters/replay?ids={letter}") == (200, {"replayed": 1})
        assert http(server, "POST", f"/admin/dead-letters/replay?ids={letter}") == (200, {"replayed": 0})
        push = consumer.receive(timeout=10)
        assert push.body == b"http"
        consumer.ack(push)
    assert http(server, "DELETE", f"/admin/dead-letters/{other}") == (200, {"deleted": 1})

    report = json.dumps({"topic": topic, "producer": "p1", "session_id": 99, "body": "lost", "detail": "db down"})
    status, created = http(server, "POST", "/admin/dead-letters", body=report.encode())
    assert status == 200
    assert db_rows(pg_dsn, "SELECT reason, producer, session_id, body, detail FROM dmq_dead_letter WHERE id = %s",
                   created["id"]) == [("client_reported", "p1", 99, b"lost", "db down")]

    errors = [
        ("GET", "/admin/nothing", None, 404, "E_NOT_FOUND"),
        ("GET", "/admin/dead-letters/abc", None, 400, "E_INVALID"),
        ("GET", "/admin/dead-letters/999999", None, 404, "E_NOT_FOUND"),
        ("DELETE", "/admin/dead-letters/999999", None, 404, "E_NOT_FOUND"),
        ("GET", "/admin/dead-letters?reason=bored", None, 400, "E_INVALID"),
        ("POST", "/admin/dead-letters/delete", None, 400, "E_INVALID"),
        ("POST", "/admin/dead-letters/replay?all=maybe", None, 400, "E_INVALID"),
        ("POST", "/admin/dead-letters", b"{not json", 400, "E_INVALID"),
        ("POST", "/admin/dead-letters", b'{"producer": "p"}', 400, "E_INVALID"),
    ]
    for method, path, body, code, error in errors:
        status, payload = http(server, method, path, body=body)
        assert (status, payload["error"]) == (code, error), (method, path, payload)
        assert payload["message"]
    log = db_rows(pg_dsn, "SELECT surface, operation, affected FROM dmq_admin_log ORDER BY id")
    # every destructive attempt is audited, the one that found nothing too
    assert log == [
        ("http", "dlq.replay", 1),
        ("http", "dlq.replay", 0),
        ("http", "dlq.delete", 1),
        ("http", "dlq.delete", 0),
    ]


def test_http_admin_token_missing_or_wrong_is_refused(make_server, topic, pg_dsn):
    """With --admin-token the admin API on loopback is read-only without the token (a
    change answers 401), refuses a wrong token (401), and lets the token change things;
    the nsqd API beside it is not affected; `dmq clients` passes the token."""
    server = admin_server(make_server, admin_token="s3cret")
    assert http(server, "GET", "/admin/stats")[0] == 200
    assert http(server, "GET", "/admin/whoami")[1]["admin"] is False
    status, payload = http(server, "POST", "/admin/dead-letters/delete?all=true")
    assert (status, payload["error"]) == (401, "E_AUTH") and "read-only" in payload["message"]
    status, payload = http(server, "GET", "/admin/stats", token="nope")
    assert (status, payload["error"], payload["message"]) == (401, "E_AUTH", "wrong admin token")
    assert http(server, "POST", "/admin/dead-letters/delete?all=true", token="nope")[0] == 401
    assert http(server, "GET", "/admin/whoami", token="s3cret")[1]["admin"] is True
    assert http(server, "POST", "/admin/dead-letters/delete?all=true", token="s3cret") == (200, {"deleted": 0})
    with urllib.request.urlopen(server.http + "/ping", timeout=5) as resp:
        assert resp.status == 200
    address = f"127.0.0.1:{server.http_port}"
    refused = run_cli(pg_dsn, "--http-address", address, "clients", "--admin-token", "wrong")
    assert refused.returncode == 1 and "wrong admin token" in refused.stderr
    with server.client() as consumer:
        assert consumer.subscribe(topic, "billing").command == Command.SUBSCRIBE_ACK
        listed = run_cli(pg_dsn, "--http-address", address, "clients", "--admin-token", "s3cret")
        assert listed.returncode == 0 and "1 clients" in listed.stdout and f"{topic}/billing" in listed.stdout
