"""One read-only view of the broker and its stores, for /metrics, /stats and the consoles.

Everything a scrape, a /stats request, the console's overview or the stored-gauge
timer shows of the stores is copied into one ``BrokerSnapshot`` on the reactor thread
(``Broker.snapshot``), so those modules read plain values and never the stores, their
writers or which store a topic is on. A snapshot costs one walk over the topics and
channels; nothing of it is on the publish or delivery path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from dmq_client.diskqueue import DiskQueueError
from dmq_server.fast.fast_channel import FastChannel

__all__ = ["BrokerSnapshot", "FastTopicFigures", "Histogram", "waiting_since"]

#: ``core.buckets.Buckets.snapshot()``: cumulative counts by upper bound, and the sum
Histogram = tuple[list[tuple[str, int]], float]


@dataclass(frozen=True)
class FastTopicFigures:
    """A fast topic as nsqd reports it (``stats``, without clients), its ``depth`` (what
    waits for its first channel) and, per channel, when its longest-waiting message was
    published (nsqd's UnixNano; None: nothing waits)."""

    name: str
    depth: int
    stats: dict[str, Any]
    waiting_since: Mapping[str, int | None]


@dataclass(frozen=True)
class BrokerSnapshot:
    """``stats`` is /stats' JSON (every cluster's counters and the reliable topics with
    their channels); ``histograms`` the broker's and its main store's by /metrics name;
    ``oldest_stored`` each reliable channel's lowest stored id, by (topic, channel)."""

    stats: dict[str, Any]
    histograms: Mapping[str, Histogram]
    fast_topics: tuple[FastTopicFigures, ...] = ()
    oldest_stored: Mapping[tuple[str, str], int | None] = field(default_factory=dict)
    started_at: float = 0.0


def waiting_since(channel: FastChannel) -> int | None:
    """When a fast channel's longest-waiting message was published (nsqd's UnixNano), or
    None when nothing waits: the older of the heads of its memory queue and its disk queue
    (the records read ahead from the disk first, then the file's next record). The heads,
    not a walk of the queues: a message given back (REQ) waits at the back with its first
    publish time, so one behind a head can be older. The channel has no accessor for its
    read-ahead (``_ahead``), so it is read here, as ``stats`` counts it."""
    stamps = [channel.memory[0].timestamp] if channel.memory else []
    ahead = getattr(channel, "_ahead", ())
    head = ahead[0] if ahead else None
    if head is None and not channel.exiting and channel.backend.depth():
        peek = getattr(channel.backend, "peek", None)  # a disk queue's (an ephemeral channel has none)
        try:
            head = peek() if peek is not None else None
        except DiskQueueError:  # closed meanwhile
            head = None
    if head is not None and len(head) >= 8:
        stamps.append(int.from_bytes(head[:8], "big"))  # a record starts with its 8-byte timestamp
    return min(stamps) if stamps else None
