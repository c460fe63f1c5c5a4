"""/stats shapes: nsqd's JSON pieces for reliable channels and dmq consumers, the Go
memory keys, and nsqd's ``printStats`` text format."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterable
from typing import Any

from dmq_server.broker.interfaces import BrokerPort
from dmq_server.core.nsq_identify import VERSION
from dmq_server.core.outbox_figures import OutboxFigures, OutboxJson, figures_json

__all__ = ["consumer_stats", "reliable_topic_stats", "memory_stats", "text_stats", "outbox_stats"]


def reliable_topic_stats(broker: BrokerPort, name: str, row: Any, channel: str | None, include_clients: bool) -> dict:
    """A reliable topic in nsqd's TopicStats shape (plus ``store``, ``cluster`` and the
    ``retained_*`` figures)."""
    channels = []
    for cname in sorted(row.channels):
        if channel is not None and cname != channel:
            continue
        ch = broker.channels.get((name, cname))
        if ch is None:
            continue
        clients = [consumer_stats(c) for c in ch.consumers] if include_clients else None
        channels.append(
            {
                "channel_name": cname,
                "depth": ch.depth,
                "backend_depth": max(ch.depth - ch.waiting, 0),  # waiting in PostgreSQL
                "in_flight_count": len(ch.in_flight) - len(ch.deferred),
                "deferred_count": len(ch.deferred),
                "message_count": ch.message_count,
                "requeue_count": ch.requeue_count,
                "timeout_count": ch.timeout_count,
                "client_count": len(ch.consumers),
                "clients": clients,
                "paused": ch.held,
                "e2e_processing_latency": {"count": 0, "percentiles": None},
                # the seeks this node has applied (each raises the channel's epoch): an
                # operator, or a test, sees that a node has taken a seek in
                "epoch": ch.epoch,
            }
        )
    return {
        "topic_name": name,
        "channels": channels,
        "depth": 0,
        "backend_depth": 0,
        "message_count": sum(c["message_count"] for c in channels),
        "message_bytes": 0,
        "paused": False,
        "e2e_processing_latency": {"count": 0, "percentiles": None},
        "store": "reliable",
        "cluster": getattr(row, "cluster", "main"),  # the PostgreSQL cluster it is placed on
        # what PostgreSQL keeps of it, counted by the retention sweep (db.retained)
        **broker.retained(name),
    }


def consumer_stats(consumer: Any) -> dict:
    conn = getattr(consumer, "conn", None)
    if conn is not None and hasattr(conn, "stats"):
        return conn.stats()
    peer = getattr(getattr(consumer, "connection", None), "peer", "?")
    return {
        "client_id": peer,
        "hostname": peer.rsplit(":", 1)[0],
        "version": "dmq",
        "remote_address": peer,
        "state": 3,
        "ready_count": getattr(consumer, "credit", 0),
        "in_flight_count": getattr(consumer, "in_flight", 0),
        "message_count": 0,
        "finish_count": 0,
        "requeue_count": 0,
        "connect_ts": 0,
        "sample_rate": 0,
        "deflate": False,
        "snappy": False,
        "user_agent": "dmq",
        "tls": False,
        "tls_cipher_suite": "",
        "tls_version": "",
        "tls_negotiated_protocol": "",
        "tls_negotiated_protocol_is_mutual": False,
        "topology_zone": "",
        "topology_region": "",
    }


def memory_stats(gc_pauses: Any = None) -> dict[str, int]:
    """Go's memory stats keys, filled with what Python can tell cheaply; the GC pause
    percentiles from ``gc_pauses`` (``core.stalls.GcPauses``) when the node records them."""
    rss = 0
    try:
        with open("/proc/self/statm") as f:
            rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    pauses = gc_pauses.percentiles_usec() if gc_pauses is not None else {100: 0, 99: 0, 95: 0}
    return {
        "heap_objects": 0,
        "heap_idle_bytes": 0,
        "heap_in_use_bytes": rss,
        "heap_released_bytes": 0,
        "gc_pause_usec_100": pauses[100],
        "gc_pause_usec_99": pauses[99],
        "gc_pause_usec_95": pauses[95],
        "next_gc_bytes": 0,
        "gc_total_runs": sum(s.get("collections", 0) for s in gc.get_stats()),
    }


def outbox_stats(figures: Iterable[OutboxFigures]) -> list[OutboxJson]:
    """``/stats``' ``outboxes``: each application outbox this node relays or stands by for
    (``core.outbox_figures``), without its DSN."""
    return [figures_json(one) for one in figures]


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m}m{s}s"
    if m:
        return f"{m}m{s}s"
    return f"{s}s"


def _client_line(c: dict) -> str:
    port = c["remote_address"].rsplit(":", 1)[-1]
    ident = f"{c['client_id']}:{port} {c['user_agent']}"
    age = _duration(time.time() - c["connect_ts"])
    if c.get("pub_counts"):
        total = sum(p["count"] for p in c["pub_counts"])
        topics = ",".join(f"{p['topic']}={p['count']}" for p in c["pub_counts"])
        return f"[{c['version']} {ident:<21}] msgs: {total:<8} topics: {topics} connected: {age}"
    return (
        f"[{c['version']} {ident:<21}] state: {c['state']} inflt: {c['in_flight_count']:<4} "
        f"rdy: {c['ready_count']:<4} fin: {c['finish_count']:<8} re-q: {c['requeue_count']:<8} "
        f"msgs: {c['message_count']:<8} connected: {age}"
    )


def text_stats(topics: list | None, memory: dict | None, health: str, started: float, producers: list) -> str:
    """nsqd's ``printStats`` text."""
    out = [f"nsqd v{VERSION} (dmq)"]
    out.append("start_time " + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)))
    out.append(f"uptime {_duration(time.time() - started)}")
    out.append(f"\nHealth: {health}")
    if memory is not None:
        out.append("\nMemory:")
        for key, value in memory.items():
            out.append(f"   {key:<25}\t{value}")
    topics = topics or []
    out.append("\nTopics: None" if not topics else "\nTopics:")
    for t in topics:
        prefix = "*P " if t["paused"] else "   "
        out.append(
            f"{prefix}[{t['topic_name']:<15}] depth: {t['depth']:<5} be-depth: {t['backend_depth']:<5} "
            f"msgs: {t['message_count']:<8} e2e%: "
        )
        for c in t["channels"]:
            prefix = "   *P " if c["paused"] else "      "
            out.append(
                f"{prefix}[{c['channel_name']:<25}] depth: {c['depth']:<5} be-depth: {c['backend_depth']:<5} "
                f"inflt: {c['in_flight_count']:<4} def: {c['deferred_count']:<4} re-q: {c['requeue_count']:<5} "
                f"timeout: {c['timeout_count']:<5} msgs: {c['message_count']:<8} e2e%: "
            )
            for client in c["clients"] or []:
                out.append(f"        {_client_line(client)}")
    if not producers:
        out.append("\nProducers: None")
    else:
        out.append("\nProducers:")
        for p in producers:
            out.append(f"   {_client_line(p)}")
    return "\n".join(out) + "\n"
