"""``GET /metrics`` on a real server: Prometheus' parser reads it, and its counters are
what the test did (sends through the dmq protocol and NSQ, deliveries, FINs)."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .support import http_get, wait_for

pytestmark = pytest.mark.integration


def scrape(server) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(server.http + "/metrics", timeout=5) as reply:
        assert reply.status == 200
        assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
        text = reply.read().decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_metrics_count_what_producers_and_consumers_did(make_server, topic, pg_dsn, tmp_path, nsq_connect):
    from dmq_client.wire import Command
    from dmq_server.db.worker import connect
    import registry

    with connect(pg_dsn, autocommit=True) as conn:
        registry.create_topic(conn, "clicks", store="fast")
    server = make_server(data_path=str(tmp_path / "data"))
    billing = nsq_connect(server.tcp_port, {"feature_negotiation": True})
    billing.sub(topic, "billing", rdy=20)
    counter = nsq_connect(server.tcp_port, {"feature_negotiation": True})
    counter.sub("clicks", "counter", rdy=20)

    with server.client() as producer:  # the dmq protocol, to both stores
        replies = producer.send_many(topic, [b"order-%d" % i for i in range(20)])
        assert {r.command for r in replies} == {Command.SEND_SUCCESS_ACK}
        replies = producer.send_many("clicks", [b"click-%d" % i for i in range(6)])
        assert {r.command for r in replies} == {Command.SEND_SUCCESS_ACK}
    nsq_producer = nsq_connect(server.tcp_port)
    for i in range(4):
        assert nsq_producer.pub("clicks", b"nsq-click-%d" % i) == b"OK"

    orders = [billing.message() for _ in range(20)]
    for _, _, wire_id, _ in orders[:15]:
        billing.send(b"FIN " + wire_id + b"\n")
    clicks = [counter.message() for _ in range(10)]
    for _, _, wire_id, _ in clicks:
        counter.send(b"FIN " + wire_id + b"\n")

    reliable = (("channel", "billing"), ("store", "reliable"), ("topic", topic))
    fast = (("channel", "counter"), ("store", "fast"), ("topic", "clicks"))
    # FINs are answered by nothing: wait until the server has counted them (acks made durable)
    s = wait_for(lambda: (m := scrape(server))[("dmq_acks_durable_total", ())] == 15
                 and m[("dmq_channel_acked_messages_total", fast)] == 10 and m)
    assert s[("dmq_published_messages_total", (("store", "reliable"),))] == 20
    assert s[("dmq_published_messages_total", (("store", "fast"),))] == 10
    assert s[("dmq_channel_messages_total", reliable)] == 20
    assert s[("dmq_channel_acked_messages_total", reliable)] == 15
    assert (s[("dmq_channel_in_flight", reliable)], s[("dmq_channel_depth", reliable)]) == (5, 0)
    assert s[("dmq_channel_consumers", reliable)] == 1
    assert s[("dmq_channel_messages_total", fast)] == 10
    assert (s[("dmq_channel_in_flight", fast)], s[("dmq_channel_depth", fast)]) == (0, 0)
    assert s[("dmq_group_commit_messages_total", ())] == 20
    assert 1 <= s[("dmq_group_commits_total", ())] <= 20
    assert s[("dmq_storage_up", ())] == 1
    # every stored send's publish -> commit time, every batch's size and round trip
    assert s[("dmq_publish_commit_seconds_count", ())] == 20
    assert s[("dmq_publish_commit_seconds_bucket", (("le", "+Inf"),))] == 20
    assert 0 < s[("dmq_publish_commit_seconds_sum", ())] < 20 * 5
    assert s[("dmq_group_commit_batch_size_sum", ())] == 20
    assert s[("dmq_group_commit_batch_size_count", ())] == s[("dmq_group_commits_total", ())]
    assert s[("dmq_group_commit_seconds_count", ())] == s[("dmq_group_commits_total", ())]
    assert s[("dmq_ack_batch_size_sum", ())] == 15  # every durable ack, in one batch or more
    assert 1 <= s[("dmq_ack_batch_size_count", ())] <= 15
    assert s[("dmq_connections", (("protocol", "nsq"),))] == 3
    assert s[("dmq_connections", (("protocol", "dmq"),))] == 0
    assert s[("process_cpu_seconds_total", ())] > 0  # the process collector, for CPU per message
    (build,) = [labels for name, labels in s if name == "dmq_build_info"]
    assert dict(build)["node_id"].endswith(f":{server.tcp_port}")  # hostname:port, the default id


def test_redeliveries_delays_dead_letters_and_the_database_are_counted(make_server, topic, pg_dsn, nsq_connect):
    """Every delivery and redelivery, each return by its reason (REQ, a consumer gone, the
    message timeout), the publish -> deliver histogram, and the gauges read from PostgreSQL
    by the timer (oldest unacknowledged message, delayed messages, stored dead letters,
    round trip, connections) match what the test did; the trace tables hold the same."""
    import json
    import urllib.request

    from dmq_client.wire import Command
    from dmq_server.core.nsq_wire import encode_command
    from dmq_server.db.worker import connect
    import registry

    from .support import db_rows

    with connect(pg_dsn, autocommit=True) as conn:
        registry.add_channel(conn, topic, "audit")  # nobody consumes it: its oldest copy ages
        registry.create_topic(conn, "slow", msg_timeout_ms=300)
        registry.add_channel(conn, "slow", "c")
    # the oldest copy's id comes from the depth count's passes (one per channel-state interval)
    server = make_server(metrics_db_interval="0.2s", channel_state_interval="0.5s")
    import time

    first_sent = time.time()
    with server.client() as producer:
        assert {r.command for r in producer.send_many(topic, [b"o-%d" % i for i in range(6)])} == {
            Command.SEND_SUCCESS_ACK}
        assert producer.send("slow", b"s-1").command == Command.SEND_SUCCESS_ACK

    a = nsq_connect(server.tcp_port, {"client_id": "a", "feature_negotiation": True})
    a.sub(topic, "billing", rdy=6)
    first = [a.message() for _ in range(6)]
    for _, _, wire_id, _ in first[:2]:
        a.send(b"REQ " + wire_id + b" 0\n")  # given back: delivered again at once
    again = [a.message() for _ in range(2)]
    assert sorted(m[1] for m in again) == [2, 2]  # attempts
    a_name = f"nsq a@127.0.0.1:{a.sock.getsockname()[1]}"
    a.close()  # six copies in flight go back: the consumer is gone
    b = nsq_connect(server.tcp_port, {"client_id": "b", "feature_negotiation": True})
    b.sub(topic, "billing", rdy=6)
    for _, attempts, wire_id, _ in [b.message() for _ in range(6)]:
        assert attempts >= 2
        b.send(b"FIN " + wire_id + b"\n")
    c = nsq_connect(server.tcp_port, {"client_id": "c", "feature_negotiation": True})
    c.sub("slow", "c", rdy=1)
    c.message()  # not acknowledged: back after the 300 ms timeout
    _, attempts, wire_id, _ = c.message()
    assert attempts == 2
    c.send(b"FIN " + wire_id + b"\n")
    delayed = nsq_connect(server.tcp_port)
    assert delayed.send(encode_command(b"DPUB", topic.encode(), b"3600000", body=b"later")).response() == b"OK"
    report = urllib.request.Request(
        server.http + "/admin/dead-letters", method="POST",
        data=json.dumps({"topic": topic, "producer": "p", "body": "lost"}).encode(),
    )
    with urllib.request.urlopen(report, timeout=5) as reply:
        assert reply.status == 200

    billing = (("channel", "billing"), ("store", "reliable"), ("topic", topic))
    audit = (("channel", "audit"), ("store", "reliable"), ("topic", topic))
    s = wait_for(lambda: (m := scrape(server))[("dmq_acks_durable_total", ())] == 7
                 and m.get(("dmq_delay_pending", (("topic", topic),))) == 1
                 and m.get(("dmq_dead_letters_stored", (("reason", "client_reported"),))) == 1
                 and m.get(("dmq_channel_oldest_unacked_age_seconds", billing)) == 0
                 and m.get(("dmq_channel_oldest_unacked_age_seconds", audit), 0) > 0 and m)
    assert s[("dmq_channel_delivered_messages_total", billing)] == 6 + 2 + 6
    assert s[("dmq_channel_redelivered_messages_total", billing)] == 2 + 6
    assert s[("dmq_channel_delivered_messages_total", audit)] == 0
    returned = {r: s[("dmq_returned_deliveries_total", (("reason", r),))] for r in ("requeued", "consumer_gone", "timeout")}
    assert returned == {"requeued": 2, "consumer_gone": 6, "timeout": 1}
    assert s[("dmq_publish_deliver_seconds_count", ())] == 6 + 1  # first deliveries only
    assert 0 < s[("dmq_channel_oldest_unacked_age_seconds", audit)] <= time.time() - first_sent + 1  # the first send's
    assert s[("dmq_dead_letters_unreplayed", (("reason", "client_reported"),))] == 1
    assert 0 < s[("dmq_database_roundtrip_seconds", ())] < 5
    assert s[("dmq_stored_gauges_age_seconds", ())] < 5
    assert s[("dmq_database_connection_up", (("role", "metrics"),))] == 1
    assert s[("dmq_database_connection_up", (("role", "acker"),))] == 1
    assert s[("dmq_trace_dropped_total", ())] == 0
    # the same facts, stored for the message trace
    port = lambda sock: f"127.0.0.1:{sock.sock.getsockname()[1]}"  # noqa: E731
    rows = wait_for(lambda: (r := db_rows(pg_dsn, "SELECT reason, consumer FROM dmq_trace")) and len(r) == 9 and r)
    assert sorted(rows) == sorted([("requeued", a_name)] * 2 + [("consumer_gone", a_name)] * 6
                                  + [("timeout", f"nsq c@{port(c)}")])
    acked = db_rows(pg_dsn, "SELECT channel, consumer, delivered_at >= first_delivered_at FROM dmq_delivery_log")
    assert sorted(acked) == sorted([("billing", f"nsq b@{port(b)}", True)] * 6 + [("c", f"nsq c@{port(c)}", True)])


def test_a_node_held_up_by_its_host_shows_the_stall_in_stats_and_metrics(make_server):
    """SIGSTOP for 0.4 s (the host taking the CPU away, as a paused VM or a stopped
    container): the reactor's timer runs late by about that much, and ``/stats`` names
    when; ``/metrics`` counts it in the lag histogram next to the collector's figures."""
    import json
    import signal
    import time

    server = make_server()
    status, body = http_get(server.http + "/stats")
    assert status == 200 and json.loads(body)["pauses"]["reactor_lag"]["interval_s"] == 0.025
    stopped = time.time()
    server.proc.send_signal(signal.SIGSTOP)
    try:
        time.sleep(0.4)  # the fault's length, not a wait for the server
    finally:
        resumed = time.time()
        server.proc.send_signal(signal.SIGCONT)

    def the_stall() -> list:
        _, body = http_get(server.http + "/stats")
        stalls = json.loads(body)["pauses"]["reactor_lag"]["stalls"]
        return [s for s in stalls if s["seconds"] >= 0.3]

    (stall,) = wait_for(the_stall)
    assert stopped - 0.1 <= stall["at"] <= resumed and stall["seconds"] <= resumed - stopped + 0.5
    s = scrape(server)
    assert s[("dmq_reactor_lag_seconds_count", ())] > s[("dmq_reactor_lag_seconds_bucket", (("le", "0.25"),))]
    assert s[("dmq_reactor_lag_seconds_sum", ())] >= 0.3
    assert s[("python_gc_collections_total", (("generation", "2"),))] >= 1  # start-up's full collection
    assert ("dmq_gc_pause_seconds_count", ()) in s
    _, body = http_get(server.http + "/stats?format=json")
    memory = json.loads(body)["memory"]
    assert memory["gc_pause_usec_100"] >= memory["gc_pause_usec_99"] >= memory["gc_pause_usec_95"] >= 0
