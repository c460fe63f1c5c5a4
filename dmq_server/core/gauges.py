"""The figures a timer reads from PostgreSQL for /metrics and the consoles, by shape.

``db.trace_steps.read_gauges`` answers a ``Gauges``; ``http.sampling.StoredGauges``
keeps the last one and hands a scrape (``http.metrics``) or the console overview
(``admin.inspect``) a ``GaugeSnapshot``. Stated here, below both, so the HTTP and admin
modules read one shape without importing each other.
"""

from __future__ import annotations

from typing import TypedDict

__all__ = ["Gauges", "GaugeSnapshot"]


class Gauges(TypedDict):
    """``db.trace_steps.read_gauges``' answer: each channel's oldest unacknowledged
    publish time (Unix ms, None: none waits or not stored here), each topic's delayed
    messages (count, earliest due), stored dead letters by reason (total, replayed)."""

    oldest_unacked_ms: dict[tuple[str, str], int | None]
    delay_pending: dict[str, tuple[int, int | None]]
    dead_letters: dict[str, tuple[int, int]]


class GaugeSnapshot(TypedDict):
    """``StoredGauges.snapshot``: the last values (None: not read yet), how old they are
    and the last ping's roundtrip (seconds), the failed reads, the time now."""

    values: Gauges | None
    age: float | None
    roundtrip: float | None
    failures: int
    now: float
