"""``GET /metrics``: the node's counters and gauges in Prometheus' text format.

Served by ``prometheus_client``'s Twisted ``MetricsResource``, which renders the
registry on a thread of the reactor's pool. The broker and the stores belong to the
reactor thread, so the collector does not read them from there: it asks the reactor
for one snapshot per scrape (``callFromThread``, waiting at most ``SNAPSHOT_TIMEOUT``:
a scrape caught by the reactor's shutdown fails instead of holding the thread pool's
join for ever), made of the same stats the
``/stats`` endpoint shows, and builds the metric families from that plain data on the
pool thread. Nothing here touches the publish or delivery path; a scrape costs one
walk over the topics and channels on the reactor.

Why one long module: every family a scrape yields is built here from the one
``Snapshot``, on the pool thread; split by family, the snapshot's shape would be read in
several files and a family could be yielded twice or not at all.

Names follow Prometheus' conventions: the ``dmq_`` prefix, ``_total`` for counters,
base units. Labels are bounded by what the registry holds (``store``, ``topic``,
``channel``) or by fixed sets (``reason``, ``protocol``); never a message id, a client
address or a producer name.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.gc_collector import GCCollector
from prometheus_client.process_collector import ProcessCollector
from prometheus_client.twisted import MetricsResource

from dmq_server.core.gauges import GaugeSnapshot
from dmq_server.core.outbox_figures import PENDING_BOUND, OutboxFigures

__all__ = ["Snapshot", "DmqCollector", "metrics_resource"]

CHANNEL_LABELS = ["store", "topic", "channel"]
SNAPSHOT_TIMEOUT = 5.0


@dataclass
class Snapshot:
    """What one scrape reports, copied on the reactor thread: the broker's ``stats()``,
    the fast store's topics (nsqd's stats shape), connection counts by protocol and
    this node's identity."""

    node_id: str
    version: str
    broker: dict[str, Any]
    fast_topics: list[dict[str, Any]] = field(default_factory=list)
    connections: dict[str, int] = field(default_factory=dict)
    zk_state: str | None = None
    #: ``core.buckets.Buckets.snapshot()`` by histogram name (see HISTOGRAMS)
    histograms: dict[str, tuple[list[tuple[str, int]], float]] = field(default_factory=dict)
    #: ``http.sampling.StoredGauges.snapshot()``: the figures read from PostgreSQL on a timer
    stored: GaugeSnapshot | None = None
    #: each database connection's state by role (``DbWorker.state()``, ``ReactorDb.state()``)
    db_pool: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: ``core.client_memory.ClientMemory.stats()``: the bytes held for clients, by kind, and the budget
    client_memory: dict[str, Any] | None = None
    #: ``protocols.outbox_relay.OutboxRelays.figures()``: each outbox this node relays or stands by for
    outboxes: list[OutboxFigures] = field(default_factory=list)


#: the histograms a snapshot may carry, and what they measure
HISTOGRAMS = {
    "dmq_publish_commit_seconds": "From a reliable send reaching the broker to its group commit "
    "answering (the wait for a batch included): when the producer can be acknowledged.",
    "dmq_group_commit_seconds": "Round trip of one group-commit transaction (statement sent to commit answered).",
    "dmq_group_commit_batch_size": "Messages per group-commit transaction.",
    "dmq_ack_batch_size": "Acknowledgements per durable-ack transaction (its fixed cost is shared by them).",
    "dmq_publish_deliver_seconds": "From a reliable message's commit to its first delivery to a consumer "
    "of a channel (once per channel): how long copies wait, backlogs included.",
    "dmq_reactor_lag_seconds": "How late the reactor thread ran a call due every 25 ms: the time every answer "
    "waits for the thread behind callbacks, collections and a busy host.",
    "dmq_gc_pause_seconds": "Length of each garbage collection (every thread waits for it); "
    "python_gc_collections_total counts them by generation.",
}


#: per-channel counters and gauges: (name, help, key in a channel's stats)
_CHANNEL_COUNTERS = [
    ("dmq_channel_messages", "Messages that entered the channel (a copy of each published message).", "message_count"),
    ("dmq_channel_requeued_messages", "Deliveries put back by the consumer (REQ, a negative ack).", "requeue_count"),
    ("dmq_channel_timed_out_messages", "Deliveries not acknowledged within the message timeout.", "timeout_count"),
]
_CHANNEL_GAUGES = [
    ("dmq_channel_depth", "Messages waiting in the channel, not yet delivered.", "depth"),
    ("dmq_channel_in_flight", "Messages delivered and not yet acknowledged.", "in_flight_count"),
    ("dmq_channel_deferred", "Messages waiting for a requeue delay to pass.", "deferred_count"),
]


def _channels(snapshot: Snapshot) -> Iterator[tuple[list[str], dict[str, Any]]]:
    """Each channel of both stores with its labels."""
    for topic in snapshot.broker.get("topics", []):
        for channel in topic["channels"]:
            yield ["reliable", topic["topic_name"], channel["channel_name"]], channel
    for topic in snapshot.fast_topics:
        for channel in topic["channels"]:
            yield ["fast", topic["topic_name"], channel["channel_name"]], channel


class DmqCollector:
    """A ``prometheus_client`` collector over one ``Snapshot`` per scrape. ``take`` makes
    the snapshot; it runs on the reactor thread (``reactor``), or directly when
    ``reactor`` is None (tests on the reactor thread, or without one)."""

    def __init__(self, take: Callable[[], Snapshot], reactor: Any = None, timeout: float = SNAPSHOT_TIMEOUT):
        self.take = take
        self.reactor = reactor
        self.timeout = timeout

    def snapshot(self) -> Snapshot:
        if self.reactor is None:
            return self.take()
        answer: list[Any] = []
        done = threading.Event()

        def take_on_the_reactor() -> None:
            try:
                answer.append(self.take())
            except BaseException as exc:  # handed to the scraping thread, raised there
                answer.append(exc)
            finally:
                done.set()

        self.reactor.callFromThread(take_on_the_reactor)
        if not done.wait(self.timeout):
            raise TimeoutError(f"the reactor did not take a metrics snapshot within {self.timeout:g}s")
        if isinstance(answer[0], BaseException):
            raise answer[0]
        return answer[0]

    def collect(self) -> Iterator[Metric]:
        snap = self.snapshot()
        broker = snap.broker
        info = GaugeMetricFamily("dmq_build_info", "This node's dmq version and id (the value is 1).",
                                 labels=["version", "node_id"])
        info.add_metric([snap.version, snap.node_id], 1)
        yield info
        yield GaugeMetricFamily(
            "dmq_storage_up", "1 while PostgreSQL takes writes, 0 during an outage.",
            value=1 if broker.get("health") == "OK" else 0,
        )
        if snap.zk_state is not None:
            zk = GaugeMetricFamily("dmq_zookeeper_session", "1 for the ZooKeeper session's current state.",
                                   labels=["state"])
            for state in ("CONNECTED", "SUSPENDED", "LOST"):
                zk.add_metric([state], 1 if snap.zk_state == state else 0)
            yield zk

        published = CounterMetricFamily("dmq_published_messages", "Messages stored for producers, by store.",
                                        labels=["store"])
        published.add_metric(["reliable"], broker.get("published", 0))
        published.add_metric(["fast"], sum(t.get("message_count", 0) for t in snap.fast_topics))
        yield published

        writer, acks = broker.get("writer", {}), broker.get("acks", {})
        for name, documentation, value in (
            ("dmq_group_commits", "Transactions of the group commit (each stores a batch of sends).",
             writer.get("batches", 0)),
            ("dmq_group_commit_messages", "Messages stored by the group commit; divided by "
             "dmq_group_commits_total it is the mean batch size.", writer.get("messages", 0)),
            ("dmq_unknown_outcomes", "Writes whose commit answer was lost (each followed by a re-read).",
             writer.get("unknown_outcomes", 0)),
            ("dmq_acks_durable", "Acknowledgements made durable in PostgreSQL.", acks.get("durable", 0)),
            ("dmq_acks_refused", "Acknowledgements refused (unknown, or no longer in flight).",
             acks.get("refused", 0)),
            ("dmq_acks_fenced", "Acknowledgements not applied because another node had taken their "
             "cursor over (this node's ZooKeeper session was lost), or a seek had rewritten it since "
             "their copies were pushed: the copies are delivered again.",
             acks.get("fenced", 0)),
            ("dmq_rate_limited_publishes", "Publishes refused by a topic's rate limit.",
             broker.get("rate_limited", 0)),
            ("dmq_delayed_messages", "Messages stored for later delivery.", broker.get("delayed", 0)),
            ("dmq_swept_messages", "Messages every channel had acknowledged, removed past --message-retention "
             "by this node's sweep.", broker.get("swept", 0)),
        ):
            yield CounterMetricFamily(name, documentation, value=value)
        yield GaugeMetricFamily("dmq_group_commit_pending", "Sends waiting for the next group commit.",
                                value=writer.get("pending", 0))

        dead = CounterMetricFamily("dmq_dead_lettered_messages",
                                   "Copies moved to the dead letters since start, by reason.", labels=["reason"])
        for reason, count in broker.get("dead_letters", {}).get("recorded_since_start", {}).items():
            dead.add_metric([reason], count)
        yield dead

        counters = {name: CounterMetricFamily(name, doc, labels=CHANNEL_LABELS) for name, doc, _ in _CHANNEL_COUNTERS}
        gauges = {name: GaugeMetricFamily(name, doc, labels=CHANNEL_LABELS) for name, doc, _ in _CHANNEL_GAUGES}
        acked = CounterMetricFamily("dmq_channel_acked_messages", "Deliveries acknowledged (FIN, ack).",
                                    labels=CHANNEL_LABELS)
        consumers = GaugeMetricFamily("dmq_channel_consumers", "Consumers connected to the channel.",
                                      labels=CHANNEL_LABELS)
        paused = GaugeMetricFamily("dmq_channel_paused", "1 while the channel is paused.", labels=CHANNEL_LABELS)
        for labels, channel in _channels(snap):
            for name, _, key in _CHANNEL_COUNTERS:
                counters[name].add_metric(labels, channel.get(key, 0))
            for name, _, key in _CHANNEL_GAUGES:
                gauges[name].add_metric(labels, channel.get(key, 0))
            acked.add_metric(labels, channel.get("ack_count", channel.get("finish_count", 0)))
            consumers.add_metric(labels, channel.get("clients", 0) if labels[0] == "reliable"
                                 else channel.get("client_count", 0))
            paused.add_metric(labels, 1 if channel.get("paused") else 0)
        yield from counters.values()
        yield acked
        yield from gauges.values()
        yield consumers
        yield paused
        yield from _deliveries(snap)
        yield from _retained(snap)
        yield from _clusters(snap)
        yield from _stored(snap)
        yield from _db_pool(snap)
        yield from _client_memory(snap)
        yield from _outboxes(snap)

        for name, (buckets, total) in sorted(snap.histograms.items()):
            histogram = HistogramMetricFamily(name, HISTOGRAMS.get(name, name))
            histogram.add_metric([], buckets, total)
            yield histogram

        connections = GaugeMetricFamily("dmq_connections", "Open client connections, by protocol.",
                                        labels=["protocol"])
        for protocol, count in sorted(snap.connections.items()):
            connections.add_metric([protocol], count)
        yield connections


def _deliveries(snap: Snapshot) -> Iterator[Metric]:
    """Deliveries and redeliveries per reliable channel (RabbitMQ's delivered and
    redelivered totals), and returned deliveries by why they came back."""
    delivered = CounterMetricFamily("dmq_channel_delivered_messages", "Deliveries to consumers, redeliveries "
                                    "included (reliable channels).", labels=CHANNEL_LABELS)
    redelivered = CounterMetricFamily("dmq_channel_redelivered_messages", "Deliveries of a copy delivered "
                                      "before (reliable channels).", labels=CHANNEL_LABELS)
    for labels, channel in _channels(snap):
        if labels[0] == "reliable":
            delivered.add_metric(labels, channel.get("delivery_count", 0))
            redelivered.add_metric(labels, channel.get("redelivery_count", 0))
    yield delivered
    yield redelivered
    trace = snap.broker.get("trace", {})
    returned = CounterMetricFamily("dmq_returned_deliveries", "Deliveries that came back unacknowledged, by "
                                   "why: timeout, consumer_gone, requeued (REQ).", labels=["reason"])
    for reason in ("timeout", "consumer_gone", "requeued"):
        returned.add_metric([reason], trace.get("returned", {}).get(reason, 0))
    yield returned
    yield CounterMetricFamily("dmq_trace_dropped", "Returned deliveries not written to the message trace "
                              "(its queue was full during a database outage).", value=trace.get("dropped", 0))


def _retained(snap: Snapshot) -> Iterator[Metric]:
    """What each reliable topic keeps in PostgreSQL, added up over the clusters holding its
    rows, as the retention sweep's count found it (``db.retained``): exact for every message
    published before ``dmq_topic_retained_as_of_seconds``, younger ones not counted yet."""
    messages = GaugeMetricFamily("dmq_topic_retained_messages", "Messages the reliable topic keeps in PostgreSQL "
                                 "(counted by the retention sweep, up to dmq_topic_retained_as_of_seconds).",
                                 labels=["topic"])
    size = GaugeMetricFamily("dmq_topic_retained_bytes", "Body bytes of the messages the reliable topic keeps "
                             "in PostgreSQL (their lengths as sent; TOAST compression not subtracted).", labels=["topic"])
    as_of = GaugeMetricFamily("dmq_topic_retained_as_of_seconds", "Unix time before which every message of "
                              "the topic is counted in dmq_topic_retained_messages (absent: not counted yet).",
                              labels=["topic"])
    for topic in snap.broker.get("topics", []):
        if "retained_messages" not in topic:
            continue
        labels = [topic["topic_name"]]
        messages.add_metric(labels, topic["retained_messages"])
        size.add_metric(labels, topic["retained_bytes"])
        if topic.get("retained_as_of") is not None:
            as_of.add_metric(labels, topic["retained_as_of"] / 1000)
    yield messages
    yield size
    yield as_of


def _stored(snap: Snapshot) -> Iterator[Metric]:
    """The gauges read from PostgreSQL by a timer (``http.sampling.StoredGauges``)."""
    stored = snap.stored
    if stored is None:
        return  # no sampling on this node
    values = stored["values"]
    if stored["roundtrip"] is not None:
        yield GaugeMetricFamily("dmq_database_roundtrip_seconds", "The last timed round trip to PostgreSQL "
                                "(a ping through a worker connection, every --metrics-db-interval).",
                                value=stored["roundtrip"])
    if values is None:
        return  # not read yet (just started, or PostgreSQL down since the start)
    yield GaugeMetricFamily("dmq_stored_gauges_age_seconds", "Seconds since the gauges read from PostgreSQL "
                            "were refreshed.", value=stored["age"])
    now_ms = stored["now"] * 1000
    oldest = GaugeMetricFamily("dmq_channel_oldest_unacked_age_seconds", "Age of the channel's oldest "
                               "unacknowledged message (its lowest stored id); 0 when none waits.",
                               labels=CHANNEL_LABELS)
    for (topic, channel), published_ms in sorted(values["oldest_unacked_ms"].items()):
        age = 0.0 if published_ms is None else max(0.0, (now_ms - published_ms) / 1000.0)
        oldest.add_metric(["reliable", topic, channel], age)
    yield oldest
    delayed = GaugeMetricFamily("dmq_delay_pending", "Delayed messages waiting to fall due, by topic.",
                                labels=["topic"])
    for topic, (count, _) in sorted(values["delay_pending"].items()):
        delayed.add_metric([topic], count)
    yield delayed
    letters = GaugeMetricFamily("dmq_dead_letters_stored", "Dead letters in the table, by reason.",
                                labels=["reason"])
    unreplayed = GaugeMetricFamily("dmq_dead_letters_unreplayed", "Dead letters not replayed yet, by reason.",
                                   labels=["reason"])
    for reason, (total, replayed) in sorted(values["dead_letters"].items()):
        letters.add_metric([reason], total)
        unreplayed.add_metric([reason], total - replayed)
    yield letters
    yield unreplayed


def _clusters(snap: Snapshot) -> Iterator[Metric]:
    """Per PostgreSQL cluster (``--pg-cluster``; the label's values are the configured
    names, so bounded): is it taking writes, and what its store did."""
    clusters = snap.broker.get("clusters") or {}
    if not clusters:
        return
    up = GaugeMetricFamily("dmq_cluster_up", "1 while the cluster's PostgreSQL takes writes, 0 during an outage.",
                           labels=["cluster"])
    pending = GaugeMetricFamily("dmq_cluster_group_commit_pending", "Sends waiting for the cluster's next group commit.",
                                labels=["cluster"])
    counters = {
        name: CounterMetricFamily(name, doc, labels=["cluster"])
        for name, doc in (("dmq_cluster_published", "Messages stored on the cluster for producers."),
                          ("dmq_cluster_group_commits", "Group-commit transactions on the cluster."),
                          ("dmq_cluster_acks_durable", "Acknowledgements made durable on the cluster."))
    }
    for name, c in sorted(clusters.items()):
        up.add_metric([name], 1 if c["health"] == "OK" else 0)
        pending.add_metric([name], c["writer"]["pending"])
        counters["dmq_cluster_published"].add_metric([name], c["published"])
        counters["dmq_cluster_group_commits"].add_metric([name], c["writer"]["batches"])
        counters["dmq_cluster_acks_durable"].add_metric([name], c["acks"]["durable"])
    yield up
    yield pending
    yield from counters.values()


def _db_pool(snap: Snapshot) -> Iterator[Metric]:
    """Each database connection (one per role) as the server holds it."""
    families = {
        key: GaugeMetricFamily(f"dmq_database_connection_{key}", doc, labels=["role"])
        for key, doc in (("up", "1 while the role's connection to PostgreSQL is open."),
                         ("busy", "1 while the role's connection runs a statement."),
                         ("queued", "Calls waiting for the role's connection."))
    }
    for role, state in sorted(snap.db_pool.items()):
        families["up"].add_metric([role], 1 if state.get("connected") else 0)
        families["busy"].add_metric([role], 1 if state.get("busy") else 0)
        families["queued"].add_metric([role], state.get("queued", 0))
    if snap.db_pool:
        yield from families.values()


def _client_memory(snap: Snapshot) -> Iterator[Metric]:
    """The bytes held on clients' behalf against ``--max-client-memory`` (core.client_memory)."""
    memory = snap.client_memory
    if memory is None:
        return
    held = GaugeMetricFamily(
        "dmq_client_memory_bytes", "Bytes held on clients' behalf, by kind: incomplete frames, sends awaiting "
        "their commit, unsent replies and pushes, the channels' memory windows.", labels=["kind"])
    for kind, size in memory["held"].items():
        held.add_metric([kind], size)
    yield held
    yield GaugeMetricFamily("dmq_client_memory_limit_bytes", "The budget of bytes held for clients "
                            "(--max-client-memory).", value=memory["limit"])
    yield GaugeMetricFamily("dmq_client_memory_stopped_connections", "Connections not read now because the "
                            "budget is spent.", value=memory["stopped"])
    yield CounterMetricFamily("dmq_client_memory_pauses", "Times a connection stopped being read because the "
                              "budget was spent.", value=memory["pauses"])
    yield CounterMetricFamily("dmq_client_memory_episodes", "Times the bytes held for clients went over the "
                              "budget (each logged once, when it starts and when it ends).", value=memory["episodes"])


def _outboxes(snap: Snapshot) -> Iterator[Metric]:
    """Each application outbox this node relays or stands by for (``--outbox``; the label's
    values are the configured names, so bounded). The pending rows, the oldest's age and
    the lock holder are the last reading of the application's database (``protocols.outbox_gauges``:
    every node, once a second, on a connection of its own); a scrape reads no database."""
    if not snap.outboxes:
        return
    label = ["outbox"]
    pending = GaugeMetricFamily(
        "dmq_outbox_pending_rows", f"Committed outbox rows not relayed yet, counted up to {PENDING_BOUND}: "
        "that value means at least as many.", labels=label)
    oldest = GaugeMetricFamily(
        "dmq_outbox_oldest_pending_seconds", "Age of the outbox's oldest pending row (its lowest id; created_at is "
        "its transaction's start); 0 when none waits.", labels=label)
    relayed = CounterMetricFamily("dmq_outbox_relayed", "Outbox rows this node stored into topics.", labels=label)
    dead = CounterMetricFamily("dmq_outbox_dead_lettered", "Outbox rows this node kept as dead letters "
                               "(unknown topic, body over the limit, delay too long).", labels=label)
    relaying = GaugeMetricFamily("dmq_outbox_relaying", "1 on the node that holds the outbox's relay lock.",
                                 labels=label)
    cycle = GaugeMetricFamily("dmq_outbox_last_cycle_seconds", "Seconds since the outbox's relay last began a "
                              "cycle (about 1 when idle; growing: stuck on a database).", labels=label)
    for figures in snap.outboxes:
        labels = [figures.name]
        if figures.pending is not None:  # read at least once
            pending.add_metric(labels, figures.pending)
            oldest.add_metric(labels, figures.oldest_age or 0.0)
        relayed.add_metric(labels, figures.relayed)
        dead.add_metric(labels, figures.dead_lettered)
        relaying.add_metric(labels, 1 if figures.relaying else 0)
        if figures.last_cycle_age is not None:
            cycle.add_metric(labels, figures.last_cycle_age)
    yield from (pending, oldest, relayed, dead, relaying, cycle)


def metrics_resource(take: Callable[[], Snapshot], reactor: Any) -> Any:
    """The ``/metrics`` resource: dmq's collector, the process' CPU, memory and file
    descriptors (``process_*``) and the collector's counts by generation
    (``python_gc_*``), in a registry of this server's own."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DmqCollector(take, reactor))
    ProcessCollector(registry=registry)
    GCCollector(registry=registry)
    return MetricsResource(registry=registry)
