"""The message trace, peek, the delay view and the admin API's rights on a real server:
what the test did to a message (REQ, a consumer gone, an ack, a timeout into a dead
letter, a replay) is what ``GET /admin/messages/ID`` and ``dmq trace`` tell, in order;
peeking consumes nothing; changes need rights, a header a form cannot send and no foreign
origin."""

from __future__ import annotations

import json
import urllib.request

import pytest

from dmq_client.wire import Command
from dmq_server.admin.inspect import describe_event

from .support import run_cli, wait_for
from .test_admin_surfaces import http
from .support import NsqSocket

pytestmark = pytest.mark.integration


def register(pg_dsn, topic, *channels, **settings):
    import registry
    from dmq_server.db.worker import connect

    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, topic, **settings)
        for channel in channels:
            registry.add_channel(conn, topic, channel)


def nsq(server, client_id):
    return NsqSocket(server.tcp_port, {"client_id": client_id, "feature_negotiation": True})


def events(trace):
    return [(e["event"], e.get("channel"), e.get("reason") or e.get("consumer", "").split("@")[0], e.get("attempt"))
            for e in trace["events"]]


def test_a_messages_life_through_the_api_and_the_cli(make_server, pg_dsn):
    register(pg_dsn, "orders", "billing", "audit")
    server = make_server(delay_poll_interval="100ms")
    with server.client() as producer:
        first = producer.send("orders", b'{"order": 1}')
        second = producer.send("orders", b'{"order": 2}')
        producer_name = producer.producer
    assert first.command == second.command == Command.SEND_SUCCESS_ACK
    m1, m2 = first.message_id, second.message_id

    a = nsq(server, "a")
    a.sub("orders", "billing", rdy=1)
    _, attempts, wire_id, body = a.message()
    assert body == b'{"order": 1}'
    a.send(b"REQ " + wire_id + b" 0\n")  # given back
    assert a.message()[1] == 2
    a.close()  # gone with it
    b = nsq(server, "b")
    b.sub("orders", "billing", rdy=2)
    got = {b.message()[2] for _ in range(2)}  # m1 (attempt 3) and m2 (attempt 1)
    b.send(b"FIN " + f"{m1:016x}".encode() + b"\n")
    assert f"{m2:016x}".encode() in got

    def settled():  # the returns and the ack are written by different batchers: wait for both
        status, trace = http(server, "GET", f"/admin/messages/{m1}")
        return status == 200 and len(trace["events"]) == 7 and trace

    trace = wait_for(settled)
    assert events(trace) == [
        ("stored", None, "", None),
        ("delivered", "billing", "nsq a", 1), ("returned", "billing", "requeued", 1),
        ("delivered", "billing", "nsq a", 2), ("returned", "billing", "consumer_gone", 2),
        ("delivered", "billing", "nsq b", 3), ("acked", "billing", "nsq b", 3),
    ]
    stored = trace["stored"]
    assert (stored["topic"], stored["body"], stored["node_id"]) == ("orders", '{"order": 1}', trace["node_id"])
    assert trace["pending"] == [{"channel": "audit", "attempts": 0, "owner": trace["node_id"]}]
    times = [e["at_ms"] for e in trace["events"]]
    assert times == sorted(times)
    # m2 is in flight to b right now: the live part says so
    status, live = http(server, "GET", f"/admin/messages/{m2}")
    assert live["live"]["billing"]["state"] == "in_flight" and live["live"]["billing"]["consumer"].startswith("nsq b@")
    assert live["live"]["billing"]["deadline_ms"] > live["live"]["billing"]["delivered_ms"]
    # by producer and session id
    assert http(server, "GET", f"/admin/messages?producer={producer_name}&session_id={first.session_id}") == (
        200, {"message_id": m1})
    assert http(server, "GET", "/admin/messages/999999999")[0] == 404
    # the CLI tells the same from PostgreSQL alone
    printed = run_cli(pg_dsn, "trace", str(m1))
    assert printed.returncode == 0, printed.stderr
    lines = printed.stdout.splitlines()
    assert lines[0] == f"message {m1} on topic orders, 12 bytes"
    assert [line.split("  ", 2)[2] for line in lines[1:8]] == [describe_event(e) for e in trace["events"]]
    assert lines[1].endswith(f"stored by {trace['node_id']} (producer {producer_name}, session {first.session_id})")
    assert "the consumer gave it back (REQ)" in lines[3] and "the consumer went away" in lines[5]
    assert lines[8].startswith("  waiting on audit: 0 attempts recorded")
    as_json = json.loads(run_cli(pg_dsn, "trace", str(m1), "--json").stdout)
    assert as_json["events"] == trace["events"]

    # peek: the audit channel's two waiting copies, read twice, consumed by nobody
    for _ in range(2):
        status, peek = http(server, "GET", "/admin/channels/orders/audit/peek?limit=10")
        assert status == 200
        assert [(m["message_id"], m["body"], m["attempts"]) for m in peek["messages"]] == [
            (m1, '{"order": 1}', 0), (m2, '{"order": 2}', 0)]
    printed = run_cli(pg_dsn, "peek", "orders", "audit")
    assert printed.returncode == 0 and str(m1) in printed.stdout and "order\": 2" in printed.stdout
    status, page = http(server, "GET", "/admin/channels/orders/billing")
    assert [c["name"].split("@")[0] for c in page["consumers"]] == ["nsq b"]
    assert page["stats"]["redelivery_count"] == 2
    with server.client() as auditor:
        auditor.subscribe("orders", "audit", credit=10)
        assert {auditor.receive(timeout=5).message_id for _ in range(2)} == {m1, m2}
    b.close()


def test_a_dead_letter_and_its_replay_are_in_both_traces(make_server, pg_dsn):
    register(pg_dsn, "slow", "c", msg_timeout_ms=300, max_attempts=1)
    server = make_server(delay_poll_interval="100ms")
    with server.client() as producer:
        m = producer.send("slow", b"never acked").message_id
    c = nsq(server, "c")
    c.sub("slow", "c", rdy=1)
    c.message()  # and never acknowledged: back after 300 ms, then out of attempts

    def dead():  # the return and the dead letter are written by different batchers
        trace = http(server, "GET", f"/admin/messages/{m}")[1]
        return len(trace["events"]) == 4 and trace

    trace = wait_for(dead)
    assert events(trace) == [("stored", None, "", None), ("delivered", "c", "nsq c", 1),
                             ("returned", "c", "timeout", 1), ("dead_letter", "c", "max_attempts", 1)]
    letter = trace["events"][-1]["dead_letter_id"]
    assert http(server, "POST", f"/admin/dead-letters/replay?ids={letter}") == (200, {"replayed": 1})
    replayed = wait_for(lambda: (t := http(server, "GET", f"/admin/messages/{m}")[1])["events"][-1].get(
        "replay_message_id") and t)
    again = replayed["events"][-1]["replay_message_id"]
    status, copy = http(server, "GET", f"/admin/messages/{again}")
    assert copy["replay_of"]["dead_letter_id"] == letter and copy["replay_of"]["message_id"] == m
    assert copy["stored"]["body"] == "never acked"
    c.close()


def test_the_delay_view_lists_delivers_now_cancels_and_audits(make_server, pg_dsn):
    from dmq_server.core.nsq_wire import encode_command

    register(pg_dsn, "orders", "billing")
    server = make_server(delay_poll_interval="100ms")
    producer = NsqSocket(server.tcp_port)
    for body, delay in ((b"in half an hour", b"1800000"), (b"in an hour", b"3600000")):  # nsqd's DPUB maximum
        assert producer.send(encode_command(b"DPUB", b"orders", delay, body=body)).response() == b"OK"
    status, entries = http(server, "GET", "/admin/delay/entries?topic=orders")
    assert [d["body"] for d in entries["delayed"]] == ["in half an hour", "in an hour"]
    soon, later = (d["delay_id"] for d in entries["delayed"])
    status, histogram = http(server, "GET", "/admin/delay/histogram?width=30m")
    assert [b["count"] for b in histogram["buckets"]] == [1, 1]
    consumer = nsq(server, "d")
    consumer.sub("orders", "billing", rdy=1)
    assert http(server, "POST", f"/admin/delay/deliver-now?ids={soon}") == (200, {"changed": [soon]})
    assert consumer.message()[3] == b"in half an hour"
    assert http(server, "POST", f"/admin/delay/cancel?ids={later}") == (200, {"changed": [later]})
    assert http(server, "GET", "/admin/delay/entries")[1]["delayed"] == []
    audit = http(server, "GET", "/admin/audit")[1]["audit"]
    assert [(a["operation"], a["filters"], a["affected"]) for a in audit[:2]] == [
        ("delay.cancel", f"ids={later}", 1), ("delay.deliver-now", f"ids={soon}", 1)]
    consumer.close()
    producer.close()


def test_the_trace_peek_and_the_delay_view_show_a_messages_properties(make_server, pg_dsn):
    """A message sent with a key, a priority and headers, one without, and a delayed one
    with them: the admin API's trace, peek and delay entries give the three (JSON ``key``,
    ``priority``, ``headers``, as a dead letter's), and so do ``dmq trace`` and ``dmq peek``
    (issue 45). The headers come in jsonb's order of names, shortest first."""
    import time

    from dmq_client.wire import MessageType
    from dmq_client.wire.properties import Properties

    register(pg_dsn, "orders", "billing")
    server = make_server()
    headers = {"content-type": "application/json", "tenant": "\u00e9t\u00e9"}
    with server.client() as producer:
        sent = producer.send("orders", b'{"order": 7}', key="order-7", priority=5, headers=headers)
        plain = producer.send("orders", b"plain")
        frame = producer.send_frame("orders", b"later", properties=Properties("later-1", 9, {"x-trace": "abc"}))
        frame.msg_type, frame.due_ms = MessageType.DELAY, int(time.time() * 1000) + 3_600_000
        producer.write(frame)
        later = producer.next_send_reply(timeout=10)
    assert sent.command == plain.command == later.command == Command.SEND_SUCCESS_ACK, sent.status
    props = lambda d: (d["key"], d["priority"], d["headers"])  # noqa: E731
    shown = ("order-7", 5, headers)

    # the trace: the stored message's, a plain one's, the delay entry's
    assert props(http(server, "GET", f"/admin/messages/{sent.message_id}")[1]["stored"]) == shown
    assert props(http(server, "GET", f"/admin/messages/{plain.message_id}")[1]["stored"]) == (None, 0, None)
    assert props(http(server, "GET", f"/admin/messages/{later.message_id}")[1]["delayed"]) == (
        "later-1", 9, {"x-trace": "abc"})
    printed = run_cli(pg_dsn, "trace", str(sent.message_id))
    assert printed.returncode == 0, printed.stderr
    assert printed.stdout.splitlines()[1:4] == [
        "  key order-7, priority 5", "  header tenant: \u00e9t\u00e9", "  header content-type: application/json"]
    assert props(json.loads(run_cli(pg_dsn, "trace", str(sent.message_id), "--json").stdout)["stored"]) == shown
    lines = run_cli(pg_dsn, "trace", str(plain.message_id)).stdout.splitlines()
    assert lines[1].split("  ", 2)[2].startswith("stored by")  # no properties: nothing said of them
    lines = run_cli(pg_dsn, "trace", str(later.message_id)).stdout.splitlines()
    assert lines[0].startswith(f"delay entry {later.message_id}: orders")
    assert lines[1:] == ["  key later-1, priority 9", "  header x-trace: abc"]

    # peek: each waiting copy with its message's properties
    status, peek = http(server, "GET", "/admin/channels/orders/billing/peek")
    assert [(m["message_id"], *props(m)) for m in peek["messages"]] == [
        (sent.message_id, *shown), (plain.message_id, None, 0, None)]
    printed = run_cli(pg_dsn, "peek", "orders", "billing")
    assert printed.returncode == 0, printed.stderr
    head, first, second = (line.split("\t") for line in printed.stdout.splitlines())
    assert head[5:8] == ["key", "priority", "headers"]
    assert first[5:] == ["order-7", "5", '{"tenant":"\u00e9t\u00e9","content-type":"application/json"}', "'{\"order\": 7}'"]
    assert second[5:] == ["-", "0", "-", "'plain'"]
    as_json = json.loads(run_cli(pg_dsn, "peek", "orders", "billing", "--json").stdout)
    assert [props(m) for m in as_json] == [shown, (None, 0, None)]

    # the delay view: the entry with the properties its message will have
    status, entries = http(server, "GET", "/admin/delay/entries?topic=orders")
    assert [(d["delay_id"], *props(d)) for d in entries["delayed"]] == [
        (later.message_id, "later-1", 9, {"x-trace": "abc"})]


def call(server, method, path, headers=None):
    request = urllib.request.Request(server.http + path, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_changes_from_another_origin_are_refused(make_server, pg_dsn):
    register(pg_dsn, "orders", "billing")
    server = make_server()
    pause = "/admin/channels/orders/billing/pause"
    own = f"http://127.0.0.1:{server.http_port}"
    assert call(server, "POST", pause, {"Origin": "http://evil.example"})[0] == 403
    assert call(server, "POST", pause, {"Sec-Fetch-Site": "cross-site"})[0] == 403
    assert call(server, "GET", "/admin/overview", {"Origin": "http://evil.example"})[0] == 403
    assert call(server, "POST", pause, {"Origin": own}) == (200, {"ok": "pause orders/billing"})
    status, overview = call(server, "GET", "/admin/overview")
    (orders,) = [t for t in overview["topics"] if t["topic"] == "orders"]
    assert orders["channels"][0]["paused"] is True
    assert call(server, "POST", "/admin/channels/orders/billing/unpause", {"Authorization": "Bearer anything"})[0] == 200
