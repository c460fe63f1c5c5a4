"""nsqd's and nsqlookupd's HTTP APIs on a real dmq-server: status codes, messages, headers."""

from __future__ import annotations

import json
import struct
import urllib.error
import urllib.request

import pytest

from .support import db_rows

pytestmark = pytest.mark.integration


def call(server, method: str, path: str, body: bytes | None = None):
    """(status, headers, body) of one request; HTTP errors are answers too."""
    # a body's type is declared, as programs do (any type passes: http/guard.py refuses only
    # what a browser marks as sent by a page of another origin)
    headers = {"Content-Type": "application/octet-stream"} if body is not None else {}
    req = urllib.request.Request(server.http + path, data=body, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers, exc.read()


def v1(server, method: str, path: str, body: bytes | None = None):
    """(status, parsed JSON or text) and checks nsqd's V1 header."""
    status, headers, data = call(server, method, path, body)
    assert headers["X-NSQ-Content-Type"] == "nsq; version=1.0", path
    if "application/json" in headers.get("Content-Type", ""):
        return status, json.loads(data)
    return status, data.decode()


@pytest.fixture
def server(make_server, tmp_path):
    return make_server(data_path=str(tmp_path / "data"), max_msg_size=100)


def test_ping_and_info(server):
    """/ping is plain OK; /info has nsqd's fields (durations in ns) and dmq's."""
    status, headers, body = call(server, "GET", "/ping")
    assert (status, body) == (200, b"OK")
    status, info = v1(server, "GET", "/info")
    assert status == 200 and info["version"] == "1.3.0"
    assert info["tcp_port"] == server.tcp_port and info["http_port"] == server.http_port
    assert info["broadcast_address"] == "127.0.0.1"
    assert info["max_heartbeat_interval"] == 60 * 10**9
    assert info["max_output_buffer_timeout"] == 30 * 10**9
    assert "node_id" in info and "dmq_version" in info


def test_pub_and_its_errors(server):
    """/pub answers OK, or nsqd's status and message for each bad request."""
    assert v1(server, "POST", "/pub?topic=h", b"hello") == (200, "OK")
    assert v1(server, "POST", "/pub?topic=h&defer=500", b"later") == (200, "OK")
    cases = [
        ("/pub?topic=h", b"", 400, "MSG_EMPTY"),
        ("/pub", b"x", 400, "MISSING_ARG_TOPIC"),
        ("/pub?topic=bad!", b"x", 400, "INVALID_TOPIC"),
        ("/pub?topic=h&defer=abc", b"x", 400, "INVALID_DEFER"),
        ("/pub?topic=h&defer=-1", b"x", 400, "INVALID_DEFER"),
        ("/pub?topic=h&defer=3600001", b"x", 400, "INVALID_DEFER"),
        ("/pub?topic=h", b"x" * 101, 413, "MSG_TOO_BIG"),
    ]
    for path, body, status, message in cases:
        assert v1(server, "POST", path, body) == (status, {"message": message}), path
    assert v1(server, "GET", "/pub?topic=h") == (405, {"message": "METHOD_NOT_ALLOWED"})
    assert v1(server, "GET", "/no/such/path") == (404, {"message": "NOT_FOUND"})
    assert v1(server, "POST", "/topic/nonsense?topic=h") == (404, {"message": "NOT_FOUND"})


def test_mpub_text_and_binary(server):
    """Text /mpub splits lines and skips empty ones; binary takes [num][len][data]..."""
    assert v1(server, "POST", "/mpub?topic=m", b"a\n\nb\nc\n") == (200, "OK")
    body = struct.pack(">i", 2) + struct.pack(">i", 3) + b"x\ny" + struct.pack(">i", 1) + b"z"
    assert v1(server, "POST", "/mpub?topic=m&binary=true", body) == (200, "OK")
    assert v1(server, "POST", "/mpub?topic=m", b"ok\n" + b"x" * 101) == (413, {"message": "MSG_TOO_BIG"})
    assert v1(server, "POST", "/mpub?topic=m&binary=1", struct.pack(">i", 0)) == (413, {"message": "BAD_BODY"})
    bad = struct.pack(">ii", 1, 0)
    assert v1(server, "POST", "/mpub?topic=m&binary=true", bad) == (413, {"message": "BAD_MESSAGE"})
    _, stats = v1(server, "GET", "/stats?format=json&topic=m")
    assert stats["topics"][0]["message_count"] == 5


def test_topic_and_channel_admin(server, tmp_path):
    """create/pause/unpause/empty/delete with nsqd's codes; pause state is persisted."""
    assert v1(server, "POST", "/topic/create?topic=adm") == (200, "")
    assert v1(server, "POST", "/topic/create") == (400, {"message": "MISSING_ARG_TOPIC"})
    assert v1(server, "POST", "/topic/create?topic=a*b") == (400, {"message": "INVALID_TOPIC"})
    assert v1(server, "POST", "/channel/create?topic=nope&channel=c") == (404, {"message": "TOPIC_NOT_FOUND"})
    assert v1(server, "POST", "/channel/create?topic=a*b&channel=c") == (400, {"message": "INVALID_ARG_TOPIC"})
    assert v1(server, "POST", "/channel/create?topic=adm") == (400, {"message": "MISSING_ARG_CHANNEL"})
    assert v1(server, "POST", "/channel/create?topic=adm&channel=c!") == (400, {"message": "INVALID_ARG_CHANNEL"})
    assert v1(server, "POST", "/channel/create?topic=adm&channel=c") == (200, "")
    assert v1(server, "POST", "/channel/pause?topic=adm&channel=c") == (200, "")
    assert v1(server, "POST", "/topic/pause?topic=adm") == (200, "")
    meta = json.loads((tmp_path / "data" / "nsq" / "nsqd.dat").read_text())
    assert meta["topics"] == [{"channels": [{"name": "c", "paused": True}], "name": "adm", "paused": True}]
    assert v1(server, "POST", "/pub?topic=adm", b"held")[0] == 200
    _, stats = v1(server, "GET", "/stats?format=json&topic=adm")
    assert stats["topics"][0]["depth"] == 1 and stats["topics"][0]["paused"] is True
    assert v1(server, "POST", "/topic/unpause?topic=adm") == (200, "")
    _, stats = v1(server, "GET", "/stats?format=json&topic=adm")
    assert stats["topics"][0]["channels"][0]["depth"] == 1
    assert v1(server, "POST", "/channel/empty?topic=adm&channel=c") == (200, "")
    assert v1(server, "POST", "/channel/empty?topic=adm&channel=x") == (404, {"message": "CHANNEL_NOT_FOUND"})
    # deleting what is not there succeeds (nsqadmin deletes at the lookupd, then the node: one URL here)
    assert v1(server, "POST", "/channel/delete?topic=adm&channel=x") == (200, "")
    assert v1(server, "POST", "/channel/delete?topic=adm&channel=c") == (200, "")
    assert v1(server, "POST", "/topic/empty?topic=adm") == (200, "")
    assert v1(server, "POST", "/topic/delete?topic=adm") == (200, "")
    assert v1(server, "POST", "/topic/delete?topic=adm") == (200, "")
    assert v1(server, "POST", "/topic/pause?topic=adm") == (404, {"message": "TOPIC_NOT_FOUND"})


def test_stats_formats(server):
    """format=json is nsqd's shape; format=text is nsqd's text; no format stays dmq's JSON."""
    v1(server, "POST", "/pub?topic=s", b"x")
    v1(server, "POST", "/channel/create?topic=s&channel=c")
    _, stats = v1(server, "GET", "/stats?format=json")
    assert set(stats) == {"version", "health", "start_time", "topics", "memory", "producers"}
    (t,) = [t for t in stats["topics"] if t["topic_name"] == "s"]
    assert {"topic_name", "channels", "depth", "backend_depth", "message_count", "message_bytes", "paused",
            "e2e_processing_latency"} <= set(t)
    assert set(t["channels"][0]) >= {"channel_name", "depth", "backend_depth", "in_flight_count",
                                    "deferred_count", "message_count", "requeue_count", "timeout_count",
                                    "client_count", "clients", "paused", "e2e_processing_latency"}
    assert v1(server, "GET", "/stats?format=json&topic=none")[1]["topics"] is None
    _, lean = v1(server, "GET", "/stats?format=json&include_clients=false&include_mem=false")
    assert "memory" not in lean and all(c["clients"] is None for t in lean["topics"] for c in t["channels"])
    status, text = v1(server, "GET", "/stats?format=text")
    assert status == 200 and "Topics:" in text and "[s              ]" in text
    status, _, body = call(server, "GET", "/stats")
    dmq = json.loads(body)
    assert "node_id" in dmq and [t["topic_name"] for t in dmq["fast_topics"]] == ["s"]


def test_lookupd_endpoints(server, topic):
    """/lookup, /topics, /channels, /nodes answer as nsqlookupd for fast and reliable topics."""
    assert v1(server, "GET", "/lookup?topic=unknown") == (404, {"message": "TOPIC_NOT_FOUND"})
    assert v1(server, "GET", "/lookup") == (400, {"message": "MISSING_ARG_TOPIC"})
    v1(server, "POST", "/topic/create?topic=fastone")
    v1(server, "POST", "/channel/create?topic=fastone&channel=x")
    status, found = v1(server, "GET", "/lookup?topic=fastone")
    assert status == 200 and found["channels"] == ["x"]
    (producer,) = found["producers"]
    assert (producer["broadcast_address"], producer["tcp_port"], producer["http_port"]) == (
        "127.0.0.1", server.tcp_port, server.http_port)
    assert v1(server, "GET", "/lookup?topic=orders")[1]["channels"] == ["billing"]
    assert v1(server, "GET", "/topics")[1] == {"topics": ["fastone", "orders"]}
    assert v1(server, "GET", "/channels?topic=orders") == (200, {"channels": ["billing"]})
    assert v1(server, "GET", "/channels?topic=nothing") == (200, {"channels": []})
    assert v1(server, "GET", "/channels") == (400, {"message": "MISSING_ARG_TOPIC"})
    (node,) = v1(server, "GET", "/nodes")[1]["producers"]
    assert node["topics"] == ["fastone", "orders"] and node["tombstones"] == [False, False]
    node_id = f"127.0.0.1:{server.http_port}"
    assert v1(server, "POST", "/topic/tombstone?topic=fastone") == (400, {"message": "MISSING_ARG_NODE"})
    assert v1(server, "POST", f"/topic/tombstone?topic=fastone&node={node_id}") == (200, "")
    assert v1(server, "GET", "/lookup?topic=fastone")[1]["producers"] == []


def test_pub_to_a_reliable_topic_is_stored_before_ok(server, topic, pg_dsn):
    """/pub to a registered reliable topic answers OK only once the row is committed."""
    assert v1(server, "POST", f"/pub?topic={topic}", b"via-http") == (200, "OK")
    assert db_rows(pg_dsn, "SELECT body FROM dmq_message") == [(b"via-http",)]
    assert v1(server, "POST", f"/mpub?topic={topic}", b"a\nb") == (200, "OK")
    assert len(db_rows(pg_dsn, "SELECT 1 FROM dmq_message")) == 3
    status, answer = v1(server, "POST", f"/topic/delete?topic={topic}")
    assert status == 400 and answer["message"].startswith("RELIABLE_TOPIC")  # never 403
