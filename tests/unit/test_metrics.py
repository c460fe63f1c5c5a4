"""The /metrics collector (dmq_server/http/metrics.py) over a hand-made snapshot:
names, types, labels and values as Prometheus' own parser reads them."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dmq_server.http.metrics import DmqCollector, Snapshot

pytestmark = pytest.mark.unit


def _reliable_channel(name: str, **counts: int) -> dict:
    base = {"channel_name": name, "depth": 0, "in_flight_count": 0, "deferred_count": 0, "paused": False,
            "message_count": 0, "requeue_count": 0, "timeout_count": 0, "ack_count": 0, "clients": 0}
    return base | counts


SNAPSHOT = Snapshot(
    node_id="node-1",
    version="0.1.0",
    broker={
        "health": "OK",
        "published": 120,
        "writer": {"batches": 4, "messages": 120, "pending": 2, "unknown_outcomes": 1},
        "acks": {"durable": 90, "refused": 3, "fenced": 2, "pending": 0},
        "rate_limited": 5,
        "delayed": 7,
        "swept": 11,
        "dead_letters": {"recorded_since_start": {"max_attempts": 2, "expired": 1}, "pending": 0},
        "topics": [
            {"topic_name": "orders", "retained_messages": 1500, "retained_bytes": 96000,
             "retained_as_of": 1_700_000_000_250, "channels": [
                _reliable_channel("billing", message_count=120, ack_count=90, depth=20, in_flight_count=10,
                                  requeue_count=4, timeout_count=1, clients=2),
                _reliable_channel("audit", message_count=120, paused=True),
            ]},
            {"topic_name": "fresh", "retained_messages": 0, "retained_bytes": 0, "retained_as_of": None,
             "channels": []},
        ],
    },
    fast_topics=[
        {"topic_name": "clicks", "message_count": 40, "channels": [
            {"channel_name": "counter", "message_count": 40, "finish_count": 38, "depth": 0, "in_flight_count": 2,
             "deferred_count": 0, "requeue_count": 0, "timeout_count": 0, "client_count": 1, "clients": None,
             "paused": False},
        ]},
    ],
    connections={"dmq": 3, "nsq": 2},
    zk_state="SUSPENDED",
    histograms={"dmq_group_commit_batch_size": ([("1.0", 1), ("100.0", 3), ("+Inf", 4)], 321.0)},
)


def scrape(snapshot: Snapshot) -> dict[tuple[str, tuple], float]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DmqCollector(lambda: snapshot))
    text = generate_latest(registry).decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_counters_and_gauges_of_both_stores_carry_store_topic_and_channel():
    s = scrape(SNAPSHOT)
    billing = (("channel", "billing"), ("store", "reliable"), ("topic", "orders"))
    counter = (("channel", "counter"), ("store", "fast"), ("topic", "clicks"))
    assert s[("dmq_channel_messages_total", billing)] == 120
    assert s[("dmq_channel_acked_messages_total", billing)] == 90
    assert s[("dmq_channel_requeued_messages_total", billing)] == 4
    assert s[("dmq_channel_timed_out_messages_total", billing)] == 1
    assert (s[("dmq_channel_depth", billing)], s[("dmq_channel_in_flight", billing)]) == (20, 10)
    assert s[("dmq_channel_consumers", billing)] == 2
    assert s[("dmq_channel_paused", (("channel", "audit"), ("store", "reliable"), ("topic", "orders")))] == 1
    assert s[("dmq_channel_acked_messages_total", counter)] == 38  # nsqd's FIN count
    assert (s[("dmq_channel_in_flight", counter)], s[("dmq_channel_consumers", counter)]) == (2, 1)
    assert s[("dmq_published_messages_total", (("store", "reliable"),))] == 120
    assert s[("dmq_published_messages_total", (("store", "fast"),))] == 40


def test_node_wide_families():
    s = scrape(SNAPSHOT)
    assert s[("dmq_build_info", (("node_id", "node-1"), ("version", "0.1.0")))] == 1
    assert s[("dmq_storage_up", ())] == 1
    assert s[("dmq_group_commits_total", ())] == 4 and s[("dmq_group_commit_messages_total", ())] == 120
    assert s[("dmq_unknown_outcomes_total", ())] == 1
    assert (s[("dmq_acks_durable_total", ())], s[("dmq_acks_refused_total", ())]) == (90, 3)
    assert s[("dmq_acks_fenced_total", ())] == 2
    assert s[("dmq_rate_limited_publishes_total", ())] == 5
    assert s[("dmq_swept_messages_total", ())] == 11
    assert s[("dmq_dead_lettered_messages_total", (("reason", "max_attempts"),))] == 2
    assert s[("dmq_connections", (("protocol", "nsq"),))] == 2
    assert s[("dmq_zookeeper_session", (("state", "SUSPENDED"),))] == 1
    assert s[("dmq_zookeeper_session", (("state", "CONNECTED"),))] == 0
    assert s[("dmq_group_commit_batch_size_bucket", (("le", "100.0"),))] == 3
    assert s[("dmq_group_commit_batch_size_bucket", (("le", "+Inf"),))] == 4
    assert (s[("dmq_group_commit_batch_size_count", ())], s[("dmq_group_commit_batch_size_sum", ())]) == (4, 321)


def test_an_outage_and_a_node_without_zookeeper():
    down = Snapshot(node_id="n", version="v", broker={"health": "ERROR"}, zk_state=None)
    s = scrape(down)
    assert s[("dmq_storage_up", ())] == 0
    assert not any(name == "dmq_zookeeper_session" for name, _ in s)


def test_labels_never_name_a_message_or_a_client():
    """Label values come from bounded sets: stores, registered names, reasons, protocols."""
    allowed = {"store", "topic", "channel", "reason", "protocol", "state", "version", "node_id", "le"}
    assert {key for _, labels in scrape(SNAPSHOT) for key, _ in labels} <= allowed


class _Reactor:
    """Runs callFromThread work on a thread of its own, or never (a reactor that stopped)."""

    def __init__(self, running: bool):
        self.running = running

    def callFromThread(self, fn, *args):
        if self.running:
            import threading

            threading.Thread(target=fn, args=args).start()


def test_the_snapshot_is_taken_on_the_reactor_and_a_stopped_reactor_fails_the_scrape_in_time():
    from dmq_server.http.metrics import DmqCollector

    assert DmqCollector(lambda: SNAPSHOT, _Reactor(True)).snapshot() is SNAPSHOT
    stuck = DmqCollector(lambda: SNAPSHOT, _Reactor(False), timeout=0.05)
    with pytest.raises(TimeoutError, match="within 0.05s"):
        stuck.snapshot()

    def broken():
        raise KeyError("topic vanished")

    with pytest.raises(KeyError):
        DmqCollector(broken, _Reactor(True)).snapshot()


def test_stored_gauges_are_the_timers_last_values_with_ages_computed_at_the_scrape() -> None:
    """The database's figures come from the last refresh (a timer), the oldest message's
    age from its publish time and the snapshot's clock; nothing is read during the scrape."""
    from dataclasses import replace

    stored = {
        "values": {
            "oldest_unacked_ms": {("orders", "billing"): 95_000, ("orders", "audit"): None},
            "delay_pending": {"orders": (12, 200_000)},
            "dead_letters": {"expired": (5, 2)},
        },
        "age": 3.5, "roundtrip": 0.002, "failures": 0, "now": 100.0,
    }
    pool = {"acker": {"connected": True, "busy": False, "queued": 0},
            "loader": {"connected": False, "busy": False, "queued": 4}}
    s = scrape(replace(SNAPSHOT, stored=stored, db_pool=pool))
    billing = (("channel", "billing"), ("store", "reliable"), ("topic", "orders"))
    audit = (("channel", "audit"), ("store", "reliable"), ("topic", "orders"))
    assert s[("dmq_channel_oldest_unacked_age_seconds", billing)] == 5.0
    assert s[("dmq_channel_oldest_unacked_age_seconds", audit)] == 0.0
    assert s[("dmq_delay_pending", (("topic", "orders"),))] == 12
    assert s[("dmq_dead_letters_stored", (("reason", "expired"),))] == 5
    assert s[("dmq_dead_letters_unreplayed", (("reason", "expired"),))] == 3
    assert s[("dmq_stored_gauges_age_seconds", ())] == 3.5
    assert s[("dmq_database_roundtrip_seconds", ())] == 0.002
    assert s[("dmq_database_connection_up", (("role", "loader"),))] == 0
    assert s[("dmq_database_connection_queued", (("role", "loader"),))] == 4
    assert s[("dmq_database_connection_up", (("role", "acker"),))] == 1


def test_without_a_refresh_yet_no_stored_gauge_is_invented() -> None:
    s = scrape(SNAPSHOT)
    assert not [name for name, _ in s if name.startswith(("dmq_channel_oldest", "dmq_delay_pending",
                                                          "dmq_dead_letters_stored", "dmq_database_roundtrip"))]


def test_history_keeps_a_bounded_window_per_channel_and_forgets_channels_that_went() -> None:
    from twisted.internet.task import Clock

    from dmq_server.http.sampling import History

    clock = Clock()
    channels = [("reliable", "orders", "billing", {"depth": 1, "ack_count": 0}),
                ("fast", "clicks", "counter", {"depth": 0})]
    history = History(lambda: channels, clock, points=3)
    for i in range(5):
        channels[0][3]["ack_count"] = 10 * i
        history.sample()
        clock.advance(5)
    exported = history.export()["channels"]
    billing = [c for c in exported if c["channel"] == "billing"][0]
    assert billing["ack_count"] == [20, 30, 40] and billing["t"] == [10.0, 15.0, 20.0]
    del channels[1]
    history.sample()
    assert [c["channel"] for c in history.export()["channels"]] == ["billing"]
    assert history.export(topic="nothing")["channels"] == []


def test_each_reliable_topic_s_retained_messages_and_bytes_are_gauges_with_their_as_of_time():
    """The retained figures of /stats' topics (db.retained) become per-topic gauges; a topic
    not counted yet shows 0 and no as-of time (absent, not 0: 1970 would read as stale)."""
    s = scrape(SNAPSHOT)
    orders, fresh = (("topic", "orders"),), (("topic", "fresh"),)
    assert (s[("dmq_topic_retained_messages", orders)], s[("dmq_topic_retained_bytes", orders)]) == (1500, 96000)
    assert s[("dmq_topic_retained_as_of_seconds", orders)] == 1_700_000_000.25
    assert (s[("dmq_topic_retained_messages", fresh)], s[("dmq_topic_retained_bytes", fresh)]) == (0, 0)
    assert ("dmq_topic_retained_as_of_seconds", fresh) not in s
    assert not any(name.startswith("dmq_topic_retained") and dict(labels).get("topic") == "clicks"
                   for name, labels in s)  # a fast topic keeps nothing in PostgreSQL
