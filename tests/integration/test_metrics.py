"""``GET /metrics`` on a real server: Prometheus' parser reads it, and its counters are
what the test did (sends through the dmq protocol and NSQ, deliveries, FINs)."""

from __future__ import annotations

import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .support import wait_for

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
    assert s[("dmq_connections", (("protocol", "nsq"),))] == 3
    assert s[("dmq_connections", (("protocol", "dmq"),))] == 0
    assert s[("process_cpu_seconds_total", ())] > 0  # the process collector, for CPU per message
    (build,) = [labels for name, labels in s if name == "dmq_build_info"]
    assert dict(build)["node_id"].endswith(f":{server.tcp_port}")  # hostname:port, the default id
